"""The HTTP side of ``lapse serve``: a Starlette app with OpenAI's routes over an :class:`Engine`.

``POST /v1/completions`` and ``POST /v1/chat/completions`` (the tokenizer's chat template;
a tokenizer without one answers 400), each streamed as server-sent events ending in
``data: [DONE]`` when ``stream`` is set; ``GET /v1/models``, ``GET /health`` (503 once the
engine thread died) and ``GET /metrics`` (:mod:`lapse.serve.metrics`). Errors are OpenAI's
bodies (:func:`lapse.serve.protocol.error_body`), 4xx for anything a request can cause.
A client that goes away aborts its request: a stream's generator ends in its ``finally``
(Starlette cancels it on ``http.disconnect``), a plain request watches ``receive`` beside
the result; the engine releases the row and its pages.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import Busy, Delta, Done, Engine, Failed, Job, Stopped
from .metrics import ServerMetrics
from .protocol import ChatRequest, CompletionRequest, RequestError, error_body, validation_error

log = logging.getLogger("lapse.serve")

MAX_BODY = 4 * 2**20
"""Largest request body (bytes)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServedModel:
    """What the routes need to know of the model behind the engine."""

    name: str
    max_context: int
    vocab_size: int
    policy: object
    """The server's policy (:mod:`lapse.generation.policies`): requests may change its budget."""
    policy_name: str
    make_request: Callable[..., object]
    """``RowRequest``'s constructor (its fields as keywords)."""


def build_app(engine: Engine, tokenizer, model: ServedModel, metrics: ServerMetrics) -> Starlette:
    """The app over a started ``engine``; ``tokenizer`` encodes prompts (and its Hugging
    Face tokenizer, where it wraps one, applies the chat template)."""
    metrics.engine = engine
    created = int(time.time())

    async def health(request: Request) -> Response:
        if not engine.alive:
            return JSONResponse(error_body("the engine is not running", "internal_server_error"), 503)
        if not engine.ready.is_set():
            return JSONResponse(error_body("the engine is warming up (compiling its decode step)",
                                           "service_unavailable"), 503, headers={"Retry-After": "1"})
        return JSONResponse({})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [
            {"id": model.name, "object": "model", "created": created, "owned_by": "lapse",
             "max_model_len": model.max_context}]})

    async def metrics_text(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(request: Request) -> Response:
        return await _serve(request, CompletionRequest, chat=False)

    async def chat(request: Request) -> Response:
        return await _serve(request, ChatRequest, chat=True)

    async def _serve(request: Request, kind, chat: bool) -> Response:
        try:
            body = await _json(request)
            try:
                req = kind.model_validate(body)
            except ValidationError as e:
                raise validation_error(e) from None
            req.checked()
            if req.model != model.name:
                raise RequestError(404, f"the model {req.model!r} does not exist; this server serves "
                                   f"{model.name!r}", "not_found_error", "model", "model_not_found")
            prompt = _chat_prompt(tokenizer, req) if chat else _prompt(tokenizer, req)
            job = _job(req, prompt, chat)
            engine.submit(job)
        except RequestError as e:
            return JSONResponse(e.body(), e.status)
        except ClientDisconnect:
            return Response(status_code=499)
        except Busy as e:
            return JSONResponse(error_body(f"the server is busy: {e}; retry later", "rate_limit_error"), 429,
                                headers={"Retry-After": "1"})
        except Stopped as e:
            return JSONResponse(error_body(str(e), "internal_server_error"), 503)
        rid = job.rid
        if req.stream:
            return StreamingResponse(_stream(job, req, chat), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _whole(request, job, chat, rid)

    def _job(req, prompt: list[int], chat: bool) -> Job:
        room = model.max_context - len(prompt)
        asked = req.max_completion_tokens or req.max_tokens if chat else req.max_tokens
        if room < 1 or (asked is not None and asked > room):
            raise RequestError(400, f"the prompt ({len(prompt)} tokens)"
                               f"{f' + max_tokens ({asked})' if asked else ''} exceeds the context of "
                               f"{model.max_context} tokens", param="max_tokens" if room >= 1 else "prompt",
                               code="context_length_exceeded")
        n = asked if asked is not None else (room if chat else min(16, room))
        policy, budget = _policy(req.lapse, len(prompt))
        try:
            row = model.make_request(prompt=prompt, max_new_tokens=n, temperature=req.temperature,
                                     top_k=req.top_k_or_none(), top_p=req.top_p, seed=req.seed, budget=budget,
                                     policy=policy)
        except ValueError as e:
            raise RequestError(400, str(e)) from None
        prefix = "chatcmpl-" if chat else "cmpl-"
        return Job(rid=prefix + secrets.token_hex(12), request=row, stops=req.stops(),
                   loop=asyncio.get_running_loop(), events=asyncio.Queue())

    def _policy(options, prompt_len: int) -> tuple[object | None, float | int | None]:
        """The request's own policy (``None``: the server's) and budget from ``"lapse"``."""
        if options is None:
            return None, None
        own = None
        if options.policy is not None and options.policy != model.policy_name:
            from lapse.generation.policies import POLICIES, PolicyOptions

            if options.policy not in POLICIES:
                raise RequestError(400, f"lapse.policy must be one of {', '.join(POLICIES)}, got "
                                   f"{options.policy!r}", param="lapse.policy")
            own = PolicyOptions(policy=options.policy).make_policy()  # the kind's defaults
        base = model.policy if own is None else own
        name = options.policy or model.policy_name
        if options.budget is None:
            return own, None
        fields = {f.name for f in dataclasses.fields(base)}
        b = options.budget
        if "budget" in fields:
            if b > 1 and b != int(b):
                raise RequestError(400, f"lapse.budget above 1 counts tokens: give an integer, got {b}",
                                   param="lapse.budget")
            budget, changes = int(b) if b > 1 else b, {"budget": int(b) if b > 1 else b}
        elif "window" in fields:  # the window policy: its window in tokens
            if b != int(b):
                raise RequestError(400, f"lapse.budget of the window policy is its window in tokens: give "
                                   f"an integer, got {b}", param="lapse.budget")
            budget, changes = int(b), {"window": int(b)}
        else:
            raise RequestError(400, f"lapse.budget: the {name} policy takes no budget (h2o, "
                               "a2sf and window do)", param="lapse.budget")
        try:
            dataclasses.replace(base, **changes).check_context(prompt_len, prompt_len + 1)
        except ValueError as e:
            raise RequestError(400, f"lapse.budget: {e}", param="lapse.budget") from None
        return own, budget

    async def _whole(request: Request, job: Job, chat: bool, rid: str) -> Response:
        text, done, gone = [], None, asyncio.create_task(_disconnected(request))
        try:
            while done is None:
                get = asyncio.ensure_future(job.events.get())
                await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    engine.abort(rid)
                    return Response(status_code=499)
                event = get.result()
                if isinstance(event, Failed):
                    return JSONResponse(error_body(event.message, event.type, code=event.code), event.status)
                if isinstance(event, Delta):
                    text.append(event.text)
                else:
                    done = event
        finally:
            gone.cancel()
        usage = _usage(done)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text)},
                      "logprobs": None, "finish_reason": done.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": "".join(text), "logprobs": None,
                      "finish_reason": done.finish_reason}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": model.name,
                             "choices": [choice], "usage": usage})

    async def _stream(job: Job, req, chat: bool) -> AsyncIterator[str]:
        finished = False
        obj = "chat.completion.chunk" if chat else "text_completion"
        now = int(time.time())

        def chunk(choices: list, usage: dict | None = None) -> str:
            body = {"id": job.rid, "object": obj, "created": now, "model": model.name, "choices": choices}
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        def piece(text: str | None, reason: str | None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}

        try:
            if chat:
                yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            here: collections.deque = collections.deque()  # events taken off the queue, not yet sent
            while True:
                event = here.popleft() if here else await job.events.get()
                while not job.events.empty():
                    here.append(job.events.get_nowait())
                if isinstance(event, Failed):
                    finished = True
                    yield f"data: {json.dumps(error_body(event.message, event.type, code=event.code))}\n\n"
                    break
                if isinstance(event, Delta):
                    # the text of every delta already here in one chunk: when the loop falls
                    # behind the engine, fewer, larger writes catch it up
                    text = [event.text]
                    while here and isinstance(here[0], Delta):
                        text.append(here.popleft().text)
                    if any(text):
                        yield chunk([piece("".join(text), None)])
                    continue
                finished = True
                yield chunk([piece(None, event.finish_reason)])
                if req.include_usage():
                    yield chunk([], _usage(event))
                break
            yield "data: [DONE]\n\n"
        finally:
            if not finished:  # the client went away (or the server stops): free the row
                engine.abort(job.rid)

    async def on_error(request: Request, exc: Exception) -> Response:
        log.exception("a request failed", exc_info=exc)
        return JSONResponse(error_body(f"{type(exc).__name__}: {exc}", "internal_server_error"), 500)

    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat, methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={Exception: on_error})


