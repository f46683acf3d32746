"""``lapse serve`` over a real model, the fixture run (fox-pro, 2 layers, a byte tokenizer,
64 tokens of context): a seeded completion is ``lapse generate``'s text for the same run,
prompt, seed, temperature and policy, streamed or not, alone or beside other requests; a
client that goes away gives its pages back. The run's greedy text is all spaces (2 training
steps), so every comparison samples with a seed."""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path

import openai
import pytest
import torch
from server_helpers import client, get, metric, post, serving, wait_for

from lapse.cli import main

RUN = Path(__file__).resolve().parents[1] / "fixtures" / "before_restructure" / "run-fox-pro"
POLICIES = {
    "window": ["--policy", "window", "--window", "8", "--sinks", "2", "--every", "4"],
    "h2o": ["--policy", "h2o", "--budget", "12", "--recent", "4", "--sinks", "2"],
}
GENERATE_ONLY = {"h2o-8": ["--policy", "h2o", "--budget", "8", "--recent", "4", "--sinks", "2"],
                 "window-6": ["--policy", "window", "--window", "6", "--sinks", "2", "--every", "4"],
                 "window-6-defaults": ["--policy", "window", "--window", "6"]}
"""Flags of ``lapse generate`` runs that a request's ``lapse.budget`` should equal."""
PROMPTS = ["def hello(world):", "import os\n", "The cat sat on"]
NEW = 24


@pytest.fixture(scope="module", params=list(POLICIES))
def served(request):
    from lapse.serve.command import build_server
    from lapse.serve.config import ServeConfig

    flags = POLICIES[request.param]
    cfg = ServeConfig(model=RUN, device="cpu", max_batch=4, max_waiting=16, served_model_name="fox",
                      **{k.lstrip("-"): _value(v) for k, v in zip(flags[::2], flags[1::2], strict=True)})
    server = build_server(cfg)
    with serving(server.app) as url:
        yield request.param, url, server.engine
    server.engine.stop()


def _value(v: str):
    return int(v) if v.isdigit() else v


_generated: dict = {}


def generated(policy: str, prompt: str, seed: int, tmp_path_factory) -> str:
    """``lapse generate RUN --prompts-file (one prompt) --seed S --temperature 1 --policy ...``'s
    completion (run in this process)."""
    key = (policy, prompt, seed)
    if key not in _generated:
        folder = tmp_path_factory.mktemp("generate")
        prompts = folder / "p.jsonl"
        prompts.write_text(json.dumps({"prompt": prompt}) + "\n")
        main(["generate", str(RUN), "--prompts-file", str(prompts), "--seed", str(seed), "--temperature", "1",
              "--max-new-tokens", str(NEW), "--device", "cpu", *{**POLICIES, **GENERATE_ONLY}[policy]])
        _generated[key] = json.loads((folder / "p.out.jsonl").read_text())["completion"]
    return _generated[key]


def test_a_seeded_completion_is_lapse_generates_text(served, tmp_path_factory):
    policy, url, _ = served
    c = client(url)
    for seed, prompt in enumerate(PROMPTS):
        answer = c.completions.create(model="fox", prompt=prompt, max_tokens=NEW, temperature=1, seed=seed)
        assert answer.choices[0].text == generated(policy, prompt, seed, tmp_path_factory), (prompt, seed)
        assert answer.usage.prompt_tokens == len(prompt.encode())


