"""``lapse bench serve``: streamed completions against ``lapse serve``, over HTTP only.

The server is a running one (``--url``) or a subprocess started from ``--serve`` and stopped
at the end, also on an error or Ctrl-C. Requests are token-id prompts (ids 32..126, which every
byte and BPE tokenizer has) sent at most ``--concurrency`` at a time or at Poisson arrivals
(``--rate``), each streamed (``stream_options.include_usage``: the usage chunk gives the output
tokens) so that the time to the first chunk and the gaps between chunks are measured as the
client sees them. A chunk carries the text of one token, or of several where the server held
back bytes that did not decode yet. ``/metrics`` is read every ``--metrics-interval`` seconds
for the peak of ``lapse:kv_pages_used`` and ``lapse:num_requests_running``; before the load
and once the server is idle after it, for the pages held (a leak shows as pages held after).
``--faults N`` mixes requests that fail on purpose into the load (:data:`FAULT_KINDS`).

Imports no torch and nothing of :mod:`lapse.serve` (a sibling layer): the ``openai`` client
for the completions, ``urllib`` for ``/health``, ``/v1/models`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import itertools
import json
import math
import random
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict

from lapse.bench.commit import git_commit
from lapse.bench.config import ServeBenchConfig
from lapse.files import write_text_atomic

PEAK_METRICS = ("kv_pages_used", "num_requests_running")
"""The gauges of ``/metrics`` (``lapse:`` prefix) whose peak over the run is reported."""

FAULT_KINDS = ("not-json", "unknown-policy", "max-tokens-0", "over-context", "dropped-stream")
"""The faults ``--faults`` sends, in turn: four bodies the server must refuse with a 400, and
a streamed request whose client goes away after the first chunk."""


def run(cfg: ServeBenchConfig) -> dict:
    """Sends the requests, writes ``results.json`` and ``results.md`` under ``cfg.out_dir``,
    prints the table; returns the results."""
    try:
        import openai  # noqa: F401  (only to say what is missing in one line)
    except ImportError:
        raise ImportError("lapse bench serve needs the openai client: pip install openai") from None
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    with _server(cfg) as (url, server_command):
        model, max_len = _model(url)
        if cfg.prompt_len + cfg.output_len > max_len:
            raise ValueError(f"--prompt-len {cfg.prompt_len} + --output-len {cfg.output_len} exceeds the "
                             f"server's max_model_len {max_len}")
        summaries = []
        for level in cfg.levels():
            records, wall, peaks = asyncio.run(_load(level, url, model, max_len))
            summaries.append(summarize(records, wall, peaks))
    results = {
        "env": {
            "command": command_line(cfg),
            "server_command": server_command,
            "url": url,
            "model": model,
            "max_model_len": max_len,
            "commit": cfg.commit or git_commit() or "unknown",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        },
        "config": {k: (str(v) if v is not None else None) for k, v in asdict(cfg).items()},
        "summary": summaries[0],
    }
    if len(summaries) > 1:
        results["levels"] = [{"concurrency": c, "summary": one}
                             for c, one in zip(cfg.concurrency, summaries, strict=True)]
    write_text_atomic(cfg.out_dir / "results.json", json.dumps(results, indent=2))
    table = markdown_table(results)
    write_text_atomic(cfg.out_dir / "results.md", table)
    print(table)
    return results


def command_line(cfg: ServeBenchConfig) -> str:
    """``lapse bench serve`` with the flags whose values differ from their defaults."""
    args = ["lapse", "bench", "serve"]
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if value != field.default:
            given = [str(v) for v in value] if isinstance(value, tuple) else [str(value)]
            args += [f"--{field.name.replace('_', '-')}", *given]
    return shlex.join(args)


@contextlib.contextmanager
def _server(cfg: ServeBenchConfig):
    """Yields (base URL, the server's command or ``None``); a started server is stopped on the
    way out, whatever the way."""
    if cfg.serve is None:
        yield cfg.base_url(), None
        return
    with socket.socket() as sock:  # a free port; released here, taken by the server a moment later
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-m", "lapse.cli", "serve", *shlex.split(cfg.serve),
               "--host", "127.0.0.1", "--port", str(port)]
    if "--log-level" not in cfg.serve:
        command += ["--log-level", "warning"]  # no access log line per request
    log_path = cfg.out_dir / "serve.log"
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log, _terminate_as_interrupt():
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_healthy(url, proc, cfg.startup_timeout, log_path)
            yield url, shlex.join(["lapse", "serve", *command[4:]])
        finally:
            _stop(proc)


@contextlib.contextmanager
def _terminate_as_interrupt():
    """Inside, SIGTERM raises ``KeyboardInterrupt`` as Ctrl-C does, so the server is stopped on
    the way out (Python's default would end this process and leave the server running)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float, log_path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            lines = log_path.read_text(errors="replace").strip().splitlines()
            said = lines[-1].strip() if lines else "no output"
            raise ConnectionError(f"the server exited with status {proc.returncode} before answering "
                                  f"/health: {said} (its output: {log_path})")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if _get(f"{url}/health", timeout=1.0)[0] == 200:
                return
        time.sleep(0.1)
    raise TimeoutError(f"the server did not answer /health within {timeout:g} s (--startup-timeout; "
                       f"its output: {log_path})")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM (uvicorn shuts down), then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _get(url: str, timeout: float = 10.0, data: bytes | None = None) -> tuple[int, str]:
    """The status and body of a GET, or of a POST of the JSON ``data``."""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _model(url: str) -> tuple[str, int]:
    """The served model's name and ``max_model_len`` from ``/v1/models``."""
    try:
        status, body = _get(f"{url}/v1/models")
    except (OSError, ValueError, http.client.HTTPException) as e:  # a refused connection, a timeout, not HTTP
        reason = getattr(e, "reason", e)
        raise ConnectionError(f"no lapse serve answers at {url}: {reason}") from None
    if status != 200:
        raise ConnectionError(f"{url}/v1/models answered {status}: is this lapse serve?")
    try:
        (entry,) = json.loads(body)["data"]
        return entry["id"], int(entry["max_model_len"])
    except (ValueError, KeyError, TypeError):
        raise ConnectionError(f"{url}/v1/models is not lapse serve's answer: {body[:200]!r}") from None


async def _load(cfg: ServeBenchConfig, url: str, model: str, max_len: int) -> tuple[list[dict], float, dict]:
    """Every request's record (the faults' with a ``fault`` key), the wall time from the first
    request to the last answer, and the gauges: the peaks of :data:`PEAK_METRICS`, and
    ``before_*`` / ``after_*`` of the pages once the server is idle."""
    import openai

    rng = random.Random(cfg.seed)
    prompts = [[rng.randrange(32, 127) for _ in range(cfg.prompt_len)] for _ in range(cfg.num_requests)]
    gaps = [rng.expovariate(cfg.rate) if cfg.rate else 0.0 for _ in range(cfg.num_requests)]
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=cfg.request_timeout)
    peaks = dict.fromkeys(PEAK_METRICS, 0.0)
    done = asyncio.Event()
    poller = asyncio.create_task(_poll_metrics(url, peaks, done, cfg.metrics_interval))
    limit = asyncio.Semaphore(cfg.in_flight() or cfg.num_requests)
    # fault j goes out with the load's request j * N // faults
    faults_at = Counter(j * cfg.num_requests // cfg.faults for j in range(cfg.faults)) if cfg.faults else {}
    sent = itertools.count()

    async def one(i: int) -> dict:
        async with limit:
            return await _request(client, model, prompts[i], cfg.seed + i, cfg)

    async def fault(kind: str) -> dict:
        async with limit:
            status = await _fault(client, url, model, kind, max_len, cfg)
            return {"ok": False, "fault": kind, "status": status}

    try:
        for i in range(cfg.warmup):  # other prompts than the timed ones, the same lengths
            warm = [rng.randrange(32, 127) for _ in range(cfg.prompt_len)]
            record = await _request(client, model, warm, cfg.seed + cfg.num_requests + i, cfg)
            if not record["ok"]:
                raise RuntimeError(f"the warm-up request failed: {record['status']}")
        idle = await _idle(url, cfg.request_timeout)
        peaks.update({f"before_{k}": v for k, v in idle.items()})
        start = time.perf_counter()
        tasks = []
        for i in range(cfg.num_requests):
            if gaps[i]:
                await asyncio.sleep(gaps[i])
            tasks.append(asyncio.create_task(one(i)))
            for _ in range(faults_at.get(i, 0)):
                tasks.append(asyncio.create_task(fault(FAULT_KINDS[next(sent) % len(FAULT_KINDS)])))
        records = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
        idle = await _idle(url, cfg.request_timeout)
        peaks.update({f"after_{k}": v for k, v in idle.items()})
    finally:
        done.set()
        await poller
        await client.close()
    return list(records), wall, peaks


async def _fault(client, url: str, model: str, kind: str, max_len: int, cfg: ServeBenchConfig) -> str:
    """Sends one fault of ``kind`` (:data:`FAULT_KINDS`); returns the HTTP status it got, or
    ``dropped`` for a stream left after its first chunk (``connection`` where none came)."""
    import openai

    if kind == "dropped-stream":
        try:
            stream = await client.completions.create(
                model=model, prompt=[65] * cfg.prompt_len, max_tokens=cfg.output_len, stream=True)
            async for _ in stream:
                break
            await stream.close()
            return "dropped"
        except openai.APIStatusError as e:
            return str(e.status_code)
        except openai.APIError:
            return "connection"
    body = {"model": model, "prompt": [65] * cfg.prompt_len, "max_tokens": cfg.output_len}
    if kind == "not-json":
        data = b'{"model": "' + model.encode() + b'", "prompt": [65, '
    else:
        if kind == "unknown-policy":
            body["lapse"] = {"policy": "no-such-policy"}
        elif kind == "max-tokens-0":
            body["max_tokens"] = 0
        elif kind == "over-context":
            body["prompt"], body["max_tokens"] = [65] * max_len, 1
        data = json.dumps(body).encode()
    try:
        status, _ = await asyncio.to_thread(_get, f"{url}/v1/completions", cfg.request_timeout, data)
    except (OSError, http.client.HTTPException):
        return "connection"
    return str(status)


IDLE_METRICS = ("kv_pages_used", "kv_pages_free", "request_prefill_time_seconds_sum",
                "request_prefill_time_seconds_count", "iteration_tokens_total_sum",
                "iteration_tokens_total_count")
"""What ``/metrics`` holds once the server is idle, read before and after the load: the pages
held, and the sums the prefill time and tokens a step come from."""


async def _idle(url: str, timeout: float) -> dict[str, float | None]:
    """:data:`IDLE_METRICS` once nothing runs or waits (``/metrics`` read every 50 ms, for at
    most ``timeout`` seconds: then as they are; ``None`` where a name is missing)."""
    wanted = (*IDLE_METRICS, "num_requests_running", "num_requests_waiting")
    deadline = time.monotonic() + timeout
    found: dict[str, float] = {}
    while True:
        with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
            status, text = await asyncio.to_thread(_get, f"{url}/metrics", 5.0)
            if status == 200:
                found = gauges(text, wanted)
        if (found.get("num_requests_running", 1) == 0 and found.get("num_requests_waiting", 1) == 0) \
                or time.monotonic() > deadline:
            return {k: found.get(k) for k in IDLE_METRICS}
        await asyncio.sleep(0.05)


async def _request(client, model: str, prompt: list[int], seed: int, cfg: ServeBenchConfig) -> dict:
    """One streamed completion: ``ok`` with its timings, or ``status`` (the HTTP status, or
    ``connection``, ``timeout``, ``stream error``)."""
    import openai

    start = time.perf_counter()
    chunks: list[float] = []  # when each chunk with text came
    usage = None
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=cfg.output_len, temperature=cfg.temperature, seed=seed,
            stream=True, stream_options={"include_usage": True},
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                chunks.append(now)
            if chunk.usage is not None:
                usage = chunk.usage
    except openai.APIStatusError as e:
        return {"ok": False, "status": str(e.status_code)}
    except openai.APITimeoutError:
        return {"ok": False, "status": "timeout"}
    except openai.APIConnectionError:
        return {"ok": False, "status": "connection"}
    except openai.APIError:  # an error event inside the stream
        return {"ok": False, "status": "stream error"}
    end = time.perf_counter()
    if usage is None:
        return {"ok": False, "status": "no usage"}
    return {
        "ok": True,
        "prompt_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "ttft": (chunks[0] if chunks else end) - start,
        "itl": [b - a for a, b in itertools.pairwise(chunks)],
        "e2e": end - start,
    }


async def _poll_metrics(url: str, peaks: dict, done: asyncio.Event, interval: float) -> None:
    """Keeps the largest value of each of :data:`PEAK_METRICS` seen until ``done``."""
    while True:
        with contextlib.suppress(OSError, ValueError, http.client.HTTPException):
            status, text = await asyncio.to_thread(_get, f"{url}/metrics", 5.0)
            if status == 200:
                for name, value in gauges(text).items():
                    peaks[name] = max(peaks[name], value)
        if done.is_set():
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), interval)