async def _json(request: Request):
    """The body as a JSON object (400 otherwise, 413 above :data:`MAX_BODY`)."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise RequestError(413, f"the body is larger than {MAX_BODY} bytes")
    raw = await request.body()
    if len(raw) > MAX_BODY:
        raise RequestError(413, f"the body is larger than {MAX_BODY} bytes")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"the body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    return body


def _prompt(tokenizer, req: CompletionRequest) -> list[int]:
    if isinstance(req.prompt, str):
        ids = tokenizer.encode(req.prompt)
    else:
        ids = list(req.prompt)
        bad = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
        if bad:
            raise RequestError(400, f"prompt: token ids must be in [0, {tokenizer.vocab_size}), got {bad[0]}",
                               param="prompt")
    if not ids:
        raise RequestError(400, "prompt: the prompt is empty (it encodes to no tokens)", param="prompt")
    return ids


def _chat_prompt(tokenizer, req: ChatRequest) -> list[int]:
    hf = getattr(tokenizer, "tokenizer", None)  # a TransformersTokenizer's own
    if hf is None or not getattr(hf, "chat_template", None):
        raise RequestError(400, "this model's tokenizer has no chat template: use /v1/completions",
                           param="messages")
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        ids = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    except Exception as e:  # the template's own checks (roles in order, ...): the request's fault
        raise RequestError(400, f"messages: the chat template refused them: {e}", param="messages") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
        ids = ids["input_ids"]
    ids = [int(i) for i in ids]
    if not ids:
        raise RequestError(400, "messages: the prompt is empty", param="messages")
    return ids


def _usage(done: Done) -> dict:
    return {"prompt_tokens": done.prompt_tokens, "completion_tokens": done.completion_tokens,
            "total_tokens": done.prompt_tokens + done.completion_tokens}


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
