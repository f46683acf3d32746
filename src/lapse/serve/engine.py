"""The engine of ``lapse serve``: one thread that owns the model and the row batcher.

Every torch call happens on this thread (grad mode and CUDA graphs are per thread). The
HTTP side talks to it through two queues: :meth:`Engine.submit` and :meth:`Engine.abort`
put ``Submit``/``Abort`` on a thread-safe queue the engine drains between steps, and each
request gets its events (:class:`Delta`, :class:`Done`, :class:`Failed`) on its own
``asyncio.Queue``, fed through ``loop.call_soon_threadsafe``: the events of one
iteration go together, one wake-up of the loop, not one a token.

One iteration: drain the queue; admit waiting requests first come, first served while the
batcher has a free row and the pages for the head of the line (``can_admit``: a request
never runs out of pages mid-decode) and the iteration's prompt tokens stay within
``max_prefill_tokens`` (the first admission always goes); one decode step over every
running row; per row, the new token's text, checked against the end of text,
``max_tokens`` and the stop strings, and the row released when it ends. The waiting line
is bounded (``max_waiting``): one more request is refused at once (:class:`Busy`: HTTP
429). The engine publishes a :class:`Stats` snapshot each iteration, which ``/metrics``
reads.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("lapse.serve")


class Batcher(Protocol):
    """What the engine needs of :class:`lapse.generation.batching.RowBatcher`."""

    rows: int

    def pages_total(self) -> int: ...
    def pages_free(self) -> int: ...
    def pages_used(self) -> int: ...
    def free_rows(self) -> int: ...
    def can_admit(self, req) -> bool: ...
    def check(self, req) -> None: ...
    def admit(self, req) -> tuple[int, int]: ...
    def step(self) -> dict[int, int]: ...
    def release(self, row: int) -> None: ...
    def active_rows(self) -> list[int]: ...


@dataclass(frozen=True)
class Delta:
    """New text of a request (``text`` may be empty: tokens whose bytes do not decode yet)."""

    text: str
    tokens: int


@dataclass(frozen=True)
class Done:
    """The request ended: ``finish_reason`` ``"stop"`` (end of text, a stop string) or ``"length"``."""

    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class Failed:
    """The request could not run: the HTTP status and OpenAI error fields to answer."""

    status: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None


class Busy(Exception):
    """The waiting line is full: answer 429 and ask the client to retry later."""


class Stopped(Exception):
    """The engine thread is not running (it failed, or the server is shutting down)."""


@dataclass(frozen=True)
class Stats:
    """A snapshot of the engine, taken by its thread after each iteration."""

    running: int = 0
    waiting: int = 0
    pages_total: int = 0
    pages_used: int = 0
    pages_free: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    throughput: float = 0.0
    """Generated tokens per second over the last :data:`THROUGHPUT_WINDOW` seconds."""


THROUGHPUT_WINDOW = 10.0


class Observer(Protocol):
    """The histograms the engine feeds (``lapse.serve.metrics.ServerMetrics``)."""

    def first_token(self, seconds: float) -> None: ...
    def prefill(self, seconds: float) -> None: ...
    def iteration(self, tokens: int) -> None: ...
    def token_gap(self, seconds: float) -> None: ...
    def finished(self, queued: float, e2e: float) -> None: ...
    def rejected(self, reason: str) -> None: ...


@dataclass(eq=False)
class Job:
    """One request on its way through the engine."""

    rid: str
    request: Any
    """The batcher's request (:class:`lapse.generation.batching.RowRequest`)."""
    stops: list[str]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    arrived: float = field(default_factory=time.perf_counter)
    admitted: float | None = None
    last: float | None = None
    row: int | None = None
    ids: list[int] = field(default_factory=list)
    sent: int = 0
    """Characters of the decoded text handed out so far."""
    text: str = ""
    """The text of ``ids[:read]``, decoded a few tokens at a time (:func:`_detokenize`)."""
    window: int = 0
    read: int = 0
    """``ids[window:read]``: the tokens decoded with the next ones, so that a token's text
    comes out as it does inside the whole text (a leading space, a split UTF-8 sequence)."""
    drawn: int = 0
    """Tokens drawn, the end of text included."""

    def put(self, event: Delta | Done | Failed) -> None:
        """Hands ``event`` to the request's loop at once (one wake-up of the loop)."""
        _deliver(self.loop, [(self, event)])


def _deliver(loop: asyncio.AbstractEventLoop, events: list[tuple[Job, Delta | Done | Failed]]) -> None:
    """Puts every event on its request's queue from the loop's own thread, in order: one
    wake-up of the loop for all of them."""
    def put_all() -> None:
        for job, event in events:
            job.events.put_nowait(event)

    with contextlib.suppress(RuntimeError):  # the loop closed: nobody is listening any more
        loop.call_soon_threadsafe(put_all)


