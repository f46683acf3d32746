"""Evaluations: per-token loss, perplexity, needle in a haystack, ACP statistics and maps,
the lm-evaluation-harness adapter, and reports (``lapse eval ...``, ``lapse report``).

Every evaluation loads models with :func:`lapse.eval.common.load_model` and writes JSON,
PNG plots and a Markdown summary into its output folder. Their settings are in
:mod:`.config`, which imports no torch; each name here loads with its submodule on first use.
"""

from lapse.lazy import exports

__all__, __getattr__, __dir__ = exports(__name__, {
    ".common": ("LoadedModel", "eval_windows", "export_hf", "load_model"),
})
