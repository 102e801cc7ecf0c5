"""The server's model worker: one thread owns the model and runs the queued requests.

Requests wait in a bounded queue (:meth:`Scheduler.submit` refuses with a 429 :class:`APIError` when it is full).
The worker starts a batch with the oldest waiting request and the waiting requests that can share its generation
(greedy ones together; sampled ones with the same temperature / top-p / top-k and no seed), up to
``max_batch_size``, and runs it through the engine's running batch (``EaModel.continuous_batch``), handing each
request its new text through its ``deliver`` callback after every step.

Continuous batching: at every step boundary, requests that wait join the running batch (from the oldest, while
they can share its generation, up to ``max_batch_size`` rows; a seeded request runs alone, with its own random
generator), and rows whose request ended leave it: each request ends at its own stop token, budget
(``max_tokens``), stop string or cancellation (a client that went away), so its place is freed at once. A batch
keeps its mode (EAGLE or plain decoding, see ``eagle_max_batch_size``); when the load calls for the other mode, or
the oldest waiting request needs another kind of batch, the running batch takes no one until it ends, and the next
one starts. With an engine that generates one sequence at a time (``generate_steps`` only), every batch holds one
request.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from eagle.model.engine.steps import Step
from .openai_schema import APIError
from .text_stream import TextStream

logger = logging.getLogger(__name__)

EAGLE, PLAIN = "eagle", "plain"


@dataclass
class GenerationParams:
    """What one request asks for. ``top_p`` / ``top_k`` of 0 mean off; ``temperature`` 0 is greedy."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    stop: Sequence[str] = ()
    seed: int | None = None


@dataclass
class Update:
    """Sent to a request after each step: new ``text``; at the end ``finish_reason`` ("stop" or "length") or
    ``error``, and the request's final counts."""

    text: str = ""
    finish_reason: str | None = None
    error: APIError | None = None
    completion_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    mode: str = EAGLE

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class GenerationRequest:
    """One queued generation. ``deliver`` is called from the worker thread with each :class:`Update`."""

    prompt_ids: list[int]
    params: GenerationParams
    deliver: Callable[[Update], None]
    text: TextStream
    cancelled: threading.Event = field(default_factory=threading.Event)
    completion_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    done: bool = False
    mode: str = EAGLE  # how it was generated: EAGLE or PLAIN (set when its batch starts)
    _finishing: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def finish(self, reason: str | None = None, error: APIError | None = None, text: str = "") -> bool:
        """Deliver the final update, once: False when the request had ended already (the worker and
        :meth:`Scheduler.close` may both end it)."""
        with self._finishing:
            if self.done:
                return False
            self.done = True
        self.deliver(Update(text=text, finish_reason=reason, error=error, completion_tokens=self.completion_tokens,
                            steps=self.steps, accepted=self.accepted, mode=self.mode))
        return True


def _batch_key(params: GenerationParams) -> tuple | None:
    """Requests with the same key may be generated in one batch; None: this one runs alone (a seeded sampler)."""
    if params.temperature <= 1e-5:
        return ("greedy",)
    if params.seed is not None:
        return None
    return ("sample", params.temperature, params.top_p, params.top_k)


