"""The OpenAI-compatible FastAPI app around a loaded ``EaModel``: :func:`build_app`.

Endpoints: ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /health``,
``GET /metrics``, and with ``api_docs`` ``GET /openapi.json``, ``/docs`` and ``/redoc`` (behind the API key like
``/v1``). Every request first passes :class:`~eagle.application.request_guard.RequestGuard` (its ``Host``, its
``Content-Type``, its size). A body is parsed, validated and its prompt tokenized in a worker thread, off the event
loop, so that a large one does not stall the other clients. Generation runs in the
:class:`~eagle.application.worker.ModelWorker`'s thread; each request gets its text through an asyncio
queue fed from that thread. Requests, answers and errors follow the OpenAI API (see
:mod:`eagle.application.openai_schema`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import openai_schema as schema
from .logprobs import LogprobWriter, with_first_token
from .openai_schema import APIError, ChatCompletionRequest, CompletionRequest
from .request_guard import RequestGuard, allowed_hosts
from .request_prompts import PromptEncoder, chat_prompt_ids  # noqa: F401  (chat_prompt_ids: this module's name)
from .worker import GenerationParams, Job, ModelWorker, Update
from .text_stream import TextStream

logger = logging.getLogger(__name__)

#: How often a waiting non-streamed request checks that its client is still connected.
DISCONNECT_POLL_S = 0.25
#: Request bodies larger than this get 413 (``--max-body-bytes``).
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
#: Request bodies parsed and tokenized at once (in worker threads); more wait for a free one.
PREPARE_THREADS = 4
#: How long the app's shutdown waits for the model worker to finish the step it is in.
WORKER_EXIT_WAIT_S = 2.0
#: The longest prompt whose logprobs ``echo`` computes (``--max-echo-tokens``): one forward pass keeping every
#: position's logits (prompt x vocabulary floats).
DEFAULT_MAX_ECHO_TOKENS = 2048


@dataclass
class ServerSettings:
    """``served_model_name``: the one model name clients use; ``api_key``: when set, every ``/v1`` request (and
    the API docs) needs ``Authorization: Bearer <key>`` (the scheme in any case); ``model_type``: prompt format for
    chat (None = the tokenizer's chat template); ``default_max_tokens``: the answer budget when a request sets
    none; ``allowed_hosts``: the ``Host`` names answered (:func:`~eagle.application.request_guard.allowed_hosts`);
    ``max_body_bytes``: larger bodies get 413; ``api_docs``: serve ``/openapi.json``, ``/docs`` and ``/redoc``;
    ``max_echo_tokens``: the longest prompt ``echo`` with ``logprobs`` scores (longer: 400)."""

    served_model_name: str
    api_key: str | None = None
    model_type: str | None = None
    default_max_tokens: int = 512
    allowed_hosts: frozenset[str] = field(default_factory=allowed_hosts)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    api_docs: bool = False
    max_echo_tokens: int = DEFAULT_MAX_ECHO_TOKENS


class _Mailbox:
    """Updates from the worker thread to the request coroutines of one event loop. The updates the worker posts
    while the loop is busy reach it together, in one wake-up: a step of a batch of B rows wakes the loop thread
    (which competes with the worker for the interpreter lock) once, not B times."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Update]] = []

    def post(self, queue: asyncio.Queue, update: Update) -> None:
        with self._lock:
            self._pending.append((queue, update))
            wake = len(self._pending) == 1  # otherwise a wake-up is already on its way
        if wake:
            with contextlib.suppress(RuntimeError):  # the event loop is gone: nobody is listening any more
                self.loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, update in pending:
            queue.put_nowait(update)


class _Channel:
    """Updates from the worker thread to one request's coroutine (through its loop's :class:`_Mailbox`)."""

    def __init__(self, mailbox: _Mailbox):
        self.mailbox = mailbox
        self.queue: asyncio.Queue[Update] = asyncio.Queue()

    def deliver(self, update: Update) -> None:
        self.mailbox.post(self.queue, update)


def _mailbox(state) -> _Mailbox:
    """The app's mailbox on the running event loop (made at the first request on that loop)."""
    loop = asyncio.get_running_loop()
    mailbox = getattr(state, "mailbox", None)
    if mailbox is None or mailbox.loop is not loop:
        mailbox = state.mailbox = _Mailbox(loop)
    return mailbox


def build_app(model, worker: ModelWorker, settings: ServerSettings) -> FastAPI:
    """The app. The serving worker starts with the app (lifespan; already started is fine) and stops with it."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.prepare_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="eagle-prepare")
        app.state.worker_stopped = False
        worker.start()
        try:
            yield
        finally:
            app.state.prepare_pool.shutdown(wait=False, cancel_futures=True)
            app.state.worker_stopped = worker.close(timeout=WORKER_EXIT_WAIT_S)
            if not app.state.worker_stopped:
                logger.warning("the model worker is still inside a step; not waiting for it")

    app = FastAPI(title="eagle OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.worker, app.state.settings, app.state.model = worker, settings, model
    app.add_middleware(RequestGuard, allowed=settings.allowed_hosts, max_body_bytes=settings.max_body_bytes)
    _add_error_handlers(app)
    _add_routes(app, model, worker, settings)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return JSONResponse(APIError(err.status_code, f"{request.method} {request.url.path}: {err.detail}",
                                     type=kind).body(), status_code=err.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        logger.exception("internal error while answering %s %s", request.method, request.url.path)
        return JSONResponse(APIError(500, f"Internal server error: {err}", type="server_error").body(),
                            status_code=500)


def _bearer_token(header: str) -> str | None:
    """The credentials of an ``Authorization: Bearer <token>`` header (the scheme in any case, RFC 7235)."""
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _add_routes(app: FastAPI, model, worker: ModelWorker, settings: ServerSettings) -> None:
    name = settings.served_model_name
    prompts = PromptEncoder(model, settings.model_type, worker.max_length)

    async def authenticate(request: Request) -> None:
        if settings.api_key:
            given = _bearer_token(request.headers.get("authorization", "")) or ""
            if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
                raise APIError(401, "Missing or wrong API key: send the header 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")

    api = APIRouter(prefix="/v1", dependencies=[Depends(authenticate)])

    @api.get("/models")
    async def list_models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "eagle"}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": name, "drafter": worker.drafter, "drafters": worker.runnable_drafters(),
                "queue_depth": worker.queue_depth(),
                "running": worker.running()}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(worker.render_metrics(), media_type="text/plain; version=0.0.4")

    def prepare_chat(raw: bytes) -> tuple[ChatCompletionRequest, list[int]]:
        body = schema.parse_request(ChatCompletionRequest, raw)
        _check_model(body.model, name)
        return body, prompts.chat(body.messages)

    def prepare_completion(raw: bytes) -> tuple[CompletionRequest, list[int]]:
        body = schema.parse_request(CompletionRequest, raw)
        _check_model(body.model, name)
        return body, prompts.completion(body.prompt)

    @api.post("/chat/completions")
    async def chat_completions(request: Request):
        body, prompt_ids = await _off_loop(request, prepare_chat, await request.body())
        budget = body.max_completion_tokens or body.max_tokens
        return await _answer(request, body, prompt_ids, budget, chat=True, model=model, worker=worker,
                             settings=settings)

    @api.post("/completions")
    async def completions(request: Request):
        body, prompt_ids = await _off_loop(request, prepare_completion, await request.body())
        return await _answer(request, body, prompt_ids, body.max_tokens, chat=False, model=model,
                             worker=worker, settings=settings)

    app.include_router(api)
    if settings.api_docs:
        _add_docs(app, authenticate)


def _add_docs(app: FastAPI, authenticate) -> None:
    """``/openapi.json``, ``/docs`` (Swagger UI) and ``/redoc``, behind the API key when one is set."""
    docs = APIRouter(dependencies=[Depends(authenticate)], include_in_schema=False)

    @docs.get("/openapi.json")
    async def openapi():
        return JSONResponse(app.openapi())

    @docs.get("/docs")
    async def swagger():
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

    @docs.get("/redoc")
    async def redoc():
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    app.include_router(docs)


async def _off_loop(request: Request, work, *args):
    """``work(*args)`` in a thread of the app's pool (:data:`PREPARE_THREADS`), so that the event loop goes on
    serving the other clients meanwhile; its :class:`APIError` reaches the caller."""
    pool = getattr(request.app.state, "prepare_pool", None)
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(work, *args))


def _check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise APIError(404, f"The model '{requested}' does not exist; this server serves '{served}'.",
                       param="model", code="model_not_found")


def _params(body: schema.SamplingRequest, budget: int | None, prompt_length: int, max_length: int,
            settings: ServerSettings) -> GenerationParams:
    if not prompt_length:
        raise APIError(400, "The prompt is empty.", param="prompt")
    if prompt_length >= max_length:
        raise APIError(400, f"The prompt is {prompt_length} tokens long; this server's context holds {max_length} "
                       "tokens, prompt and answer together. Send a shorter prompt.",
                       param="messages" if isinstance(body, ChatCompletionRequest) else "prompt",
                       code="context_length_exceeded")
    echo = bool(getattr(body, "echo", False))
    if echo and body.top_logprobs_wanted is not None and prompt_length > settings.max_echo_tokens:
        raise APIError(400, f"'echo' with 'logprobs' scores prompts of at most {settings.max_echo_tokens} tokens "
                       f"(--max-echo-tokens); this one has {prompt_length}.", param="echo",
                       code="context_length_exceeded")
    budget = settings.default_max_tokens if budget is None else budget
    return GenerationParams(max_new_tokens=min(budget, max_length - prompt_length), temperature=body.temperature,
                            top_p=body.top_p, top_k=max(body.top_k, 0), stop=list(body.stop), seed=body.seed,
                            logprobs=body.top_logprobs_wanted, echo=echo)


def _requested_drafter(body: schema.SamplingRequest, worker: ModelWorker) -> str | None:
    """The request's ``drafter`` field in its one spelling (None: absent, the server's default); a 400 naming the
    field and the drafters this model can run for a value it cannot run."""
    if body.drafter is None:
        return None
    try:
        return worker.check_drafter(body.drafter)
    except ValueError as err:
        raise APIError(400, f"drafter: {err}", param="drafter", code="invalid_drafter") from None


async def _answer(request: Request, body: schema.SamplingRequest, prompt_ids: list[int], budget: int | None,
                  chat: bool, model, worker: ModelWorker, settings: ServerSettings):
    params = _params(body, budget, len(prompt_ids), worker.max_length, settings)
    params.drafter = _requested_drafter(body, worker)
    channel = _Channel(_mailbox(request.app.state))
    job = Job(prompt_ids=prompt_ids, params=params, deliver=channel.deliver,
                            text=TextStream(model.tokenizer, params.stop))
    worker.submit(job)  # 429 when the queue is full, before any answer starts
    answer = _Answer(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, settings.served_model_name,
                     int(time.time()), chat, len(prompt_ids))
    if params.logprobs is not None:
        answer.logprobs = LogprobWriter(model.tokenizer, chat)
    if params.echo:
        answer.echo, answer.first_token = _echo_text(model.tokenizer, body.prompt, prompt_ids), prompt_ids[0]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_stream(answer, job, channel, worker, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return await _collect(request, answer, job, channel, worker)


@dataclass
class _Answer:
    """One answer's identity and how its objects are written: ``logprobs`` writes its log-probabilities (None: not
    asked for), ``echo`` is the prompt's text, sent first (completions with ``echo``)."""

    id: str
    model: str
    created: int
    chat: bool
    prompt_tokens: int
    logprobs: LogprobWriter | None = None
    echo: str | None = None
    first_token: int = 0

    def usage(self, update: Update) -> dict:
        return schema.usage(self.prompt_tokens, update.completion_tokens)

    def eagle(self, update: Update) -> dict:
        return schema.eagle_stats(update.drafter, update.steps, update.accepted, update.completion_tokens)

    def text_of(self, update: Update) -> str:
        """The text ``update`` adds: the prompt's for the echo update."""
        return (self.echo or "") if update.echo else update.text

    def logprobs_of(self, update: Update) -> dict | None:
        """The logprobs of ``update``'s tokens (the prompt's for the echo update), or None."""
        if self.logprobs is None:
            return None
        if update.echo and update.prompt_logprobs is not None:
            part = self.logprobs.part(with_first_token(self.first_token, update.prompt_logprobs), unscored_first=True)
        elif update.logprobs is not None and not update.echo:
            part = self.logprobs.part(update.logprobs)
        else:
            return None
        return part

    def whole(self, text: str, update: Update, logprob_parts: list[dict]) -> dict:
        """The whole answer: ``text``, and ``logprob_parts`` (:meth:`logprobs_of` of every update) merged."""
        logprobs = None if self.logprobs is None else _merged(logprob_parts, self.chat)
        if self.chat:
            return schema.chat_completion(self.id, self.model, text, update.finish_reason, self.usage(update),
                                          self.eagle(update), self.created, logprobs)
        return schema.completion(self.id, self.model, text, update.finish_reason, self.created, self.usage(update),
                                 self.eagle(update), logprobs)

    def chunk(self, text: str | None, finish_reason: str | None = None, update: Update | None = None,
              with_usage: bool = False, role: bool = False, logprobs: dict | None = None) -> dict:
        usage_ = self.usage(update) if with_usage else None
        eagle = self.eagle(update) if update is not None else None
        if not self.chat:
            return schema.completion(self.id, self.model, text, finish_reason, self.created, usage_, eagle, logprobs)
        delta = None if text is None else ({"role": "assistant", "content": text} if role else {"content": text})
        return schema.chat_chunk(self.id, self.model, self.created, delta, finish_reason, usage_, eagle, logprobs)


