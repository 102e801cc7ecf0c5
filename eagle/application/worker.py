"""The serving worker: one thread owns the model and runs every generation the HTTP server and the web UI ask for.

Jobs wait in a bounded queue (:meth:`ModelWorker.submit` refuses with a 429 :class:`APIError` when it is full).
The worker starts a batch with the oldest waiting job and the waiting jobs that can share its generation (greedy
ones together; sampled ones with the same temperature / top-p / top-k and no seed; the same drafter), up to
``max_batch_size``, and runs it through the engine's running batch (``EaModel.continuous_batch``), handing each job
an :class:`Update` after every step it took part in.

Continuous batching: at every step boundary, jobs that wait join the running batch (from the oldest, while they can
share its generation, up to ``max_batch_size`` rows; a seeded job runs alone, with its own random generator), and
rows whose job ended leave it: each job ends at its own stop token or budget (the engine's ``finish_reason``), a
stop string, or cancellation (a client that went away, a closed web UI stream), so its place is freed at once. A
batch keeps its drafter (a spec of :mod:`eagle.model.drafting.registry`: the job's own ``drafter``, else the
worker's policy, see ``eagle_max_batch_size``); when the load calls for another drafter, or the oldest waiting job
needs another kind of batch, the running batch takes no one until it ends, and the next one starts.

The worker thread owns its OpenMP pool: :meth:`ModelWorker.start` frees the starting thread's pool (the model was
loaded there) and the worker frees its own whenever a batch ends (see :mod:`eagle.utils.openmp`).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..model.drafting.registry import HEAD, NONE
from ..model.engine.greedy import GREEDY_TEMPERATURE
from ..model.engine.logprobs import TokenLogprobs
from ..utils.openmp import release_openmp_threads
from .metrics import Metrics
from .openai_schema import APIError
from .text_stream import TextStream

logger = logging.getLogger(__name__)

@dataclass
class GenerationParams:
    """What one job asks for. ``top_p`` / ``top_k`` of 0 mean off; ``temperature`` 0 is greedy; ``drafter``: a
    drafter spec the model can run (``"none"``: plain decoding; checked by :meth:`ModelWorker.check_drafter`),
    None for the worker's policy; ``logprobs``: the generated tokens' log-probabilities with that many alternatives
    each (None: not computed); ``echo``: the job's first update is the prompt's (with its logprobs when ``logprobs``
    is set); ``max_new_tokens`` 0 (with ``echo``) generates nothing."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    stop: Sequence[str] = ()
    seed: int | None = None
    drafter: str | None = None
    logprobs: int | None = None
    echo: bool = False


@dataclass
class Update:
    """Sent to a job after each step it took part in: the step's ``new_tokens`` (ids), how many of them were
    accepted drafts (``step_accepted``), the model's ``step_seconds``, and the new ``text`` (when the job decodes
    text); at the end ``finish_reason`` ("stop" or "length") or ``error``, with the job's final counts.
    ``logprobs``: the new tokens' log-probabilities when the job asked for them; ``echo``: this update is the
    prompt's (first, before any step), with ``prompt_logprobs`` (its tokens 1..S-1) when the job asked for
    logprobs."""

    text: str = ""
    new_tokens: list[int] = field(default_factory=list)
    step_accepted: int = 0
    step_seconds: float = 0.0
    finish_reason: str | None = None
    error: APIError | None = None
    completion_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    drafter: str = NONE
    logprobs: TokenLogprobs | None = None
    echo: bool = False
    prompt_logprobs: TokenLogprobs | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class Job:
    """One queued generation. ``deliver`` is called from the worker thread with each :class:`Update`; ``text``
    decodes the tokens and watches stop strings (None: the consumer decodes ``new_tokens`` itself)."""

    prompt_ids: list[int]
    params: GenerationParams
    deliver: Callable[[Update], None]
    text: TextStream | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    completion_tokens: int = 0
    steps: int = 0
    accepted: int = 0
    done: bool = False
    drafter: str = NONE  # the drafter spec it was generated with (set when its batch starts)
    _finishing: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def finish(self, reason: str | None = None, error: APIError | None = None, text: str = "",
               last: Update | None = None) -> bool:
        """Deliver the final update (``last``, or one made of ``reason``, ``error`` and ``text``), once: False when
        the job had ended already (the worker and :meth:`ModelWorker.close` may both end it)."""
        with self._finishing:
            if self.done:
                return False
            self.done = True
        last = last or Update(text=text, drafter=self.drafter)
        last.finish_reason, last.error = reason, error
        last.completion_tokens, last.steps, last.accepted = self.completion_tokens, self.steps, self.accepted
        self.deliver(last)
        return True


