"""``/metrics`` of ``lapse serve``: Prometheus text under vLLM's names with a ``lapse:`` prefix.

Each server has its own ``CollectorRegistry`` (two servers in one process, as in the tests,
would otherwise collide in the global one). Gauges and token counters are read from the
engine's :class:`~lapse.serve.engine.Stats` snapshot when scraped; the histograms are fed by
the engine thread as requests move (``prometheus_client`` is thread-safe).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536,
                            131072)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The metrics of one server over ``engine`` (anything with ``stats()``), labelled with
    ``model_name``; also the engine's :class:`~lapse.serve.engine.Observer`."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.engine = None
        labels = ["model_name"]
        self._ttft = Histogram("lapse:time_to_first_token_seconds", "Time to the first token (s).", labels,
                               buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self._itl = Histogram("lapse:inter_token_latency_seconds", "Time between tokens (s).",
                              labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self._e2e = Histogram("lapse:e2e_request_latency_seconds", "Arrival to last token (s).", labels,
                              buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._prefill = Histogram("lapse:request_prefill_time_seconds",
                                  "Time a request's prompt took to prefill, the first token drawn (s).",
                                  labels,
                                  buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._iteration = Histogram("lapse:iteration_tokens_total",
                                    "Tokens an engine iteration ran: prompts prefilled and tokens decoded.",
                                    labels, buckets=ITERATION_TOKENS_BUCKETS,
                                    registry=self.registry).labels(model_name)
        self._queue = Histogram("lapse:request_queue_time_seconds", "Time waiting for a row (s).", labels,
                                buckets=E2E_BUCKETS, registry=self.registry).labels(model_name)
        self._rejected = Counter("lapse:requests_rejected", "Requests refused before running.",
                                 ["model_name", "reason"], registry=self.registry)
        self.registry.register(_EngineCollector(self))

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def token_gap(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def prefill(self, seconds: float) -> None:
        self._prefill.observe(seconds)

    def iteration(self, tokens: int) -> None:
        self._iteration.observe(tokens)

    def finished(self, queued: float, e2e: float) -> None:
        self._queue.observe(queued)
        self._e2e.observe(e2e)

    def rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()


class _EngineCollector(Collector):
    """The gauges and token counters, read from the engine's latest snapshot."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        engine, name = self.metrics.engine, self.metrics.model_name
        if engine is None:
            return
        s = engine.stats()

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"lapse:{metric}", doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        yield gauge("num_requests_running", "Requests holding a row.", s.running)
        yield gauge("num_requests_waiting", "Requests waiting for a row.", s.waiting)
        yield gauge("kv_cache_usage_perc", "Share of the KV pages in use (0 to 1).",
                    s.pages_used / max(s.pages_total, 1))
        yield gauge("kv_pages_used", "KV pages in use, summed over layers.", s.pages_used)
        yield gauge("kv_pages_free", "KV pages free, summed over layers.", s.pages_free)
        yield gauge("avg_generation_throughput_toks_per_s", "Tokens generated per second, last 10 s.",
                    s.throughput)
        for metric, doc, value in (("prompt_tokens", "Prompt tokens prefilled.", s.prompt_tokens),
                                   ("generation_tokens", "Tokens generated.", s.generation_tokens)):
            c = CounterMetricFamily(f"lapse:{metric}", doc, labels=["model_name"])
            c.add_metric([name], value)
            yield c
        done = CounterMetricFamily("lapse:request_success", "Requests finished, by reason.",
                                   labels=["model_name", "finished_reason"])
        for reason, n in sorted(s.finished.items()):
            done.add_metric([name, reason], n)
        yield done
