"""An in-process ``lapse serve``: uvicorn on a socket bound beforehand (port 0: a free one)
in a daemon thread, and the ``openai`` client pointed at it (``max_retries=0``: a 429 or a
500 is the answer, not a retry).

``FakeBatcher`` stands for :class:`lapse.generation.batching.RowBatcher` where a test is
about the HTTP side (errors, the waiting line, disconnects): each row draws the bytes of
``"abcdefgh"`` in turn, ``delay`` seconds a step, and holds ``ceil((T + N) / 16)`` pages.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time


class FakeBatcher:
    def __init__(self, rows: int = 4, pages: int = 64, delay: float = 0.0, page_size: int = 16):
        self.rows, self.pages, self.delay, self.page_size = rows, pages, delay, page_size
        self._rows: dict[int, list] = {}  # row -> [request, tokens drawn, pages held]
        self.log: list[int] = []  # each admission's prompt length, and 0 for a decode step

    def pages_needed(self, req) -> int:
        return math.ceil((len(req.prompt) + req.max_new_tokens) / self.page_size)

    def pages_total(self) -> int:
        return self.pages

    def pages_used(self) -> int:
        return sum(r[2] for r in self._rows.values())

    def pages_free(self) -> int:
        return self.pages - self.pages_used()

    def free_rows(self) -> int:
        return self.rows - len(self._rows)

    def can_admit(self, req) -> bool:
        return self.free_rows() > 0 and self.pages_needed(req) <= self.pages_free()

    def admit(self, req) -> tuple[int, int]:
        if self.pages_needed(req) > self.pages:
            raise ValueError(f"the request needs {self.pages_needed(req)} pages, the pool holds {self.pages}")
        assert self.can_admit(req)
        row = min(set(range(self.rows)) - set(self._rows))
        self._rows[row] = [req, 1, self.pages_needed(req)]
        self.log.append(len(req.prompt))
        return row, self._token(0)

    def step(self) -> dict[int, int]:
        time.sleep(self.delay)
        self.log.append(0)
        out = {}
        for row, r in self._rows.items():
            out[row] = self._token(r[1])
            r[1] += 1
        return out

    def release(self, row: int) -> None:
        del self._rows[row]

    def active_rows(self) -> list[int]:
        return sorted(self._rows)

    @staticmethod
    def _token(i: int) -> int:
        return b"abcdefgh"[i % 8]


class ByteTokenizer:
    eos_id, vocab_size = 256, 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@contextlib.contextmanager
def serving(app):
    """Runs ``app`` under uvicorn in a daemon thread; yields its base URL."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound before the thread starts: the port is known and taken
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def fake_server(**batcher):
    """A server over a :class:`FakeBatcher` (``batcher``: its settings; ``max_waiting``,
    ``max_prefill_tokens``, ``warmup``)."""
    from lapse.generation.batching import RowRequest
    from lapse.generation.policies import H2O
    from lapse.serve.app import ServedModel, build_app
    from lapse.serve.engine import Engine
    from lapse.serve.metrics import ServerMetrics

    max_waiting = batcher.pop("max_waiting", 8)
    max_prefill_tokens = batcher.pop("max_prefill_tokens", None)
    warmup = batcher.pop("warmup", None)
    metrics = ServerMetrics("fake")
    engine = Engine(FakeBatcher(**batcher), ByteTokenizer(), eos_id=256, max_waiting=max_waiting,
                    max_prefill_tokens=max_prefill_tokens, warmup=warmup, observer=metrics).start()
    model = ServedModel(name="fake", max_context=256, vocab_size=258, policy=H2O(budget=0.5, recent=8),
                        policy_name="h2o", make_request=RowRequest)
    return build_app(engine, ByteTokenizer(), model, metrics), engine


def client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)


def metric(text: str, name: str) -> float:
    """The value of ``lapse:<name>`` in a /metrics page (its first sample)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"lapse:{name}":
                return sample.value
    raise KeyError(name)


def post(url: str, body, path: str = "/v1/completions") -> tuple[int, dict, dict]:
    """POSTs ``body`` (bytes as they are, else JSON) with the standard library; (status,
    headers, JSON answer)."""
    import http.client
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json"})
    answer = conn.getresponse()
    raw = answer.read()
    conn.close()
    return answer.status, dict(answer.headers), json.loads(raw) if raw else {}


def get(url: str, path: str) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url + path, timeout=30) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def wait_for(check, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.02)
    return check()