def position_limit(model) -> int | None:
    """The most positions ``model`` (an ``EaModel`` or its base model) takes, from its config; None if unknown."""
    config = getattr(getattr(model, "base_model", None), "config", None) or getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None


def batch_key(params: GenerationParams) -> tuple | None:
    """Jobs with the same key may be generated in one batch; None: this one runs alone (a seeded sampler)."""
    if params.temperature <= GREEDY_TEMPERATURE:
        return ("greedy", params.drafter)
    if params.seed is not None:
        return None
    return ("sample", params.drafter, params.temperature, params.top_p, params.top_k)


class ModelWorker:
    """Owns ``model`` (an ``EaModel``, or anything with its ``continuous_batch``, ``check_drafter``,
    ``runnable_drafters``, ``stop_token_ids`` and ``device``, and ``engine.prompt_logprobs`` for jobs that echo
    their prompt with logprobs) in one worker thread; see the module docstring.

    ``max_queue``: jobs that may wait (besides the running batch); ``max_batch_size``: rows of a running batch;
    ``max_length``: prompt plus answer, in tokens (capped by the model's position limit); ``drafter``: the drafter
    spec of jobs that do not say (None: the model's default, ``model.drafter``; ``use_eagle`` is the reference's
    alias); ``is_llama3``: also stop at ``<|eot_id|>``; ``eagle_max_batch_size``: when more jobs than this run or
    wait, batches of jobs that do not say run plain decoding (the same greedy tokens and sampled distribution;
    drafts stop paying in large batches on some devices); 0 = the default drafter at every batch size.
    """

    def __init__(self, model, max_queue: int = 64, max_batch_size: int = 1, max_length: int = 2048,
                 use_eagle: bool | None = None, is_llama3: bool = False, eagle_max_batch_size: int = 0,
                 drafter: str | None = None):
        if max_queue < 1 or max_batch_size < 1:
            raise ValueError(f"max_queue and max_batch_size must be >= 1, got {max_queue} and {max_batch_size}")
        self.model, self.max_queue = model, max_queue
        self.max_length = min(max_length, position_limit(model) or max_length)
        self.max_batch_size = max_batch_size
        self.is_llama3 = is_llama3
        self.eagle_max_batch_size = eagle_max_batch_size  # larger batches decode plainly (0: no limit)
        self.drafter = model.check_drafter(drafter, use_eagle)  # ValueError for one the model cannot run
        self.metrics = Metrics()
        self._waiting: collections.deque[Job] = collections.deque()
        self._running: list[Job] = []
        self._cond = threading.Condition()
        self._closing = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------- client side
    def start(self) -> None:
        """Start the worker thread (once); the calling thread's OpenMP pool is freed: the worker computes now."""
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._work, name="eagle-model-worker", daemon=True)
        release_openmp_threads()
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def close(self, timeout: float = 30.0, message: str = "The server is shutting down.") -> bool:
        """Stop taking jobs, end those waiting or running at once with a 503 saying ``message`` (the running ones are
        cancelled: their rows stop after the step in progress), and wait up to ``timeout`` seconds for the worker;
        whether it has stopped."""
        with self._cond:
            self._closing = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            running = list(self._running)
            self._cond.notify_all()
        for job in waiting + running:
            if job.finish(error=APIError(503, message, type="server_error")):  # before the cancellation, which the
                self.metrics.count("error")  # worker would take for the client's and end without a word
            job.cancelled.set()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def submit(self, job: Job) -> None:
        """Queue ``job``; :class:`APIError` 429 (with ``Retry-After``) when the queue is full."""
        with self._cond:
            if self._closing:
                raise APIError(503, "The server is shutting down.", type="server_error")
            if len(self._waiting) >= self.max_queue:
                self.metrics.count("rejected")
                raise APIError(429, f"The server is busy: {len(self._waiting)} requests are already waiting "
                               f"(--max-queue {self.max_queue}). Retry later.", type="rate_limit_error",
                               code="queue_full", headers={"Retry-After": "1"})
            self._waiting.append(job)
            self._cond.notify_all()

    def cancel(self, job: Job) -> None:
        """Give up ``job``: out of the queue at once, or stopped after the step in progress."""
        job.cancelled.set()
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.count("cancelled")

    def queue_depth(self) -> int:
        return len(self._waiting)

    def running(self) -> int:
        return len(self._running)

    def render_metrics(self) -> str:
        return self.metrics.render(self.queue_depth(), self.running(), self.drafter)

    def runnable_drafters(self) -> list[str]:
        """The drafter specs a job may ask for (those the model can run)."""
        return self.model.runnable_drafters()

    def check_drafter(self, spec: str) -> str:
        """``spec`` in its one spelling when the model can run it, else a ``ValueError`` saying why and listing the
        drafters it can run."""
        if spec is None or spec == HEAD:  # a name, not the model's internal "head"
            raise ValueError(f"Unknown drafter {spec!r}; this model can run: {', '.join(self.runnable_drafters())}.")
        return self.model.check_drafter(spec)

    # ------------------------------------------------------------------------------------------- worker side
    def _next_batch(self) -> list[Job] | None:
        """The jobs a new batch starts with: the oldest waiting one and those that can share its generation."""
        with self._cond:
            while not self._waiting and not self._closing:
                self._cond.wait()
            if self._closing:
                return None
            first = self._waiting.popleft()
            batch, key = [first], batch_key(first.params)
            if key is not None:
                for job in list(self._waiting):
                    if len(batch) >= self.max_batch_size:
                        break
                    if batch_key(job.params) == key:
                        self._waiting.remove(job)
                        batch.append(job)
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
                release_openmp_threads()  # this thread may wait long for the next job: its pool would spin

    def run_batch(self, batch: list[Job]) -> None:
        """Generate ``batch`` and the jobs that join it to their ends, delivering after each step; an error ends
        the unfinished jobs with a 500 and leaves the worker serving."""
        start = time.perf_counter()
        try:
            self._run_continuous(batch)
        except Exception as err:  # noqa: BLE001 - reported to the clients, logged, and the worker goes on
            logger.exception("generation failed")
            with self._cond:
                members = list(self._running)
            for job in members:
                if job.finish(error=APIError(500, f"Internal error during generation: {err}", type="server_error")):
                    self.metrics.count("error")
        finally:
            with self.metrics.lock:
                self.metrics.busy_seconds += time.perf_counter() - start

    def _run_continuous(self, batch: list[Job]) -> None:
        """One running batch of the engine for ``batch``: each row ends at its stop token, its own budget, a stop
        string or its client's cancellation (the row leaves the engine's batch at the next step); at every step
        boundary waiting jobs of the same kind join it (see :meth:`_joiners`)."""
        params, key = batch[0].params, batch_key(batch[0].params)
        drafter = self._drafter_for(params, len(batch))
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        running = self.model.continuous_batch(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                              max_length=self.max_length, is_llama3=self.is_llama3,
                                              drafter=drafter, generator=generator)
        rows: dict[int, Job] = {}
        for job in batch:
            self._join(running, rows, job, drafter)
        try:
            for update, seconds in self._timed(running, rows):
                for row, part in update.items():
                    job = rows.get(row)
                    if job is None:
                        continue
                    if part.tokens.numel() and not job.done and not job.cancelled.is_set():
                        self._deliver_step(job, part, seconds)
                    if part.finished:
                        del rows[row]
                        self._end(job, part.finish_reason)
                self._boundary(running, rows, key, drafter)
        finally:
            running.close()
        for job in rows.values():  # the engine ended without a reason for them (it should not happen)
            self._end(job, "length")

    def _timed(self, running, rows: dict) -> Iterator[tuple[dict, float]]:
        """The running batch's steps with their seconds, each timed into the metrics as a prefill (the step of
        joining rows: their first tokens) or a decoding step."""
        steps = iter(running)
        while True:
            start = time.perf_counter()
            update = next(steps, None)
            if update is None:
                return
            seconds = time.perf_counter() - start
            joined = all(rows[row].steps == 0 for row in update if row in rows)
            self.metrics.record_time(seconds, prefill=joined)
            yield update, seconds

    def _join(self, running, rows: dict, job: Job, drafter: str) -> None:
        """Add ``job`` to the engine's running batch (it joins at the next step)."""
        if job.done or job.cancelled.is_set():
            if not job.done:
                self.metrics.count("cancelled")
                job.done = True
            return
        job.drafter = drafter
        try:
            if job.params.echo:
                self._echo(job)
            if job.params.max_new_tokens == 0:
                self._finish(job, "length", Update(drafter=job.drafter))
                return
            extra = {} if job.params.logprobs is None else {"logprobs": job.params.logprobs}
            (row,) = running.add(torch.tensor(job.prompt_ids, dtype=torch.long), max_new_tokens=job.params.max_new_tokens,
                                 **extra)
        except Exception as err:  # noqa: BLE001 - this job fails (a cache that does not fit), the batch goes on
            logger.exception("a request could not join the batch")
            if job.finish(error=APIError(500, f"Internal error: {err}", type="server_error")):
                self.metrics.count("error")
            return
        rows[row] = job

    def _echo(self, job: Job) -> None:
        """The job's prompt update: its tokens' logprobs (one forward pass over the prompt) when it wants them."""
        logprobs = None
        if job.params.logprobs is not None:
            logprobs = self.model.engine.prompt_logprobs(job.prompt_ids, job.params.logprobs, job.params.temperature)
        job.deliver(Update(drafter=job.drafter, echo=True, prompt_logprobs=logprobs))

    def _boundary(self, running, rows: dict, key, drafter: str) -> None:
        """Between two steps: rows whose job ended (stop string) or was cancelled leave; waiting jobs join."""
        for row, job in list(rows.items()):
            if job.done or job.cancelled.is_set():
                running.cancel(row)
                del rows[row]
                self._end(job, None)
        for job in self._joiners(key, drafter, len(rows)):
            self._join(running, rows, job, drafter)
        with self._cond:
            self._running = list(rows.values())
            self.metrics.batch_size = len(rows)

    def _joiners(self, key, drafter: str, active: int) -> list[Job]:
        """Waiting jobs that join a running batch of ``active`` rows: from the oldest, while they can share its
        generation (same :func:`batch_key`; none for a seeded job's batch), up to ``max_batch_size`` rows, and only
        while the load (rows plus waiting jobs) still calls for the batch's drafter. Otherwise the batch takes no
        one, ends with its rows, and the next batch starts with the oldest waiting job, with the drafter it calls
        for."""
        with self._cond:
            if key is None or self._closing or not self._waiting:
                return []
            load = min(active + len(self._waiting), self.max_batch_size)
            if self._drafter_for(self._waiting[0].params, load) != drafter:
                return []
            joining = []
            while self._waiting and active + len(joining) < self.max_batch_size:
                if batch_key(self._waiting[0].params) != key:
                    break
                joining.append(self._waiting.popleft())
            self._running.extend(joining)  # running from now on, for close() to end them too
            return joining

    def _drafter_for(self, params: GenerationParams, rows: int) -> str:
        """The drafter of a batch of ``rows`` jobs like ``params``: the job's own, else the worker's, which turns
        to plain decoding above ``eagle_max_batch_size`` rows."""
        if params.drafter is not None:
            return params.drafter
        limit = self.eagle_max_batch_size
        return self.drafter if limit <= 0 or rows <= limit else NONE

    def _deliver_step(self, job: Job, part, seconds: float) -> None:
        tokens = part.tokens.tolist()
        first = job.steps == 0
        job.steps += 1
        job.completion_tokens += len(tokens)
        if not first:
            job.accepted += int(part.accepted)
        self.metrics.record_step(len(tokens), int(part.accepted), first)
        text = "" if job.text is None else job.text.add(tokens)
        update = Update(text=text, new_tokens=tokens, step_accepted=int(part.accepted), step_seconds=seconds,
                        drafter=job.drafter, logprobs=getattr(part, "logprobs", None))
        if job.text is not None and job.text.stopped:
            self._finish(job, "stop", update)
        else:
            job.deliver(update)

    def _end(self, job: Job, reason: str | None) -> None:
        """After the job's last step: the final text and why it ended (``reason``, the engine's; None when it left
        the batch for another reason), unless already ended or cancelled."""
        if job.cancelled.is_set() and not job.done:
            self.metrics.count("cancelled")
            job.done = True
            return
        if job.done:
            return
        text = "" if job.text is None else job.text.add([], final=True)
        stopped = job.text is not None and job.text.stopped
        self._finish(job, "stop" if stopped else (reason or "length"), Update(text=text, drafter=job.drafter))

    def _finish(self, job: Job, reason: str, last: Update) -> None:
        """End ``job`` with ``reason``: its last update carries the reason and the final counts."""
        if job.finish(reason, last=last):
            with self.metrics.lock:
                self.metrics.prompt_tokens += len(job.prompt_ids)
            self.metrics.count("ok")

    def warm_up(self, drafter: str | None = None) -> None:
        """One short generation through the worker, so that the first client does not wait for lazy
        initialisation (the worker must be started)."""
        tokenizer = self.model.tokenizer
        ids = tokenizer("Hello", add_special_tokens=True)["input_ids"]
        done = threading.Event()
        self.submit(Job(list(ids), GenerationParams(max_new_tokens=8, drafter=drafter),
                        deliver=lambda update: update.final and done.set()))
        done.wait()
