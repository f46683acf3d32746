"""Evaluations: per-token loss, perplexity, needle in a haystack, ACP statistics and maps,
the lm-evaluation-harness adapter, and reports (``lapse eval ...``, ``lapse report``).

Every evaluation loads models with :func:`lapse.eval.common.load_model` and writes JSON,
PNG plots and a Markdown summary into its output folder.
"""

from lapse.eval.common import LoadedModel, eval_windows, export_hf, load_model

__all__ = ["LoadedModel", "eval_windows", "export_hf", "load_model"]
