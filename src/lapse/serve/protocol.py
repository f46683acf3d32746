"""The requests ``lapse serve`` takes and the error bodies it answers, in OpenAI's shapes.

Requests are pydantic models that keep fields they do not know (``extra="allow"``): a
client that sends one (``user``, a newer API's field) gets its answer, and the server logs
one warning naming what it ignored. Fields whose other values change what OpenAI would
answer (``n``, ``logprobs``, ``echo``, penalties) are refused unless left at their
defaults. ``lapse`` carries the policy settings of one request: ``{"policy": NAME,
"budget": B}``.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

log = logging.getLogger("lapse.serve")

ErrorType = Literal["invalid_request_error", "not_found_error", "rate_limit_error", "internal_server_error"]


def error_body(message: str, type: ErrorType = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class RequestError(Exception):
    """A request the server refuses: HTTP ``status`` with :func:`error_body`'s fields."""

    def __init__(self, status: int, message: str, type: ErrorType = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def validation_error(e: ValidationError) -> RequestError:
    """A pydantic error as a 400 naming its first field (``param``: the location joined by dots)."""
    first = e.errors()[0]
    param = ".".join(str(p) for p in first["loc"]) or None
    where = f"{param}: " if param else ""
    return RequestError(400, f"{where}{first['msg']}", param=param)


class LapseOptions(BaseModel):
    """``"lapse": {...}`` of a request: the policy settings it changes. Strict: any other key
    is an error, since a misspelt budget must not run at the server's."""

    model_config = ConfigDict(extra="forbid")
    policy: str | None = None
    """This request's eviction policy (a kind of ``lapse generate --policy``): the server's
    own settings for the server's kind, the kind's defaults for another; it must fit the
    model and the server's store (h2o and a2sf only on a server that ranks by the same
    scores)."""
    budget: float | None = Field(default=None, gt=0)
    """h2o / a2sf: the tokens this request keeps per head (a share of its prompt if <= 1)."""


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    """vLLM's extra: the k most likely tokens only (<= 0: all)."""
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    lapse: LapseOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError("at most 4 stop strings")
        if any(not s for s in stops):
            raise ValueError("a stop string is empty")
        return v

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def checked(self) -> None:
        """Refuses what the server does not do (400, naming the field)."""
        if self.n != 1:
            raise RequestError(400, "n: only n=1 is served", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0:
                raise RequestError(400, f"{name}: penalties are not served", param=name)
        if self.logit_bias:
            raise RequestError(400, "logit_bias is not served", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError(400, "stream_options is only allowed with stream=true", param="stream_options")
        warn_ignored(self)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def top_k_or_none(self) -> int | None:
        return self.top_k if self.top_k is not None and self.top_k > 0 else None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``."""

    prompt: str | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def checked(self) -> None:
        super().checked()
        if self.echo:
            raise RequestError(400, "echo is not served", param="echo")
        if self.logprobs is not None:
            raise RequestError(400, "logprobs are not served", param="logprobs")
        if self.best_of not in (None, 1):
            raise RequestError(400, "best_of: only 1 is served", param="best_of")
        if self.suffix:
            raise RequestError(400, "suffix is not served", param="suffix")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False

    def checked(self) -> None:
        super().checked()
        if self.logprobs:
            raise RequestError(400, "logprobs are not served", param="logprobs")


def warn_ignored(request: BaseModel) -> None:
    """One warning naming the fields of ``request`` (and of its nested objects) that no
    model field reads."""
    ignored = sorted(_extra(request, ""))
    if ignored:
        log.warning("ignored fields of the request: %s", ", ".join(ignored))


def _extra(obj: BaseModel, prefix: str) -> list[str]:
    names = [prefix + k for k in (obj.model_extra or {})]
    for name in type(obj).model_fields:
        value = getattr(obj, name)
        values = value if isinstance(value, list) else [value]
        for i, v in enumerate(values):
            if isinstance(v, BaseModel):
                at = f"{prefix}{name}.{i}." if isinstance(value, list) else f"{prefix}{name}."
                names += _extra(v, at)
    return names