def _merged(parts: list[dict], chat: bool) -> dict:
    """Logprob parts (:meth:`_Answer.logprobs_of`) as one: their lists joined, field by field."""
    fields = ("content",) if chat else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {name: [entry for part in parts for entry in part[name]] for name in fields}


def _echo_text(tokenizer, prompt: str | list[int], prompt_ids: list[int]) -> str:
    """The text ``echo`` repeats: the prompt as sent, or the decoded ids of a prompt sent as token ids."""
    return prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids, skip_special_tokens=False)


async def _collect(request: Request, answer: _Answer, job: Job, channel: _Channel,
                   worker: ModelWorker):
    """Wait for the whole answer; cancel it if the client goes away meanwhile."""
    parts, logprob_parts = [], []
    try:
        while True:
            try:
                update = await asyncio.wait_for(channel.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    logger.info("client of %s went away; request cancelled", answer.id)
                    return JSONResponse({}, status_code=499)
                continue
            if update.error is not None:
                raise update.error
            parts.append(answer.text_of(update))
            logprobs = answer.logprobs_of(update)
            if logprobs is not None:
                logprob_parts.append(logprobs)
            if update.final:
                return answer.whole("".join(parts), update, logprob_parts)
    finally:
        if not job.done:
            worker.cancel(job)


async def _stream(answer: _Answer, job: Job, channel: _Channel, worker: ModelWorker,
                  include_usage: bool):
    """Server-sent events: a first chunk (the role), text deltas, a last chunk with the finish reason, the usage
    chunk when asked for, then ``[DONE]``. A client that goes away cancels the generation."""
    try:
        yield schema.sse(answer.chunk("", role=True))
        while True:
            update = await channel.queue.get()
            if update.error is not None:
                yield schema.sse(update.error.body())
                break
            text, logprobs = answer.text_of(update), answer.logprobs_of(update)
            if (text or logprobs) and not update.final:
                yield schema.sse(answer.chunk(text, logprobs=logprobs))
            if update.final:
                yield schema.sse(answer.chunk(text, update.finish_reason, update, logprobs=logprobs))
                if include_usage:
                    yield schema.sse(answer.chunk(None, update=update, with_usage=True))
                break
        yield schema.sse("[DONE]")
    finally:
        if not job.done:
            logger.info("client of %s went away; request cancelled", answer.id)
            worker.cancel(job)