def test_streamed_deltas_join_to_the_whole_text(served, tmp_path_factory):
    policy, url, _ = served
    chunks = list(client(url).completions.create(model="fox", prompt=PROMPTS[0], max_tokens=NEW,
                                                 temperature=1, seed=0, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(ch.choices[0].text for ch in chunks) == generated(policy, PROMPTS[0], 0, tmp_path_factory)


def test_concurrent_requests_each_equal_their_single_run(served, tmp_path_factory):
    policy, url, engine = served
    jobs = [(prompt, seed) for seed in (0, 1, 2) for prompt in PROMPTS]  # 9 requests on 4 rows

    def one(job):
        prompt, seed = job
        answer = client(url).completions.create(model="fox", prompt=prompt, max_tokens=NEW, temperature=1,
                                                seed=seed)
        return answer.choices[0].text

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        texts = list(pool.map(one, jobs))
    assert texts == [generated(policy, p, s, tmp_path_factory) for p, s in jobs]
    assert wait_for(lambda: engine.stats().running == 0 and engine.stats().pages_used == 0)


def test_metrics_after_requests(served):
    _, url, engine = served
    assert wait_for(lambda: engine.stats().running == 0)
    names = ("prompt_tokens_total", "generation_tokens_total", "request_prefill_time_seconds_count",
             "request_prefill_time_seconds_sum", "iteration_tokens_total_sum")
    before = {name: metric(get(url, "/metrics")[1], name) for name in names}
    client(url).completions.create(model="fox", prompt=PROMPTS[0], max_tokens=4, temperature=1, seed=5)
    assert wait_for(lambda: engine.stats().running == 0)
    status, text = get(url, "/metrics")
    assert status == 200
    grew = {name: metric(text, name) - before[name] for name in names}
    assert grew["request_prefill_time_seconds_count"] == 1 and grew["request_prefill_time_seconds_sum"] > 0
    # every token an iteration ran: the prompt, and each drawn token but the prefill's own
    iterated = grew["prompt_tokens_total"] + grew["generation_tokens_total"] - 1
    assert grew["iteration_tokens_total_sum"] == iterated
    # the tokens of the last 10 s, this request's among them
    recent = 10 * metric(text, "avg_generation_throughput_toks_per_s")
    assert grew["generation_tokens_total"] <= recent + 1e-9 <= metric(text, "generation_tokens_total") + 1e-9
    assert metric(text, "generation_tokens_total") >= 4
    assert metric(text, "prompt_tokens_total") >= len(PROMPTS[0])
    assert metric(text, "time_to_first_token_seconds_count") >= 1
    assert metric(text, "kv_pages_used") == 0 and metric(text, "kv_cache_usage_perc") == 0
    assert metric(text, "kv_pages_free") == engine.batcher.pages_total() > 0


def test_chat_on_a_byte_tokenizer_is_a_400(served):
    _, url, _ = served
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="fox", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "invalid_request_error"


def test_a_disconnect_mid_stream_returns_the_pages(served):
    _, url, engine = served
    stream = client(url).completions.create(model="fox", prompt=PROMPTS[2], max_tokens=40, temperature=1,
                                            seed=1, stream=True)
    chunks = iter(stream)
    next(chunks)
    stream.close()
    assert wait_for(lambda: metric(get(url, "/metrics")[1], "num_requests_running") == 0)
    assert wait_for(lambda: metric(get(url, "/metrics")[1], "kv_pages_used") == 0)
    assert get(url, "/health")[0] == 200


def test_a_request_budget_is_lapse_generates_flag(served, tmp_path_factory):
    """h2o: ``budget`` is the request's H2O budget; window: its window."""
    policy, url, _ = served
    budget = {"h2o": 8, "window": 6}[policy]
    lapse = {"policy": policy, "budget": budget}
    answer = client(url).completions.create(model="fox", prompt=PROMPTS[0], max_tokens=NEW, temperature=1,
                                            seed=4, extra_body={"lapse": lapse})
    assert answer.choices[0].text == generated(f"{policy}-{budget}", PROMPTS[0], 4, tmp_path_factory)
    if policy == "h2o":  # another kind: its defaults with the request's budget, beside the h2o rows
        window = {"lapse": {"policy": "window", "budget": 6}}
        answer = client(url).completions.create(model="fox", prompt=PROMPTS[0], max_tokens=NEW, temperature=1,
                                                seed=4, extra_body=window)
        assert answer.choices[0].text == generated("window-6-defaults", PROMPTS[0], 4, tmp_path_factory)
    else:  # h2o ranks by scores that a window server's store does not record
        with pytest.raises(openai.BadRequestError, match="store records no attention scores"):
            client(url).completions.create(model="fox", prompt=PROMPTS[0], max_tokens=4,
                                           extra_body={"lapse": {"policy": "h2o"}})
    with pytest.raises(openai.BadRequestError, match="lapse.policy must be one of"):
        client(url).completions.create(model="fox", prompt=PROMPTS[0], max_tokens=4,
                                       extra_body={"lapse": {"policy": "h3o"}})


def test_bad_requests_and_dropped_streams_leave_the_pool_as_it_was(served):
    _, url, engine = served
    bad = [b"{", {"model": "fox", "prompt": 123}, {"model": "fox", "prompt": "hi", "max_tokens": -1},
           {"model": "fox", "prompt": "hi", "temperature": "hot"}, {"model": "x", "prompt": "hi"},
           {"model": "fox", "prompt": ""}, {"model": "fox", "prompt": [400]},
           {"model": "fox", "prompt": "hi", "n": 2},
           {"model": "fox", "prompt": "hi", "lapse": {"nope": 1}}, {"model": "fox", "prompt": "hi" * 40}]

    def dropped(seed):
        stream = client(url).completions.create(model="fox", prompt=PROMPTS[seed % 3], max_tokens=30,
                                                temperature=1, seed=seed, stream=True)
        next(iter(stream))
        stream.close()

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        statuses = [s for s, _, _ in pool.map(lambda body: post(url, body), bad * 3)]
        list(pool.map(dropped, range(16)))
    assert all(400 <= s < 500 for s in statuses), statuses
    assert wait_for(lambda: engine.stats().running == 0 and engine.stats().pages_used == 0)
    assert engine.stats().pages_free == engine.batcher.pages_total()
    assert get(url, "/health")[0] == 200


def test_a_bounded_load_finishes_and_leaves_the_pool_full(served):
    _, url, engine = served
    c = client(url)

    def one(i):
        return c.completions.create(model="fox", prompt=PROMPTS[i % 3], max_tokens=16, temperature=1,
                                    seed=i).choices[0].finish_reason

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        reasons = list(pool.map(one, range(48)))
    assert time.perf_counter() - start < 20
    assert set(reasons) <= {"stop", "length"} and len(reasons) == 48
    assert wait_for(lambda: engine.stats().running == 0 and engine.stats().pages_used == 0)
    assert engine.stats().pages_free == engine.batcher.pages_total()


@pytest.mark.parametrize("policy", ["dense", "h2o", "window"])
def test_warm_up_takes_one_request_through_a_pass_and_gives_everything_back(policy):
    """What a compiled server runs before /health says 200: one request admitted, stepped
    past its policy's first eviction pass, released; the batcher is as it was."""
    from lapse.generation.batching import RowBatcher
    from lapse.generation.command import load_run_model
    from lapse.generation.policies import PolicyOptions
    from lapse.serve.command import warm_up

    model, _ = load_run_model(RUN, torch.device("cpu"))
    flags = {"window": 8, "every": 4} if policy == "window" else {}
    made = PolicyOptions(policy=policy, **flags).make_policy()
    batcher = RowBatcher(model, made, rows=3, max_context=64)
    steps = []
    step = batcher.step
    batcher.step = lambda: steps.append(1) or step()
    warm_up(batcher)
    want = 1 if made.keeps_all else made.every + 1
    assert len(steps) == want
    assert batcher.free_rows() == 3 and batcher.pages_used() == 0
    assert batcher.pages_free() == batcher.pages_total()
