"""The Hugging Face adapter (``lapse.hf``) on tiny CPU models.

``generate`` with the lapse cache must equal ``generate`` without one (and lapse's own
:func:`lapse.generation.generate`) token for token; a ``save_pretrained`` folder must load
back, through the Auto classes too, with identical logits and config.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from lapse.generation import generate  # noqa: E402
from lapse.hf import CACHE_ARG, LapseCache, LapseConfig, LapseForCausalLM, output_cache  # noqa: E402
from lapse.models import ARCHS, PRESETS, ModelConfig, preset  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def _hf_model(arch: str, **overrides) -> LapseForCausalLM:
    """init_std 0.1 as in test_generation: greedy choices are not near-ties."""
    torch.manual_seed(0)
    config = LapseConfig.from_model_config(preset("tiny", arch, init_std=0.1, **overrides))
    return LapseForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", PRESETS)
def test_config_round_trip(name, arch):
    config = preset(name, arch, n_kv_heads=2 if name == "tiny" else None, acp=arch.startswith("fox"))
    hf = LapseConfig.from_model_config(config, eos_token_id=3)
    assert hf.to_model_config() == config
    assert hf.hidden_size == config.d_model and hf.num_hidden_layers == config.n_layers
    assert LapseConfig.from_dict(hf.to_dict()).to_model_config() == config


def test_config_fields_mirror_model_config():
    assert {f for f in vars(ModelConfig()) if not f.startswith("_")} <= set(LapseConfig().to_dict())


def test_bad_config_raises():
    with pytest.raises(ValueError, match="must divide d_model"):
        LapseConfig(d_model=64, n_heads=5)
    with pytest.raises(TypeError, match="ModelConfig"):
        LapseConfig.from_model_config({"arch": "fox-pro"})


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_cached_equals_uncached(arch):
    model = _hf_model(arch, n_kv_heads=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 7))
    kwargs = {"max_new_tokens": 20, "do_sample": False}
    cached = model.generate(ids, use_cache=True, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert cached.shape == (2, 27)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, generate(model.model, ids, 20))


def test_generate_sampling_and_beam_search():
    model = _hf_model("fox-pro")
    ids = torch.randint(0, model.config.vocab_size, (2, 5))
    runs = []
    for use_cache in (True, False):
        torch.manual_seed(1)
        runs.append(model.generate(ids, max_new_tokens=12, do_sample=True, top_k=20, use_cache=use_cache))
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], model.generate(ids, max_new_tokens=12, do_sample=False))
    # beam search reorders the cache's batch rows (LapseCache.reorder_cache)
    beams = [
        model.generate(ids, max_new_tokens=8, num_beams=3, do_sample=False, use_cache=use_cache)
        for use_cache in (True, False)
    ]
    assert torch.equal(beams[0], beams[1])


def test_forward_cache_and_loss():
    model = _hf_model("transformer-pro")
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    out = model(ids, labels=ids)
    assert isinstance(output_cache(out), LapseCache) and output_cache(out).length == 9
    # Hugging Face labels are unshifted: position t predicts labels[:, t + 1]
    expected = F.cross_entropy(out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    torch.testing.assert_close(out.loss, expected)
    step = model(ids[:, :6])
    step = model(ids[:, 6:], **{CACHE_ARG: output_cache(step)})
    torch.testing.assert_close(step.logits, out.logits[:, 6:], atol=2e-5, rtol=0)
    assert output_cache(model(ids, use_cache=False)) is None
    assert isinstance(model(ids, return_dict=False), tuple)


def test_forward_takes_the_cache_under_either_name():
    """``cache`` (transformers >= 5.24) and ``past_key_values`` (before) are one argument:
    either continues the cache, both as one cache are fine, two different caches raise."""
    model = _hf_model("transformer-llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    whole = model(ids).logits
    for name in ("cache", "past_key_values"):
        cache = output_cache(model(ids[:, :6]))
        step = model(ids[:, 6:], **{name: cache})
        assert output_cache(step) is cache and cache.length == 9
        torch.testing.assert_close(step.logits, whole[:, 6:], atol=2e-5, rtol=0)
    cache = output_cache(model(ids[:, :6]))
    both = model(ids[:, 6:], cache=cache, past_key_values=cache).logits  # one cache under both names
    torch.testing.assert_close(both, whole[:, 6:], atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="two different caches"):
        model(ids[:, 6:], cache=cache, past_key_values=LapseCache(model.config.n_layers))
    with pytest.raises(TypeError, match="must be a lapse.hf.LapseCache"):
        model.prepare_inputs_for_generation(ids, past_key_values=object())


@pytest.mark.parametrize("arch", ARCHS)
def test_padded_batches_equal_each_prompt_alone(arch):
    """Left padding (what ``generate`` wants), cached and uncached, and a right-padded
    forward: every row equals that prompt run alone."""
    model = _hf_model(arch, n_kv_heads=2)
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, model.config.vocab_size, (n,), generator=gen) for n in (6, 2, 9)]
    t = max(len(p) for p in prompts)
    left = torch.zeros(3, t, dtype=torch.long)
    mask = torch.zeros(3, t, dtype=torch.long)
    for b, p in enumerate(prompts):
        left[b, t - len(p) :], mask[b, t - len(p) :] = p, 1
    for use_cache in (True, False):
        out = model.generate(
            left, attention_mask=mask, max_new_tokens=10, do_sample=False, use_cache=use_cache, pad_token_id=0
        )
        for b, p in enumerate(prompts):
            alone = model.generate(p[None], max_new_tokens=10, do_sample=False)
            assert torch.equal(out[b, t:], alone[0, len(p) :]), (use_cache, b)
    right = torch.zeros(3, t, dtype=torch.long)
    for b, p in enumerate(prompts):
        right[b, : len(p)] = p
    logits = model(right, attention_mask=(right != 0).long()).logits
    labels = right.masked_fill(right == 0, -100)
    loss = model(left, attention_mask=mask, labels=left.masked_fill(mask == 0, -100)).loss
    expected = []
    for b, p in enumerate(prompts):
        one = model(p[None], labels=p[None])
        torch.testing.assert_close(logits[b, : len(p)], one.logits[0], atol=2e-5, rtol=0)
        expected.append(F.cross_entropy(one.logits[0, :-1], p[1:], reduction="sum"))
    torch.testing.assert_close(loss, sum(expected) / (labels[:, 1:] != -100).sum(), atol=1e-5, rtol=0)


def test_unsupported_inputs_raise():
    model = _hf_model("fox-llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    mask = torch.ones_like(ids)
    mask[0, 2] = 0
    with pytest.raises(ValueError, match="one contiguous run of tokens per row"):
        model(ids, attention_mask=mask)
    out = model(ids)
    with pytest.raises(ValueError, match="marks new tokens as padding after a prefix"):
        model(
            ids[:, :2],
            attention_mask=torch.cat([torch.ones_like(ids), torch.tensor([[1, 0], [1, 1]])], 1),
            **{CACHE_ARG: output_cache(out)},
        )
    with pytest.raises(ValueError, match="inputs_embeds"):
        model(inputs_embeds=torch.zeros(2, 6, 64))


@pytest.mark.parametrize("arch", ["fox-pro", "transformer-llama"])
def test_save_and_load(tmp_path, arch):
    model = _hf_model(arch, n_kv_heads=2, acp=arch.startswith("fox"))
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    for cls in (LapseForCausalLM, AutoModelForCausalLM):
        loaded = cls.from_pretrained(tmp_path).eval()
        assert type(loaded) is LapseForCausalLM
        assert loaded.config.to_model_config() == model.config.to_model_config()
        assert loaded.model.config == model.model.config
        with torch.no_grad():
            assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), LapseConfig)


def test_export_written_before_attention_and_block_loads(tmp_path):
    """Exports from before the config named its attention and block kinds hold only
    ``"arch"``: they load as the same model."""
    model = _hf_model("transformer-pro", n_kv_heads=2)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["attention"], config["block"]
    config["arch"] = "transformer-pro"
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert (loaded.config.attention, loaded.config.block, loaded.config.arch) == ("softmax", "pro", None)
    ids = torch.randint(0, model.config.vocab_size, (2, 10))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_core_packages_do_not_import_transformers():
    code = (
        "import sys, lapse.ops, lapse.kv, lapse.layers, lapse.models, lapse.generation; "
        "sys.exit('transformers' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
