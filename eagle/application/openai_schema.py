"""The OpenAI API's request bodies, error objects and answer objects, as the server speaks them.

Requests are validated with pydantic; every refusal is an :class:`APIError` whose :meth:`APIError.body` is the
OpenAI error object ``{"error": {"message", "type", "param", "code"}}``. Fields the OpenAI API defines but this
server cannot honour (``n`` > 1, log-probabilities, tools, penalties...) are refused with a 400 naming the field
rather than silently ignored; fields it does not know are ignored, as client libraries send extras.

EAGLE's figures travel in an extension field, ``"eagle"``, of every answer (and of the last streamed chunks):
``{"mode": "eagle" | "plain", "steps": target forward passes, "accepted_tokens": accepted draft tokens,
"accepted_tokens_per_step": accepted draft tokens per verification step, "tokens_per_step": generated tokens per
target forward pass}``.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

MAX_STOP_STRINGS = 4


class APIError(Exception):
    """A refused request: HTTP ``status`` and the OpenAI error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class SamplingRequest(BaseModel):
    """The fields both endpoints share. ``top_k`` is an extension (0 or -1 = off)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, ge=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    stop: list[str] = Field(default_factory=list)
    seed: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

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


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(SamplingRequest):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("only one prompt per request is supported (a string or a list of one string)")
            value = value[0]
        if not value:
            raise ValueError("the prompt is empty")
        return value


# Fields of the OpenAI API this server cannot honour, with the values that mean "not used".
UNSUPPORTED_UNLESS = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
    "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}), "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "audio": (None,), "modalities": (None, ["text"]),
}


def parse_request(model_cls: type[SamplingRequest], raw: bytes) -> SamplingRequest:
    """Validate a JSON body; :class:`APIError` 400 naming the field at fault."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"The request body is not valid JSON: {err}.") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    try:
        request = model_cls.model_validate(data)
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
    return request


# -------------------------------------------------------------------------------------------------------- answers
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def eagle_stats(mode: str, steps: int, accepted: int, completion_tokens: int) -> dict:
    """The ``"eagle"`` extension field (see the module docstring). ``steps``: target forward passes, the prefill
    included."""
    verify_steps = max(steps - 1, 0)
    return {"mode": mode, "steps": steps, "accepted_tokens": accepted,
            "accepted_tokens_per_step": round(accepted / verify_steps, 4) if verify_steps else 0.0,
            "tokens_per_step": round(completion_tokens / steps, 4) if steps else 0.0}


def chat_completion(request_id: str, model: str, text: str, finish_reason: str, usage_: dict, eagle: dict,
                    created: int | None = None) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created or int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_, "eagle": eagle}


def chat_chunk(request_id: str, model: str, created: int, delta: dict | None, finish_reason: str | None = None,
               usage_: dict | None = None, eagle: dict | None = None) -> dict:
    """One streamed chunk; ``delta=None`` makes the usage-only chunk (no choices)."""
    chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": model, "choices": []}
    if delta is not None:
        chunk["choices"] = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    return _with_extras(chunk, usage_, eagle)


def completion(request_id: str, model: str, text: str | None, finish_reason: str | None, created: int,
               usage_: dict | None = None, eagle: dict | None = None) -> dict:
    """A text completion, or one streamed chunk of it (``text=None``: the usage-only chunk)."""
    answer: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                              "choices": []}
    if text is not None:
        answer["choices"] = [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
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
