"""The OpenAI API's request bodies, error objects and answer objects, as the server speaks them.

Requests are validated with pydantic; every refusal is an :class:`APIError` whose :meth:`APIError.body` is the
OpenAI error object ``{"error": {"message", "type", "param", "code"}}``. Fields the OpenAI API defines but this
server cannot honour (``n`` > 1, tools, penalties...) are refused with a 400 naming the field rather than silently
ignored; fields it does not know are ignored, as client libraries send extras. Log-probabilities: ``logprobs`` and
``top_logprobs`` (0 to :data:`MAX_CHAT_TOP_LOGPROBS`) in chat, ``logprobs`` (0 to
:data:`MAX_COMPLETION_LOGPROBS`) and ``echo`` in completions (see :mod:`eagle.application.logprobs`).

The drafter is chosen per request by an extension field, ``"drafter"`` (a drafter spec the loaded model can run:
``"eagle3"``, ``"eagle3+lookup"``, ``"lookup"``, ``"none"`` for plain decoding...; absent: the server's
``--drafter``). EAGLE's figures travel in an extension field, ``"eagle"``, of every answer (and of the last
streamed chunks): ``{"drafter": the drafter spec that generated it, "steps": target forward passes,
"accepted_tokens": accepted draft tokens, "accepted_tokens_per_step": accepted draft tokens per verification step,
"tokens_per_step": generated tokens per target forward pass}``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..model.engine.logprobs import MAX_TOP_LOGPROBS

MAX_STOP_STRINGS = 4
#: Bounds of the alternatives per token: ``top_logprobs`` (chat; the engine's most, OpenAI's 20) and ``logprobs``
#: (completions), as OpenAI's.
MAX_CHAT_TOP_LOGPROBS, MAX_COMPLETION_LOGPROBS = MAX_TOP_LOGPROBS, 5
#: ``seed``'s range: OpenAI's (a 64-bit signed integer).
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1


class APIError(Exception):
    """A refused request: HTTP ``status`` and the OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    """Values of the JSON type the field declares: ``"8"`` is not an integer, ``1`` not a boolean (an integer is
    a number, as in JSON)."""

    model_config = ConfigDict(strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value):
        """A string or a list of text parts; any other part (an image...) is refused by its type."""
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("content must be a string or a list of text parts ({\"type\": \"text\", \"text\": "
                             "...})")
        for i, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" and isinstance(kind, str):
                raise ValueError(f"{kind} parts are not supported: this server serves a text-only model (part {i} "
                                 "of this message; only \"text\" parts are)")
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} of this message is not a text part ({{\"type\": \"text\", \"text\": "
                                 "a string}})")
        return value

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class SamplingRequest(_Strict):
    """The fields both endpoints share. ``top_k`` and ``drafter`` (a drafter spec, checked against the loaded model
    by the app) are extensions (``top_k`` 0 or -1 = off)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    drafter: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else ([] if value is None else value)
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty "
                             "strings")
        return stops

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value):
        if value != 1:
            raise ValueError("only n=1 is supported (one answer per request)")
        return value

    @property
    def top_logprobs_wanted(self) -> int | None:
        """Alternatives per generated token when the request wants logprobs, else None."""
        return None

    def check_fields(self) -> None:
        """Checks across fields: :class:`APIError` 400 naming the field at fault."""


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)

    @property
    def top_logprobs_wanted(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_fields(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs", code="invalid_value")


class CompletionRequest(SamplingRequest):
    """``prompt``: a string or token ids (a list of integers), or a list of one of those (one prompt per
    request); after validation, the string or the list of ids."""

    prompt: str | list[int]
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False

    @property
    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def check_fields(self) -> None:
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "'max_tokens' must be >= 1 (0 only with 'echo': true, to score the prompt).",
                           param="max_tokens", code="invalid_value")

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
            if len(value) != 1:
                raise ValueError(f"only one prompt per request is supported, got {len(value)} (send a string, a "
                                 "list of token ids, or a list of one of those)")
            value = value[0]
        if isinstance(value, list) and not all(type(v) is int and v >= 0 for v in value):
            raise ValueError("a prompt given as a list must hold token ids (integers from 0)")
        if not isinstance(value, (str, list)):
            raise ValueError("the prompt must be a string or a list of token ids (integers)")
        if not value:
            raise ValueError("the prompt is empty")
        return value


# Fields of the OpenAI API this server cannot honour, with the values that mean "not used".
UNSUPPORTED_UNLESS = {
    "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "best_of": (None, 1),
    "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]),
}


def _not_json(constant: str):
    raise ValueError(f"{constant} is not a JSON value")


def load_json(raw: bytes):
    """The JSON value of a request body; :class:`APIError` 400 for invalid JSON (``NaN`` and ``Infinity``, which
    Python's parser would take, included) or a body nested too deeply for the parser's recursion."""
    try:
        return json.loads(raw, parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as err:
        raise APIError(400, f"The request body is not valid JSON: {err}.") from None
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply to be parsed: this API's bodies are a few "
                       "levels deep.") from None


def parse_request(model_cls: type[SamplingRequest], raw: bytes) -> SamplingRequest:
    """Validate a JSON body; :class:`APIError` 400 naming the field at fault."""
    data = load_json(raw)
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        request = model_cls.model_validate(data)
    except RecursionError:
        raise APIError(400, "The request body is nested too deeply to be validated.") from None
    except ValidationError as err:
        first = err.errors()[0]
        param = ".".join(str(part) for part in first["loc"]) or None
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"Invalid value for '{param}': {message}.", param=param,
                       code="invalid_value") from None
    for name, allowed in UNSUPPORTED_UNLESS.items():
        if name in data and data[name] not in allowed:
            raise APIError(400, f"'{name}' is not supported by this server; leave it out.", param=name,
                           code="unsupported_parameter")
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "'stream_options' is only allowed with stream=true.", param="stream_options",
                       code="invalid_value")
    request.check_fields()
    return request


# -------------------------------------------------------------------------------------------------------- answers
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def eagle_stats(drafter: str, steps: int, accepted: int, completion_tokens: int) -> dict:
    """The ``"eagle"`` extension field (see the module docstring). ``steps``: target forward passes, the prefill
    included."""
    verify_steps = max(steps - 1, 0)
    return {"drafter": drafter, "steps": steps, "accepted_tokens": accepted,
            "accepted_tokens_per_step": round(accepted / verify_steps, 4) if verify_steps else 0.0,
            "tokens_per_step": round(completion_tokens / steps, 4) if steps else 0.0}


def chat_completion(request_id: str, model: str, text: str, finish_reason: str, usage_: dict, eagle: dict,
                    created: int | None = None, logprobs: dict | None = None) -> dict:
    """``logprobs``: the choice's ``{"content": [...]}`` when asked for (see :mod:`eagle.application.logprobs`)."""
    return {"id": request_id, "object": "chat.completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                         "finish_reason": finish_reason}],
            "usage": usage_, "eagle": eagle}


def chat_chunk(request_id: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               usage_: dict | None = None, eagle: dict | None = None, logprobs: dict | None = None) -> dict:
    """One streamed chunk; ``delta=None`` makes the usage-only chunk (no choices)."""
    chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": []}
    if delta is not None:
        chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
    return _with_extras(chunk, usage_, eagle)


def completion(request_id: str, model: str, text: str | None, finish_reason: str | None, created: int,
               usage_: dict | None = None, eagle: dict | None = None, logprobs: dict | None = None) -> dict:
    """A text completion, or one streamed chunk of it (``text=None``: the usage-only chunk); ``logprobs`` the
    legacy ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` when asked for."""
    answer: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                              "choices": []}
    if text is not None:
        answer["choices"] = [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]
    return _with_extras(answer, usage_, eagle)


def _with_extras(body: dict, usage_: dict | None, eagle: dict | None) -> dict:
    """``body`` with the ``usage`` and ``eagle`` (extension) fields where given."""
    if usage_ is not None:
        body["usage"] = usage_
    if eagle is not None:
        body["eagle"] = eagle
    return body


def sse(data: dict | str) -> str:
    """One server-sent event."""
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"