class Metrics:
    """Counters for ``/metrics`` (Prometheus text format)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = collections.Counter()  # by outcome: ok, error, cancelled, rejected
        self.prompt_tokens = self.generated_tokens = self.steps = self.verify_steps = self.accepted = 0
        self.busy_seconds = 0.0
        # engine steps of a running batch: prefills of joining rows (every running row waits meanwhile), decoding
        self.prefill_seconds = self.decode_seconds = 0.0
        self.batch_size = 0

    def count(self, outcome: str) -> None:
        with self.lock:
            self.requests[outcome] += 1

    def record_step(self, new_tokens: int, accepted: int, first: bool) -> None:
        with self.lock:
            self.generated_tokens += new_tokens
            self.steps += 1
            if not first:
                self.verify_steps += 1
                self.accepted += accepted

    def record_time(self, seconds: float, prefill: bool) -> None:
        with self.lock:
            if prefill:
                self.prefill_seconds += seconds
            else:
                self.decode_seconds += seconds

    def render(self, queue_depth: int, running: int, mode: str) -> str:
        with self.lock:
            rate = self.generated_tokens / self.busy_seconds if self.busy_seconds else 0.0
            mean_accepted = self.accepted / self.verify_steps if self.verify_steps else 0.0
            lines = ["# HELP eagle_requests_total Requests by outcome.", "# TYPE eagle_requests_total counter"]
            lines += [f'eagle_requests_total{{outcome="{k}"}} {self.requests[k]}'
                      for k in ("ok", "error", "cancelled", "rejected")]
            for name, kind, value, text in [
                ("prompt_tokens_total", "counter", self.prompt_tokens, "Prompt tokens of finished requests."),
                ("generated_tokens_total", "counter", self.generated_tokens, "Generated tokens."),
                ("steps_total", "counter", self.steps,
                 "Generation steps per request (prefills included; a batched step counts once per request)."),
                ("busy_seconds_total", "counter", round(self.busy_seconds, 6), "Seconds the model was generating."),
                ("prefill_seconds_total", "counter", round(self.prefill_seconds, 6),
                 "Seconds of prompt prefills (joining requests; the running batch waits meanwhile)."),
                ("decode_seconds_total", "counter", round(self.decode_seconds, 6),
                 "Seconds of decoding steps (draft and verification, or one plain step) of running batches."),
                ("tokens_per_second", "gauge", round(rate, 4), "Generated tokens per busy second."),
                ("mean_accepted_tokens_per_step", "gauge", round(mean_accepted, 4),
                 f"Accepted draft tokens per verification step ({mode} decoding)."),
                ("queue_depth", "gauge", queue_depth, "Requests waiting for the model."),
                ("running_requests", "gauge", running, "Requests being generated."),
                ("batch_size", "gauge", self.batch_size, "Requests in the batch running now."),
            ]:
                lines += [f"# HELP eagle_{name} {text}", f"# TYPE eagle_{name} {kind}", f"eagle_{name} {value}"]
        return "\n".join(lines) + "\n"


class Scheduler:
    """Owns ``model`` (an ``EaModel``) in one worker thread; see the module docstring.

    ``max_queue``: requests that may wait (besides the running batch); ``max_batch_size``: rows of a running
    batch; ``max_length``: prompt plus answer, in tokens; ``use_eagle``: EAGLE or plain
    decoding; ``is_llama3``: also stop at ``<|eot_id|>``; ``eagle_max_batch_size``: when more requests than this
    run or wait, batches run plain decoding (the same greedy tokens and sampled distribution; EAGLE's drafts stop
    paying in large batches on some devices); 0 = EAGLE at every batch size.
    """

    def __init__(self, model, max_queue: int = 64, max_batch_size: int = 1, max_length: int = 2048,
                 use_eagle: bool = True, is_llama3: bool = False, eagle_max_batch_size: int = 0):
        if max_queue < 1 or max_batch_size < 1:
            raise ValueError(f"max_queue and max_batch_size must be >= 1, got {max_queue} and {max_batch_size}")
        self.model, self.max_queue, self.max_length = model, max_queue, max_length
        self.max_batch_size = max_batch_size
        # requests per batch: the engine's batched loop where it has one (see the module docstring)
        self.batch_capacity = max_batch_size if hasattr(model, "continuous_batch") else 1
        self.use_eagle, self.is_llama3 = use_eagle, is_llama3
        self.eagle_max_batch_size = eagle_max_batch_size  # larger batches decode plainly (0: no limit)
        self.mode = EAGLE if use_eagle else PLAIN
        self.metrics = Metrics()
        self._waiting: collections.deque[GenerationRequest] = collections.deque()
        self._running: list[GenerationRequest] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- client side
    def start(self) -> None:
        self._thread = threading.Thread(target=self._work, name="eagle-model-worker", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 30.0, message: str = "The server is shutting down.") -> bool:
        """Stop taking requests, end those waiting or running at once with a 503 saying ``message`` (the running
        ones are cancelled: their rows stop after the step in progress), and wait up to ``timeout`` seconds for
        the worker; whether it has stopped."""
        with self._cond:
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            running = list(self._running)
            self._cond.notify_all()
        for request in waiting + running:
            if request.finish(error=APIError(503, message, type="server_error")):  # before the cancellation, which
                self.metrics.count("error")  # the worker would take for the client's and end without a word
            request.cancelled.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def submit(self, request: GenerationRequest) -> None:
        """Queue ``request``; :class:`APIError` 429 (with ``Retry-After``) when the queue is full."""
        with self._cond:
            if self._closing:
                raise APIError(503, "The server is shutting down.", type="server_error")
            if len(self._waiting) >= self.max_queue:
                self.metrics.count("rejected")
                raise APIError(429, f"The server is busy: {len(self._waiting)} requests are already waiting "
                               f"(--max-queue {self.max_queue}). Retry later.", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": "1"})
            self._waiting.append(request)
            self._cond.notify_all()

    def cancel(self, request: GenerationRequest) -> None:
        """Give up ``request``: out of the queue at once, or stopped after the step in progress."""
        request.cancelled.set()
        with self._cond:
            if request in self._waiting:
                self._waiting.remove(request)
                self.metrics.count("cancelled")

    def queue_depth(self) -> int:
        return len(self._waiting)

    def running(self) -> int:
        return len(self._running)

    def render_metrics(self) -> str:
        return self.metrics.render(self.queue_depth(), self.running(), self.mode)

    # ------------------------------------------------------------------------------------------- worker side
    def _next_batch(self) -> list[GenerationRequest] | None:
        """The requests a new batch starts with: the oldest waiting one and those that can share its generation."""
        with self._cond:
            while not self._waiting and not self._closing:
                self._cond.wait()
            if self._closing:
                return None
            first = self._waiting.popleft()
            batch, key = [first], _batch_key(first.params)
            if key is not None:
                for request in list(self._waiting):
                    if len(batch) >= self.batch_capacity:
                        break
                    if _batch_key(request.params) == key:
                        self._waiting.remove(request)
                        batch.append(request)
            self._running = batch
            self.metrics.batch_size = len(batch)
            return list(batch)

    def _work(self) -> None:
        while (batch := self._next_batch()) is not None:
            try:
                self.run_batch(batch)
            finally:
                with self._cond:
                    self._running = []
                    self.metrics.batch_size = 0

    def run_batch(self, batch: list[GenerationRequest]) -> None:
        """Generate ``batch`` and the requests that join it to their ends, delivering text after each step; an
        error ends the unfinished requests with a 500 and leaves the worker serving."""
        start = time.perf_counter()
        try:
            if hasattr(self.model, "continuous_batch"):
                self._run_continuous(batch)
            else:
                for request, step in self._one_request_steps(batch[0]):
                    self._deliver_step(request, step)
        except Exception as err:  # noqa: BLE001 - reported to the clients, logged, and the worker goes on
            logger.exception("generation failed")
            with self._cond:
                members = list(self._running)
            for request in members:
                if request.finish(error=APIError(500, f"Internal error during generation: {err}",
                                                 type="server_error")):
                    self.metrics.count("error")
        finally:
            with self.metrics.lock:
                self.metrics.busy_seconds += time.perf_counter() - start

    def _run_continuous(self, batch: list[GenerationRequest]) -> None:
        """One running batch of the engine (``EaModel.continuous_batch``) for ``batch``: each row ends at its stop
        token, its own budget, a stop string or its client's cancellation (the row leaves the engine's batch at the
        next step); at every step boundary waiting requests of the same kind join it (see :meth:`_joiners`)."""
        params, key = batch[0].params, _batch_key(batch[0].params)
        use_eagle = self._wants_eagle(len(batch))
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        running = self.model.continuous_batch(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                              max_length=self.max_length, is_llama3=self.is_llama3,
                                              use_eagle=use_eagle, generator=generator)
        rows: dict[int, GenerationRequest] = {}
        for request in batch:
            self._join(running, rows, request, use_eagle)
        try:
            for update in self._timed(running, rows):
                for row, part in update.items():
                    request = rows.get(row)
                    if request is None:
                        continue
                    if part.tokens.numel() and not request.done and not request.cancelled.is_set():
                        self._deliver_step(request, Step(tokens=part.tokens, accepted=part.accepted))
                    if part.finished:
                        del rows[row]
                        self._end(request)
                self._boundary(running, rows, key, use_eagle)
        finally:
            running.close()
        for request in rows.values():  # the engine ended without flagging them (it should not happen)
            self._end(request)

    def _timed(self, running, rows: dict) -> Iterator[dict]:
        """The running batch's steps, each timed into the metrics as a prefill (the step of joining rows: their
        first tokens) or a decoding step."""
        steps = iter(running)
        while True:
            start = time.perf_counter()
            update = next(steps, None)
            if update is None:
                return
            joined = all(rows[row].steps == 0 for row in update if row in rows)
            self.metrics.record_time(time.perf_counter() - start, prefill=joined)
            yield update

    def _join(self, running, rows: dict, request: GenerationRequest, use_eagle: bool) -> None:
        """Add ``request`` to the engine's running batch (it joins at the next step)."""
        if request.done or request.cancelled.is_set():
            if not request.done:
                self.metrics.count("cancelled")
                request.done = True
            return
        try:
            (row,) = running.add(torch.tensor(request.prompt_ids, dtype=torch.long),
                                 max_new_tokens=request.params.max_new_tokens)
        except Exception as err:  # noqa: BLE001 - this request fails (a cache that does not fit), the batch goes on
            logger.exception("a request could not join the batch")
            if request.finish(error=APIError(500, f"Internal error: {err}", type="server_error")):
                self.metrics.count("error")
            return
        request.mode = EAGLE if use_eagle else PLAIN
        rows[row] = request

    def _boundary(self, running, rows: dict, key, use_eagle: bool) -> None:
        """Between two steps: rows whose request ended (stop string) or was cancelled leave; waiting requests
        join."""
        for row, request in list(rows.items()):
            if request.done or request.cancelled.is_set():
                running.cancel(row)
                del rows[row]
                self._end(request)
        for request in self._joiners(key, use_eagle, len(rows)):
            self._join(running, rows, request, use_eagle)
        with self._cond:
            self._running = list(rows.values())
            self.metrics.batch_size = len(rows)

    def _joiners(self, key, use_eagle: bool, active: int) -> list[GenerationRequest]:
        """Waiting requests that join a running batch of ``active`` rows: from the oldest, while they can share its
        generation (same :func:`_batch_key`; none for a seeded request's batch), up to ``max_batch_size`` rows, and
        only while the load (rows plus waiting requests) still calls for the batch's mode (see
        ``eagle_max_batch_size``). Otherwise the batch takes no one, ends with its rows, and the next batch starts
        with the oldest waiting request, in the mode its size calls for."""
        with self._cond:
            if key is None or self._closing or not self._waiting:
                return []
            load = min(active + len(self._waiting), self.batch_capacity)
            if self._wants_eagle(load) != use_eagle:
                return []
            joining = []
            while self._waiting and active + len(joining) < self.batch_capacity:
                if _batch_key(self._waiting[0].params) != key:
                    break
                joining.append(self._waiting.popleft())
            self._running.extend(joining)  # running from now on, for close() to end them too
            return joining

    def _one_request_steps(self, request: GenerationRequest) -> Iterator[tuple[GenerationRequest, object]]:
        """An engine that generates one sequence at a time (``generate_steps`` only): ``(request, Step)`` pairs;
        ends the request (stop token, budget, stop string, cancellation)."""
        if request.cancelled.is_set():
            self.metrics.count("cancelled")
            return
        steps = self._steps_of(request)
        try:
            for step in steps:
                yield request, step
                if request.done or request.cancelled.is_set():
                    break
        finally:
            steps.close()
        self._end(request)

    def _steps_of(self, request: GenerationRequest):
        params = request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        input_ids = torch.tensor([request.prompt_ids], dtype=torch.long)
        use_eagle = self._wants_eagle(1)
        request.mode = EAGLE if use_eagle else PLAIN
        return self.model.generate_steps(input_ids, temperature=params.temperature, top_p=params.top_p,
                                         top_k=params.top_k, max_new_tokens=params.max_new_tokens,
                                         max_length=self.max_length, is_llama3=self.is_llama3,
                                         use_eagle=use_eagle, generator=generator)

    def _wants_eagle(self, rows: int) -> bool:
        """Whether a batch of ``rows`` requests runs EAGLE (else plain decoding)."""
        limit = self.eagle_max_batch_size
        return self.use_eagle and (limit <= 0 or rows <= limit)

    def _deliver_step(self, request: GenerationRequest, step) -> None:
        tokens = step.tokens.tolist()
        first = request.steps == 0
        request.steps += 1
        request.completion_tokens += len(tokens)
        if not first:
            request.accepted += int(step.accepted)
        self.metrics.record_step(len(tokens), int(step.accepted), first)
        text = request.text.add(tokens)
        if request.text.stopped:
            self._finish(request, "stop", text)
        elif text:
            request.deliver(Update(text=text))

    def _end(self, request: GenerationRequest) -> None:
        """After the last step: the final text and why it ended (unless already ended or cancelled)."""
        if request.cancelled.is_set() and not request.done:
            self.metrics.count("cancelled")
            request.done = True
            return
        if request.done:
            return
        text = request.text.add([], final=True)
        stop_ids = self.model.stop_token_ids(self.is_llama3)
        ended_by_stop_token = bool(request.text.token_ids) and request.text.token_ids[-1] in stop_ids
        self._finish(request, "stop" if ended_by_stop_token or request.text.stopped else "length", text)

    def _finish(self, request: GenerationRequest, reason: str, text: str) -> None:
        if request.finish(reason, text=text):
            with self.metrics.lock:
                self.metrics.prompt_tokens += len(request.prompt_ids)
            self.metrics.count("ok")