class Engine:
    """The engine thread around ``batcher``; ``tokenizer`` decodes the new tokens, ``eos_id``
    ends a request, ``max_waiting`` bounds the line of requests without a row,
    ``max_prefill_tokens`` the prompt tokens admitted between two decode steps (``None``: no
    bound); ``warmup`` runs on the engine thread before the first request (requests that
    come meanwhile wait in the line)."""

    def __init__(self, batcher: Batcher, tokenizer, *, eos_id: int | None, max_waiting: int,
                 max_prefill_tokens: int | None = None, warmup: Callable[[], None] | None = None,
                 observer: Observer | None = None, setup: Callable[[], contextlib.AbstractContextManager]
                 | None = None):
        self.batcher, self.tokenizer, self.eos_id = batcher, tokenizer, eos_id
        self.max_waiting, self.observer = max_waiting, observer
        self.max_prefill_tokens = max_prefill_tokens
        self._setup = setup or contextlib.nullcontext
        self._warmup = warmup
        self.ready = threading.Event()
        """Set once the warm-up ran (compiling the step before the first request waits)."""
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = 0  # submitted and not yet admitted, ended or aborted (the line's length)
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: dict[int, Job] = {}
        self._stats = Stats(pages_total=batcher.pages_total(), pages_free=batcher.pages_free())
        self._counts = {"prompt": 0, "generation": 0}
        self._finished: collections.Counter[str] = collections.Counter()
        # tokens of each iteration of the last THROUGHPUT_WINDOW seconds, and their sum
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._recent_total = 0
        self._drawn = 0  # tokens drawn since the last _publish
        self._stop = threading.Event()
        self._outbox: list[tuple[Job, Delta | Done | Failed]] = []  # this iteration's events
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="lapse-engine", daemon=True)

    def start(self) -> Engine:
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def stats(self) -> Stats:
        with self._lock:
            return self._stats

    def submit(self, job: Job) -> None:
        """Queues ``job``; :class:`Busy` when the waiting line is full, :class:`Stopped` when
        the engine is not running."""
        if not self.alive:
            raise Stopped("the engine is not running")
        with self._lock:
            # the line holds max_waiting requests beyond the rows free at the last iteration: a
            # burst onto free rows is taken whole, before the engine thread has admitted any
            free = max(0, self.batcher.rows - self._stats.running)
            if self._queued >= self.max_waiting + free:
                if self.observer is not None:
                    self.observer.rejected("queue_full")
                raise Busy(f"{self._queued - free} requests are waiting (--max-waiting {self.max_waiting})")
            self._queued += 1
        self._inbox.put(("submit", job))

    def abort(self, rid: str) -> None:
        """Ends request ``rid`` wherever it is (waiting: removed; running: its row released);
        nothing when it has ended."""
        self._inbox.put(("abort", rid))

    def _run(self) -> None:
        try:
            with self._setup():
                if self._warmup is not None:
                    self._warmup()
                self.ready.set()
                while not self._stop.is_set():
                    self._drain(block=not self._running and not self._waiting)
                    tokens = self._admit()
                    if self._running:
                        tokens += self._step()
                    if tokens and self.observer is not None:
                        self.observer.iteration(tokens)
                    self._flush()
                    self._publish()
        except BaseException as e:  # the engine is dead: every request hears it, /health says 503
            log.exception("the engine thread failed")
            self.error = e
            self._flush()  # what this iteration finished still reaches its requests
            for job in [*self._waiting, *self._running.values()]:
                job.put(Failed(500, f"the engine failed: {type(e).__name__}: {e}", "internal_server_error"))
            self._waiting.clear()
            self._running.clear()
            with self._lock:
                self._queued = 0
            while True:  # requests that raced the failure
                try:
                    kind, item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                if kind == "submit":
                    item.put(Failed(503, "the engine is not running", "internal_server_error"))

    def _drain(self, block: bool) -> None:
        while True:
            try:
                kind, item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if kind == "submit":
                self._take(item)
            else:
                self._abort(item)

    def _take(self, job: Job) -> None:
        """Queues ``job``, or fails it at once when the batcher can never take it."""
        check = getattr(self.batcher, "check", None)
        try:
            if check is not None:
                check(job.request)
        except ValueError as e:
            self._dequeued()
            self._post(job, Failed(400, str(e)))
            return
        self._waiting.append(job)

    def _abort(self, rid: str) -> None:
        for job in self._waiting:
            if job.rid == rid:
                self._waiting.remove(job)
                self._dequeued()
                return
        for job in list(self._running.values()):
            if job.rid == rid:
                self._end(job)
                return

    def _post(self, job: Job, event: Delta | Done | Failed) -> None:
        """Queues ``event`` for the end of this iteration (:meth:`_flush`)."""
        self._outbox.append((job, event))

    def _flush(self) -> None:
        """This iteration's events to their loops: one wake-up a loop, not one a token."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for job, event in self._outbox:
            by_loop.setdefault(job.loop, []).append((job, event))
        self._outbox = []
        for loop, events in by_loop.items():
            _deliver(loop, events)

    def _dequeued(self) -> None:
        with self._lock:
            self._queued -= 1

    def _admit(self) -> int:
        """Admits what fits, first come, first served; returns the prompt tokens prefilled."""
        prefilled = 0
        while self._waiting and self.batcher.free_rows() > 0:
            job = self._waiting[0]
            # the head of the line waits for pages held by running requests; with none
            # running, admit tells whether it can ever fit
            if self._running and not self.batcher.can_admit(job.request):
                return prefilled
            if (prefilled and self.max_prefill_tokens is not None
                    and prefilled + len(job.request.prompt) > self.max_prefill_tokens):
                return prefilled  # the rest after the next decode step
            self._waiting.popleft()
            self._dequeued()
            start = time.perf_counter()
            try:
                row, token = self.batcher.admit(job.request)
            except ValueError as e:
                self._post(job, Failed(400, str(e)))
                continue
            job.row, job.admitted = row, time.perf_counter()
            prefilled += len(job.request.prompt)
            if self.observer is not None:
                self.observer.prefill(job.admitted - start)
            self._running[row] = job
            self._counts["prompt"] += len(job.request.prompt)
            if self.observer is not None:
                self.observer.first_token(job.admitted - job.arrived)
            job.last = job.admitted
            self._token(job, token)
        return prefilled

    def _step(self) -> int:
        """One decode step; returns the tokens it drew."""
        tokens = self.batcher.step()
        now = time.perf_counter()
        for row, token in tokens.items():
            job = self._running.get(row)
            if job is None:
                continue
            if self.observer is not None and job.last is not None:
                self.observer.token_gap(now - job.last)
            job.last = now
            self._token(job, token)
        return len(tokens)

    def _token(self, job: Job, token: int) -> None:
        """Takes one new token of ``job``: its text out, and the row released when it ends."""
        self._counts["generation"] += 1
        job.drawn += 1
        self._drawn += 1
        if token == self.eos_id:
            self._finish(job, "stop", flush=True)
            return
        job.ids.append(token)
        text = _detokenize(self.tokenizer, job)
        length = len(job.ids) >= job.request.max_new_tokens
        cut = _first_stop(text, job.stops, job.sent)
        if cut is not None:
            self._post(job, Delta(text[job.sent : cut], 1))
            job.sent = cut
            self._finish(job, "stop", flush=False)
            return
        if length:
            self._finish(job, "length", flush=True, text=text)
            return
        if text.endswith("\ufffd"):  # an unfinished UTF-8 sequence: wait for its next bytes
            self._post(job, Delta("", 1))
            return
        end = len(text) - _held_back(text, job.stops, job.sent)
        self._post(job, Delta(text[job.sent : end], 1))
        job.sent = end

    def _finish(self, job: Job, reason: str, *, flush: bool, text: str | None = None) -> None:
        if flush:
            text = self.tokenizer.decode(job.ids) if text is None else text
            if len(text) > job.sent:
                self._post(job, Delta(text[job.sent :], 0))
                job.sent = len(text)
        self._finished[reason] += 1
        self._post(job, Done(reason, len(job.request.prompt), job.drawn))
        if self.observer is not None:
            now = time.perf_counter()
            self.observer.finished(job.admitted - job.arrived, now - job.arrived)
        self._end(job)

    def _end(self, job: Job) -> None:
        if self._running.pop(job.row, None) is not None:
            self.batcher.release(job.row)

    def _publish(self) -> None:
        now = time.perf_counter()
        if self._drawn:
            self._recent.append((now, self._drawn))
            self._recent_total, self._drawn = self._recent_total + self._drawn, 0
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW:
            self._recent_total -= self._recent.popleft()[1]
        b = self.batcher
        stats = Stats(
            running=len(self._running), waiting=len(self._waiting), pages_total=b.pages_total(),
            pages_used=b.pages_used(), pages_free=b.pages_free(), prompt_tokens=self._counts["prompt"],
            generation_tokens=self._counts["generation"], finished=dict(self._finished),
            throughput=self._recent_total / THROUGHPUT_WINDOW,
        )
        with self._lock:
            self._stats = stats


def _detokenize(tokenizer, job: Job) -> str:
    """The text of all of ``job.ids``, decoding only the tokens since the last complete
    character (not the whole text again at every token): the text of ``ids[window:]``
    past that of ``ids[window:read]`` is what the new tokens add. A text that ends in an
    unfinished UTF-8 sequence (U+FFFD) is returned as it is and decoded again with the
    next token."""
    before = tokenizer.decode(job.ids[job.window : job.read])
    now = tokenizer.decode(job.ids[job.window :])
    if now.startswith(before):
        text = job.text + now[len(before) :]
    else:  # the window's own text changed (a tokenizer that reads further back): all of it
        text = tokenizer.decode(job.ids)
    if not text.endswith("\ufffd"):
        job.text, job.window, job.read = text, job.read, len(job.ids)
    return text


def _first_stop(text: str, stops: list[str], sent: int) -> int | None:
    """Where the first stop string in ``text`` starts (not before ``sent``: that text is out)."""
    found = [i for s in stops if (i := text.find(s, max(0, sent - len(s) + 1))) >= 0]
    return max(min(found), sent) if found else None


def _held_back(text: str, stops: list[str], sent: int) -> int:
    """Characters at the end of ``text`` that may begin a stop string: kept until the next
    token tells."""
    held = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text) - sent), held, -1):
            if text.endswith(s[:n]):
                held = n
                break
    return held
