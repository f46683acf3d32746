"""``lapse bench serve`` against a ``lapse serve`` it starts itself on the fixture run (a CPU,
a toy model: the timings mean nothing, their presence and the counts do), and its one-line
errors."""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

import pytest

from lapse.bench.config import ServeBenchConfig
from lapse.bench.serving import gauges, percentile
from lapse.cli import main as cli_main

RUN = Path(__file__).parents[1] / "fixtures" / "before_restructure" / "run-fox-pro"
SERVE = f"{shlex.quote(str(RUN))} --max-batch 4 --policy window --window 16 --device cpu"


def _children() -> list[str]:
    """The command lines of this process's live children (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if ppid == os.getpid():
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError, IndexError):
            continue
    return found


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the server process")
def test_started_server_serves_the_load_and_is_stopped(tmp_path, capsys):
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    cli_main(["bench", "serve", "--serve", SERVE, "--num-requests", "8", "--concurrency", "4",
              "--prompt-len", "8", "--output-len", "8", "--metrics-interval", "0.02",
              "--out-dir", str(tmp_path), "--commit", "test"])
    results = json.loads((tmp_path / "results.json").read_text())
    s = results["summary"]
    assert s["requests_ok"] == 8 and s["requests_failed"] == {}
    assert s["output_tokens"] == 8 * 8 and s["prompt_tokens"] == 8 * 8
    for key in ("ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p90",
                "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "wall_s", "output_tokens_per_s"):
        assert s[key] > 0, key
    assert s["peak_kv_pages_used"] > 0 and 1 <= s["peak_num_requests_running"] <= 4
    assert s["prefill_ms_mean"] > 0 and s["iterations_per_s"] > 0
    # the 8 prompts and the 7 tokens of each drawn by decode steps (the first by its prefill)
    iterated = s["tokens_per_iteration_mean"] * s["iterations_per_s"] * s["wall_s"]
    assert iterated == pytest.approx(8 * 8 + 8 * 7)
    env = results["env"]
    assert env["model"] == "run-fox-pro" and env["max_model_len"] == 64 and env["commit"] == "test"
    assert env["server_command"].startswith("lapse serve ") and "--window 16" in env["server_command"]
    assert "--num-requests 8" in env["command"]
    table = (tmp_path / "results.md").read_text()
    assert "| requests ok | 8 |" in table and table in capsys.readouterr().out
    assert not [c for c in _children() if "lapse.cli" in c]  # the server is gone


def test_several_concurrency_levels_load_one_server_in_turn(tmp_path):
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    cli_main(["bench", "serve", "--serve", SERVE, "--num-requests", "6", "--concurrency", "1", "4",
              "--prompt-len", "8", "--output-len", "6", "--metrics-interval", "0.02",
              "--out-dir", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    levels = results["levels"]
    assert [level["concurrency"] for level in levels] == [1, 4]
    assert all(level["summary"]["requests_ok"] == 6 for level in levels)
    assert results["summary"] == levels[0]["summary"]
    assert levels[0]["summary"]["peak_num_requests_running"] <= 1
    assert "--concurrency 1 4" in results["env"]["command"]
    table = (tmp_path / "results.md").read_text()
    assert "| figure | 1 in flight | 4 in flight |" in table and "| requests ok | 6 | 6 |" in table


def test_faults_get_their_answers_and_leave_no_page_held(tmp_path):
    """Every fault kind twice among the load: each refused body gets a 400, each dropped
    stream is left after its first chunk; no 5xx, and once idle the pool is what it was."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("openai")
    cli_main(["bench", "serve", "--serve", SERVE, "--num-requests", "10", "--concurrency", "4",
              "--prompt-len", "8", "--output-len", "16", "--faults", "10", "--out-dir", str(tmp_path)])
    s = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert s["requests_ok"] == 10 and s["requests_failed"] == {}
    assert s["faults"] == {"dropped-stream: dropped": 2, "max-tokens-0: 400": 2, "not-json: 400": 2,
                           "over-context: 400": 2, "unknown-policy: 400": 2}
    assert s["server_errors"] == 0
    assert s["after_kv_pages_used"] == s["before_kv_pages_used"] == 0
    assert s["after_kv_pages_free"] == s["before_kv_pages_free"] > 0
    assert "| faults (kind: answer) | dropped-stream: dropped x 2," in (tmp_path / "results.md").read_text()


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc for the server process")
def test_an_error_after_start_stops_the_server(tmp_path, capsys):
    pytest.importorskip("uvicorn")
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "serve", "--serve", SERVE, "--prompt-len", "60", "--output-len", "8",
                  "--out-dir", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exceeds the server's max_model_len 64" in err
    assert not [c for c in _children() if "lapse.cli" in c]


@pytest.mark.parametrize(("args", "said"), [
    (["--url", "http://127.0.0.1:{port}"], "no lapse serve answers at http://127.0.0.1:"),
    (["--url", "localhost:8000"], "--url must be http://HOST[:PORT]"),
    (["--serve", "/no/such/run"], "the server exited with status 2 before answering /health"),
    (["--serve", "runs/x --port 9000"], "--serve may not set --port"),
    (["--concurrency", "2", "--rate", "1"], "give --concurrency or --rate, not both"),
], ids=["closed-port", "no-scheme", "no-run", "port-given", "both-loads"])
def test_errors_are_one_line(tmp_path, capsys, args, said):
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(SystemExit) as stop:
        cli_main(["bench", "serve", *[a.format(port=port) for a in args], "--out-dir", str(tmp_path)])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and said in err, err


def test_config_defaults_and_helpers():
    cfg = ServeBenchConfig()
    assert cfg.base_url() == "http://127.0.0.1:8000" and cfg.in_flight() == 8
    assert ServeBenchConfig(rate=2.0).in_flight() is None
    page = ('# HELP lapse:kv_pages_used x\nlapse:kv_pages_used{model_name="m"} 12.0\n'
            'lapse:num_requests_running{model_name="m"} 3.0\nlapse:kv_pages_free{model_name="m"} 5.0\n')
    assert gauges(page) == {"kv_pages_used": 12.0, "num_requests_running": 3.0}
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5 and percentile([], 90) is None
    assert percentile([1.0, 2.0], 99) == pytest.approx(1.99)