def gauges(text: str, names: tuple[str, ...] = PEAK_METRICS) -> dict[str, float]:
    """The values of the gauges ``names`` (``lapse:`` prefix left out) in a Prometheus text
    page, summed over labels."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("lapse:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0].removeprefix("lapse:")
        if name in names:
            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[-1])
    return found


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100), interpolated linearly between the closest ranks."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(records: list[dict], wall: float, peaks: dict) -> dict:
    """Counts, throughputs (per second of wall time) and latencies (ms) of the run; the
    faults' answers, the 5xx answers of all requests and the pages held once idle."""
    faults = Counter(f"{r['fault']}: {r['status']}" for r in records if "fault" in r)
    server_errors = sum(r["status"].startswith("5") for r in records if not r["ok"])
    records = [r for r in records if "fault" not in r]
    ok = [r for r in records if r["ok"]]
    failed = Counter(r["status"] for r in records if not r["ok"])
    ttft = [r["ttft"] * 1e3 for r in ok]
    itl = [gap * 1e3 for r in ok for gap in r["itl"]]
    e2e = [r["e2e"] * 1e3 for r in ok]
    output = sum(r["output_tokens"] for r in ok)
    prompt = sum(r["prompt_tokens"] for r in ok)
    return {
        "requests_ok": len(ok),
        "requests_failed": dict(sorted(failed.items())),
        "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "output_tokens_per_s": output / wall,
        "total_tokens_per_s": (prompt + output) / wall,
        "ttft_ms_mean": sum(ttft) / len(ttft) if ttft else None,
        **{f"ttft_ms_p{q}": percentile(ttft, q) for q in (50, 90, 99)},
        **{f"itl_ms_p{q}": percentile(itl, q) for q in (50, 90, 99)},
        **{f"e2e_ms_p{q}": percentile(e2e, q) for q in (50, 99)},
        **{f"peak_{name}": peaks[name] for name in PEAK_METRICS},
        "faults": dict(sorted(faults.items())),
        "server_errors": server_errors,
        **{f"{when}_{name}": peaks.get(f"{when}_{name}") for when in ("before", "after")
           for name in ("kv_pages_used", "kv_pages_free")},
        "prefill_ms_mean": _growth_mean(peaks, "request_prefill_time_seconds", 1e3),
        "tokens_per_iteration_mean": _growth_mean(peaks, "iteration_tokens_total"),
        "iterations_per_s": _growth(peaks, "iteration_tokens_total_count", wall),
    }


