"""The HTTP side of ``lapse serve`` over a fake batcher (``server_helpers.FakeBatcher``):
routes, OpenAI's error bodies, stop strings, streaming, the waiting line's 429, and that a
client going away frees its row and pages. The model's own output is tested in
``test_server.py``."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from server_helpers import client, fake_server, get, metric, post, serving, wait_for


def test_models_health_and_metrics(fake):
    url, _ = fake
    assert [m.id for m in client(url).models.list()] == ["fake"]
    assert get(url, "/health") == (200, "{}")
    status, text = get(url, "/metrics")
    assert status == 200
    assert metric(text, "num_requests_running") == 0
    assert metric(text, "kv_pages_free") == 64
    assert metric(text, "kv_cache_usage_perc") == 0


def test_a_completion_streamed_and_whole(fake):
    url, _ = fake
    c = client(url)
    whole = c.completions.create(model="fake", prompt="hi", max_tokens=11)
    assert whole.choices[0].text == "abcdefghabc"
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (2, 11)
    chunks = list(c.completions.create(model="fake", prompt="hi", max_tokens=11, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 11


@pytest.mark.parametrize("stop", ["def", ["fg", "xyz"]], ids=["one", "two"])
def test_a_stop_string_ends_the_text_before_it(fake, stop):
    url, _ = fake
    c = client(url)
    whole = c.completions.create(model="fake", prompt="hi", max_tokens=30, stop=stop)
    expected = "abc" if stop == "def" else "abcde"
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (expected, "stop")
    chunks = c.completions.create(model="fake", prompt="hi", max_tokens=30, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in chunks) == expected


def test_chat_without_a_chat_template_is_a_400(fake):
    url, _ = fake
    with pytest.raises(openai.BadRequestError) as e:
        client(url).chat.completions.create(model="fake", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "invalid_request_error"


def test_an_unknown_field_is_answered_and_named_once(fake, caplog):
    url, _ = fake
    with caplog.at_level(logging.WARNING, logger="lapse.serve"):
        status, _, body = post(url, {"model": "fake", "prompt": "hi", "max_tokens": 2, "colour": "blue"})
    assert status == 200 and body["choices"][0]["text"] == "ab"
    warned = [r for r in caplog.records if "ignored fields" in r.getMessage()]
    assert len(warned) == 1 and "colour" in warned[0].getMessage()


MALFORMED = {
    "bad JSON": b'{"model": "fake", "prompt": ',
    "not an object": b"[1, 2]",
    "prompt 123": {"model": "fake", "prompt": 123},
    "max_tokens -1": {"model": "fake", "prompt": "hi", "max_tokens": -1},
    "temperature hot": {"model": "fake", "prompt": "hi", "temperature": "hot"},
    "unknown model": {"model": "gpt-9", "prompt": "hi"},
    "empty prompt": {"model": "fake", "prompt": ""},
    "ids outside the vocabulary": {"model": "fake", "prompt": [1, 2, 999]},
    "n=2": {"model": "fake", "prompt": "hi", "n": 2},
    "lapse policy": {"model": "fake", "prompt": "hi", "lapse": {"policy": "h3o"}},
    "lapse unknown key": {"model": "fake", "prompt": "hi", "lapse": {"budgte": 0.5}},
    "lapse budget below recent": {"model": "fake", "prompt": "hi", "lapse": {"budget": 3}},
    "lapse budget not a count": {"model": "fake", "prompt": "hi", "lapse": {"budget": 2.5}},
    "too long": {"model": "fake", "prompt": "hi", "max_tokens": 1000},
    "five stops": {"model": "fake", "prompt": "hi", "stop": list("abcde")},
    "no messages": {"model": "fake", "messages": []},
}


def test_a_malformed_burst_gets_only_4xx_and_leaves_the_pool_as_it_was(fake):
    url, engine = fake
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(
            lambda kv: (kv[0], post(url, kv[1], "/v1/chat/completions" if kv[0] == "no messages"
                                    else "/v1/completions")),
            list(MALFORMED.items()) * 4))
    for name, (status, _, body) in answers:
        assert 400 <= status < 500, (name, status, body)
        assert set(body["error"]) == {"message", "type", "param", "code"}, name
    codes = {name: status for name, (status, _, _) in answers}
    assert codes["unknown model"] == 404 and codes["bad JSON"] == 400
    assert get(url, "/health")[0] == 200
    assert wait_for(lambda: engine.stats().pages_used == 0 and engine.stats().running == 0)
    assert client(url).completions.create(model="fake", prompt="hi", max_tokens=3).choices[0].text == "abc"


@pytest.mark.parametrize("budget", [None, 20])
def test_prefill_tokens_between_two_steps_stay_within_the_budget(budget):
    """8 requests of 8-token prompts at once on 8 free rows, decode steps of 0.2 s (the
    requests after the first all wait through one): without a budget one iteration admits more
    than 20 prompt tokens; with a budget of 20 at most two prompts go between two decode steps."""
    app, engine = fake_server(rows=8, pages=64, delay=0.2, max_prefill_tokens=budget)
    with serving(app) as url:
        engine.batcher.log.clear()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda i: client(url).completions.create(
                model="fake", prompt="abcdefgh", max_tokens=3).choices[0].text, range(8)))
        assert texts == ["abc"] * 8
    engine.stop()
    runs = [0]  # the prompt tokens admitted between two decode steps
    for n in engine.batcher.log:
        if n:
            runs[-1] += n
        elif runs[-1]:
            runs.append(0)
    assert sum(runs) == 64
    assert max(runs) > 20 if budget is None else max(runs) <= budget


def test_a_client_that_goes_away_frees_its_row_and_pages():
    app, engine = fake_server(rows=2, pages=64, delay=0.01)
    with serving(app) as url:
        stream = client(url).completions.create(model="fake", prompt="hi", max_tokens=200, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        assert wait_for(lambda: engine.stats().running == 1 and engine.stats().pages_used > 0)
        stream.close()
        assert wait_for(lambda: metric(get(url, "/metrics")[1], "num_requests_running") == 0)
        assert wait_for(lambda: metric(get(url, "/metrics")[1], "kv_pages_used") == 0)
    engine.stop()


def test_a_client_that_goes_away_before_a_whole_answer_frees_its_row():
    app, engine = fake_server(rows=2, pages=64, delay=0.01)
    with serving(app) as url:
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"model": "fake", "prompt": "hi", "max_tokens": 250}).encode()  # 2.5 s of steps
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            assert wait_for(lambda: engine.stats().running == 1)
        start = time.monotonic()
        assert wait_for(lambda: engine.stats().running == 0 and engine.stats().pages_used == 0)
        assert time.monotonic() - start < 1.5  # aborted, not finished
    engine.stop()


def test_health_is_503_while_the_engine_warms_up_and_requests_wait_for_it():
    gate = threading.Event()
    app, engine = fake_server(rows=2, pages=64, warmup=lambda: gate.wait(10))
    with serving(app) as url:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "/health", timeout=10)
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
        assert "warming up" in json.loads(e.value.read())["error"]["message"]
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(
                lambda: client(url).completions.create(model="fake", prompt="hi", max_tokens=3))
            time.sleep(0.2)
            assert not answer.done()  # waits in the line
            gate.set()
            assert answer.result(timeout=10).choices[0].text == "abc"
        assert get(url, "/health")[0] == 200
    engine.stop()


def test_a_full_waiting_line_answers_429_with_retry_after():
    app, engine = fake_server(rows=1, pages=64, delay=0.02, max_waiting=1)
    with serving(app) as url:
        def one(_):
            try:
                client(url).completions.create(model="fake", prompt="hi", max_tokens=20)
                return "ok"
            except openai.RateLimitError as e:
                return e.response.headers.get("retry-after")

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(one, range(4)))
        assert "ok" in results and "1" in results, results
        assert wait_for(lambda: engine.stats().pages_used == 0)
        assert 'reason="queue_full"' in get(url, "/metrics")[1]
    engine.stop()


def test_a_burst_onto_free_rows_is_taken_whole():
    """4 free rows and a line of 1: 5 requests at once are all answered (none waits for the
    engine thread to admit the first ones before the next is accepted)."""
    app, engine = fake_server(rows=4, pages=64, delay=0.02, max_waiting=1)
    with serving(app) as url:
        def one(_):
            try:
                client(url).completions.create(model="fake", prompt="hi", max_tokens=10)
                return "ok"
            except openai.RateLimitError:
                return "429"

        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            assert list(pool.map(one, range(5))) == ["ok"] * 5
    engine.stop()


class _Broken(Exception):
    pass


def test_an_engine_that_fails_answers_500_then_health_503():
    app, engine = fake_server(rows=1, pages=64)

    def step():
        raise _Broken("a step that fails")

    engine.batcher.step = step
    with serving(app) as url:
        with pytest.raises(openai.InternalServerError, match="a step that fails"):
            client(url).completions.create(model="fake", prompt="hi", max_tokens=5)
        assert get(url, "/health")[0] == 503
        status, _, body = post(url, {"model": "fake", "prompt": "hi"})
        assert status == 503 and body["error"]["type"] == "internal_server_error"
