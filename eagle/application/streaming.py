"""Streaming one chat answer (with any drafter the model can run: ``"none"`` is plain decoding), with live speed
figures.

:class:`ChatRunner` is the only thing the web UI calls to reach the model. It builds and checks prompts, and streams
:class:`ReplyProgress` snapshots of a job it submits to the serving worker
(:class:`~eagle.application.worker.ModelWorker`), which owns the model, as it does for the HTTP server. A stream that
is closed before its answer ends (a stopped browser request) cancels its job; several streams at once are
batched by the worker.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from ..model.drafting.registry import NONE
from .highlight import draft_flags, draft_segments, render_highlighted
from .prompts import ModelType, Prompt, Turn, build_prompt, get_model_type
from .worker import GenerationParams, Job, ModelWorker, position_limit

logger = logging.getLogger(__name__)

DEFAULT_MAX_LENGTH = 2048


class PromptError(ValueError):
    """A message that cannot be answered as it is (empty, or too long for the context); the text says why."""


@dataclass
class ReplyProgress:
    """A snapshot of one answer being generated.

    ``drafter``: the drafter spec generating it (``"none"``: plain decoding); ``token_ids``: generated ids so far;
    ``step_sizes``: tokens added by each target forward pass (the prefill first); ``seconds``: time spent inside
    the model only; ``finished``: generation ended (stop token, token budget or context end); ``interrupted``: it
    ended before that (the worker closed or failed: ``error`` says why).
    """

    drafter: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    step_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    finished: bool = False
    interrupted: bool = False
    error: str | None = None
    #: decoded prefixes at highlight boundaries, reused while the answer grows (see ``draft_segments``)
    prefix_cache: dict[int, str] = field(default_factory=dict, repr=False)

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def steps(self) -> int:
        """Target forward passes, prefill included."""
        return len(self.step_sizes)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Generated tokens per target forward pass (the reference's "compression ratio"); 1.0 for plain decoding."""
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def mean_accepted(self) -> float:
        """Accepted draft tokens per verification step (the prefill is not a verification step)."""
        verify_steps = self.step_sizes[1:]
        return sum(size - 1 for size in verify_steps) / len(verify_steps) if verify_steps else 0.0

    def draft_flags(self) -> list[bool]:
        """One flag per generated token: True for accepted draft tokens (always False in plain decoding)."""
        if self.drafter == NONE:
            return [False] * self.new_tokens
        return draft_flags(self.step_sizes)


class ChatRunner:
    """Prompts and streamed answers for the model a serving ``worker`` owns.

    ``worker``: a :class:`~eagle.application.worker.ModelWorker` (started at the first answer if it is not);
    ``model_type``: see :mod:`eagle.application.prompts` (``None`` = the tokenizer's chat template);
    ``max_length``: prompt plus answer, in tokens (capped by the model's position limit).
    """

    def __init__(self, worker: ModelWorker, model_type: str | None = None, max_length: int = DEFAULT_MAX_LENGTH):
        if not isinstance(worker, ModelWorker):
            raise TypeError(f"ChatRunner needs the serving worker that owns the model (eagle.application.worker."
                            f"ModelWorker), got {type(worker).__name__}.")
        self.worker, self.model = worker, worker.model
        self.tokenizer = self.model.tokenizer
        self.model_type: ModelType = get_model_type(model_type)
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
        self.max_length = min(max_length, position_limit(self.model) or max_length)
        # Fail now, not at the first message, if the template cannot work with this tokenizer.
        build_prompt(self.tokenizer, [], "Hello", self.model_type)

    def prompt(self, history: Sequence[Turn], message: str) -> Prompt:
        """The prompt answering ``message`` after ``history``; :class:`PromptError` if it is empty or too long."""
        if not message or not message.strip():
            raise PromptError("The message is empty: type something to send.")
        prompt = build_prompt(self.tokenizer, history, message, self.model_type)
        if len(prompt.input_ids) >= self.max_length:
            raise PromptError(
                f"The conversation is {len(prompt.input_ids)} tokens long, but this model's context holds "
                f"{self.max_length} tokens including the answer. Send a shorter message or clear the chat."
            )
        return prompt

    def drafters(self) -> list[str]:
        """The drafter specs an answer may use (those the model can run), the worker's default first."""
        default = self.worker.drafter
        return [default, *(spec for spec in self.worker.runnable_drafters() if spec != default)]

    def stream(self, prompt: Prompt | Sequence[int], drafter: str | None = None, temperature: float = 0.0,
               top_p: float = 0.0, top_k: int = 0, max_new_tokens: int = 512) -> Iterator[ReplyProgress]:
        """Generate an answer, yielding a :class:`ReplyProgress` after every target forward pass.

        ``drafter``: a drafter spec the model can run (``"eagle3"``, ``"none"`` for plain decoding...; None: the
        worker's default; ``ValueError`` listing the runnable ones otherwise). The last snapshot has ``finished``
        (or ``interrupted``) set. The same object is yielded each time, updated in place. Closing the stream early
        cancels the job."""
        drafter = self.worker.drafter if drafter is None else self.worker.check_drafter(drafter)
        ids = prompt.input_ids if isinstance(prompt, Prompt) else list(prompt)
        budget = max(0, min(int(max_new_tokens), self.max_length - len(ids)))
        params = GenerationParams(max_new_tokens=budget, temperature=float(temperature), top_p=float(top_p),
                                  top_k=int(top_k), drafter=drafter)
        updates: queue.SimpleQueue = queue.SimpleQueue()
        job = Job(list(ids), params, deliver=updates.put)
        progress = ReplyProgress(drafter=drafter)
        self.worker.start()
        self.worker.submit(job)
        try:
            while True:
                update = updates.get()
                self._apply(update, progress)
                yield progress
                if update.final:
                    return
        finally:
            if not job.done:
                self.worker.cancel(job)

    def _apply(self, update, progress: ReplyProgress) -> None:
        """Fold one of the worker's updates into ``progress``."""
        progress.seconds += update.step_seconds
        if update.new_tokens:
            progress.token_ids += update.new_tokens
            progress.step_sizes.append(len(update.new_tokens))
        if update.error is not None:
            progress.interrupted, progress.error = True, update.error.message
            logger.warning("the answer was interrupted: %s", update.error.message)
        elif update.final:
            progress.finished = True
            progress.text = self.tokenizer.decode(progress.token_ids, skip_special_tokens=True)
            return
        # A character split over tokens decodes as U+FFFD until its last token arrives: hold it back.
        progress.text = self.tokenizer.decode(progress.token_ids, skip_special_tokens=True).rstrip("\ufffd")

    def segments(self, progress: ReplyProgress) -> list[tuple[str, bool]]:
        """``(text, is_accepted_draft)`` runs of the answer so far."""
        return draft_segments(self.tokenizer, progress.token_ids, progress.draft_flags(),
                              progress.prefix_cache)

    def render(self, progress: ReplyProgress, highlight: bool) -> str:
        """The answer as chat Markdown, draft tokens marked when ``highlight``."""
        if highlight and progress.drafter != NONE:
            segments = self.segments(progress)
            if segments and not progress.finished:  # hold back a half-decoded character, as in progress.text
                segments[-1] = (segments[-1][0].rstrip("\ufffd"), segments[-1][1])
            return render_highlighted(segments)
        return render_highlighted([(progress.text, False)])