def _growth(peaks: dict, name: str, per: float = 1.0) -> float | None:
    """How much ``name`` grew from before the load to after it, over ``per``."""
    a, b = peaks.get(f"before_{name}"), peaks.get(f"after_{name}")
    return None if a is None or b is None or per <= 0 else (b - a) / per


def _growth_mean(peaks: dict, histogram: str, scale: float = 1.0) -> float | None:
    """The mean of a histogram's observations during the load (its sum's and count's growth)."""
    total, count = _growth(peaks, f"{histogram}_sum"), _growth(peaks, f"{histogram}_count")
    return None if total is None or not count else scale * total / count


ROWS = [
    ("requests ok", "requests_ok", "{:d}"),
    ("wall time (s)", "wall_s", "{:.2f}"),
    ("requests/s", "request_throughput", "{:.2f}"),
    ("output tokens", "output_tokens", "{:d}"),
    ("output tokens/s", "output_tokens_per_s", "{:.1f}"),
    ("total tokens/s (prompt + output)", "total_tokens_per_s", "{:.1f}"),
    ("TTFT mean (ms)", "ttft_ms_mean", "{:.1f}"),
    ("TTFT p50 / p90 / p99 (ms)", ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99"), "{:.1f}"),
    ("ITL p50 / p90 / p99 (ms, between chunks)", ("itl_ms_p50", "itl_ms_p90", "itl_ms_p99"), "{:.1f}"),
    ("end-to-end p50 / p99 (ms)", ("e2e_ms_p50", "e2e_ms_p99"), "{:.1f}"),
    ("prefill a request, mean (ms; lapse:request_prefill_time_seconds)", "prefill_ms_mean", "{:.1f}"),
    ("engine iterations/s, tokens an iteration (mean)", ("iterations_per_s", "tokens_per_iteration_mean"),
     "{:.1f}"),
    ("peak lapse:kv_pages_used", "peak_kv_pages_used", "{:g}"),
    ("peak lapse:num_requests_running", "peak_num_requests_running", "{:g}"),
]


def markdown_table(results: dict) -> str:
    """The run's command lines, commit and date, then one row per figure: one value column,
    or one column per concurrency level."""
    env = results["env"]
    levels = results.get("levels") or [{"concurrency": None, "summary": results["summary"]}]

    def cell(s: dict, keys, fmt: str) -> str:
        keys = (keys,) if isinstance(keys, str) else keys
        return " / ".join("n/a" if s[k] is None else fmt.format(s[k]) for k in keys)

    def pages(s: dict) -> str:
        if s["before_kv_pages_used"] is None or s["after_kv_pages_used"] is None:
            return "n/a"
        return (f"{s['before_kv_pages_used']:g} / {s['before_kv_pages_free']:g}, "
                f"{s['after_kv_pages_used']:g} / {s['after_kv_pages_free']:g}")

    rows = [(label, [cell(one["summary"], keys, fmt) for one in levels]) for label, keys, fmt in ROWS]
    def counts(counter: dict) -> str:
        return ", ".join(f"{k}: {n}" for k, n in counter.items()) or "none"

    summaries = [one["summary"] for one in levels]
    rows += [
        ("requests failed", [counts(s["requests_failed"]) for s in summaries]),
        ("answers 5xx (all requests)", [str(s["server_errors"]) for s in summaries]),
        ("lapse:kv_pages_used / kv_pages_free, idle before / after", [pages(s) for s in summaries]),
    ]
    if any(s["faults"] for s in summaries):
        rows.append(("faults (kind: answer)",
                     [", ".join(f"{k} x {n}" for k, n in s["faults"].items()) or "none" for s in summaries]))
    head = ["value"] if len(levels) == 1 else [f"{one['concurrency']} in flight" for one in levels]
    lines = [
        f"`{env['command']}`",
        "",
        f"Server: `{env['server_command']}`" if env["server_command"] else f"Server: {env['url']} (running)",
        f"model {env['model']} (max_model_len {env['max_model_len']}), commit {env['commit']}, {env['date']}",
        "",
        "| figure | " + " | ".join(head) + " |",
        "| --- " * (len(head) + 1) + "|",
        *(f"| {label} | " + " | ".join(values) + " |" for label, values in rows),
    ]
    return "\n".join(lines) + "\n"
