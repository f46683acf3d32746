"""``lapse import``: a pretrained Hugging Face LLaMA-family model as a lapse run folder.

The folder is what ``lapse train`` leaves (:mod:`lapse.models.checkpoint`), so every
command that reads runs takes it: ``lapse generate RUN`` (the compiled decode step, the
eviction policies), ``lapse eval ... RUN``, ``lapse bench decode --run RUN``, ``lapse
export``, and ``lapse train PRESET --init-from RUN [--model.attention dcp]``, which
fine-tunes it with its architecture and tokenizer. It holds::

    config.json            a TrainConfig as the trainer writes it: the transformer-llama
                           ModelConfig (lapse.hf.convert), the tokenizer's path
    checkpoint-0000000/    model.safetensors (float32) and manifest.json (no trainer
                           state: nothing was trained here)
    checkpoint.json        the pointer to it
    tokenizer/             the model's own tokenizer (``save_pretrained``; lapse reads it
                           with ``transformers``), its end-of-text token the eos
    imported.json          the source, and lapse's logits against the model's on a probe

The folder is written under a temporary name and renamed when complete.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from lapse.files import write_json_atomic
from lapse.models.checkpoint import (
    CONFIG_FILE,
    IMPORTED_FILE,
    MANIFEST_FILE,
    MANIFEST_FORMAT,
    POINTER,
    WEIGHTS_FILE,
    file_digest,
)

from .config import ImportConfig, TrainConfig
from .trainer import config_to_json

PROBE = "The quick brown fox jumps over the lazy dog. def add(a, b): return a + b"
"""The text whose logits ``lapse import`` compares between the two models."""


def _is_model_folder(path: Path) -> bool:
    """Whether ``path`` holds a lapse run's ``config.json`` (model and corpus) or a Hugging Face
    model's (a ``model_type``); another file of that name (a project's) does not count."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and ({"model", "corpus"} <= config.keys() or "model_type" in config)


def import_pretrained(model: str | Path, out: str | Path, gguf_file: str | None = None) -> dict:
    """Write the run folder ``out`` from the pretrained model at ``model``; returns what
    ``imported.json`` holds (the source, the architecture, the probe's largest logit error).

    Raises ``NotRepresentable`` (a ``ValueError``) naming what lapse cannot hold (biases,
    sliding windows, RoPE scaling, a non-SiLU MLP, a model type outside llama and mistral),
    ``FileNotFoundError`` for a missing model and ``ValueError`` when ``out`` is in use.
    """
    from lapse.hf import decoder_from_hf, load_for_import  # transformers: only when importing

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: choose another --out")
    inside = next((p for p in out.resolve().parents if _is_model_folder(p)), None)
    if inside is not None:  # a training run, or a model folder: its files are not a parent's place
        raise ValueError(f"{out} is inside {inside}, a run or model folder: choose an --out outside it")
    hf_model, tokenizer, config = load_for_import(model, gguf_file)
    decoder = decoder_from_hf(hf_model)
    error = probe_error(hf_model, decoder, tokenizer)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer.save_pretrained(str(tmp / "tokenizer"))
        checkpoint = tmp / "checkpoint-0000000"
        checkpoint.mkdir()
        save_file(decoder.state_dict(), checkpoint / WEIGHTS_FILE, metadata={"step": "0"})
        manifest = {"format": MANIFEST_FORMAT, "version": 1, "step": 0,
                    "files": {WEIGHTS_FILE: file_digest(checkpoint / WEIGHTS_FILE)}}
        write_json_atomic(checkpoint / MANIFEST_FILE, manifest)
        write_json_atomic(tmp / POINTER, {"step": 0, "folder": checkpoint.name})
        # the trainer's config, pointing at the folder's final place
        final_tokenizer = out.resolve() / "tokenizer"
        cfg = TrainConfig(model=config, tokenizer=str(tmp / "tokenizer"), run_dir=out, preset_name="import",
                          progress=False)
        saved = config_to_json(cfg)
        saved["tokenizer"] = str(final_tokenizer)
        write_json_atomic(tmp / CONFIG_FILE, saved)
        info = {
            "source": str(model),
            "gguf_file": gguf_file,
            "model_type": hf_model.config.model_type,
            "arch": config.name,
            "tied_embeddings_copied": bool(getattr(hf_model.config, "tie_word_embeddings", False)),
            "eos_id": int(tokenizer.eos_token_id),
            "probe_tokens": error["tokens"],
            "probe_max_abs_logit_error": error["max_abs"],
        }
        write_json_atomic(tmp / IMPORTED_FILE, info)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


@torch.no_grad()
def probe_error(hf_model, decoder, tokenizer, text: str = PROBE) -> dict:
    """The largest absolute difference between the two models' float32 logits on ``text``
    (its first 32 tokens)."""
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)[:32]])
    ours, _ = decoder(ids)
    theirs = hf_model(ids).logits.float()
    return {"tokens": ids.shape[1], "max_abs": float((ours - theirs).abs().max())}


def describe(info: dict, out: Path) -> str:
    """The line ``lapse import`` prints."""
    tied = "; the tied output head copied into lapse's untied one" if info["tied_embeddings_copied"] else ""
    return (
        f"wrote {out} ({info['arch']} from a {info['model_type']} model{tied}); logits against the "
        f"original on {info['probe_tokens']} tokens: max |error| {info['probe_max_abs_logit_error']:.2e}"
    )


__all__ = ["PROBE", "ImportConfig", "describe", "import_pretrained", "probe_error"]
