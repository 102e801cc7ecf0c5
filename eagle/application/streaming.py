"""Streaming one chat answer from an ``EaModel`` (EAGLE or plain decoding), with live speed figures.

:class:`ChatRunner` is the only thing the web UI calls to touch the model. It builds and checks prompts, and
streams :class:`ReplyProgress` snapshots. The model's KV cache is shared state, so only one generation may
advance at a time: every runner on a model shares one lock, held while the model computes a step (never while a
snapshot is out with the caller), and a newer generation supersedes an older one that was abandoned half way (a
stopped browser request), which then ends without touching the model again. The UI also queues requests, one
at a time.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .highlight import draft_flags, draft_segments, render_highlighted
from .prompts import ModelType, Prompt, Turn, build_prompt, get_model_type

logger = logging.getLogger(__name__)

EAGLE, PLAIN = "eagle", "plain"
DEFAULT_MAX_LENGTH = 2048


class PromptError(ValueError):
    """A message that cannot be answered as it is (empty, or too long for the context); the text says why."""


@dataclass
class ReplyProgress:
    """A snapshot of one answer being generated.

    ``token_ids``: generated ids so far; ``step_sizes``: tokens added by each target forward pass (the prefill
    first); ``seconds``: time spent inside the model only; ``finished``: generation ended (stop token, token
    budget or context end); ``interrupted``: a newer generation took the model over before this one finished.
    """

    mode: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    step_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    finished: bool = False
    interrupted: bool = False
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
        if self.mode != EAGLE:
            return [False] * self.new_tokens
        return draft_flags(self.step_sizes)


class ChatRunner:
    """Prompts and streamed answers for one loaded model.

    ``model``: an ``EaModel`` or anything with ``tokenizer`` and ``generate_steps`` of the same signature, yielding
    the loop's :class:`~eagle.model.generation.Step` objects (their ``tokens``); ``model_type``: see :mod:`eagle.application.prompts` (``None`` = the tokenizer's
    chat template); ``max_length``: prompt plus answer, in tokens (capped by the model's position limit).
    """

    def __init__(self, model, model_type: str | None = None, max_length: int = DEFAULT_MAX_LENGTH):
        self.model = model
        self.tokenizer = model.tokenizer
        self.model_type: ModelType = get_model_type(model_type)
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2 tokens, got {max_length}")
        self.max_length = min(max_length, _position_limit(model) or max_length)
        self._guard = _guard_of(model)
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

    def stream(self, prompt: Prompt | Sequence[int], mode: str = EAGLE, temperature: float = 0.0,
               top_p: float = 0.0, top_k: int = 0, max_new_tokens: int = 512) -> Iterator[ReplyProgress]:
        """Generate an answer, yielding a :class:`ReplyProgress` after every target forward pass.

        ``mode``: ``"eagle"`` (speculative) or ``"plain"`` (``generate_steps(use_eagle=False)``). The last snapshot
        has ``finished`` (or ``interrupted``) set. The same object is yielded each time, updated in place.
        """
        if mode not in (EAGLE, PLAIN):
            raise ValueError(f"unknown decoding mode {mode!r}; expected {EAGLE!r} or {PLAIN!r}")
        ids = prompt.input_ids if isinstance(prompt, Prompt) else list(prompt)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.model.device)
        kwargs = dict(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                      max_new_tokens=int(max_new_tokens), max_length=self.max_length,
                      is_llama3=self.model_type.is_llama3, use_eagle=mode == EAGLE)
        progress = ReplyProgress(mode=mode)
        guard = self._guard
        with guard.lock:
            generation = guard.current = next(guard.counter)
            steps = self.model.generate_steps(input_ids, **kwargs)
        try:
            while True:
                with guard.lock:
                    if guard.current != generation:
                        progress.interrupted = True
                        new_ids = None
                    else:
                        new_ids = self._advance(steps, progress)
                if progress.interrupted:
                    logger.info("a newer generation took over the model; this one stops")
                    yield progress
                    return
                if new_ids is None:
                    progress.finished = True
                    progress.text = self.tokenizer.decode(progress.token_ids, skip_special_tokens=True)
                    yield progress
                    return
                progress.token_ids += new_ids
                progress.step_sizes.append(len(new_ids))
                # A character split over tokens decodes as U+FFFD until its last token arrives: hold it back.
                progress.text = self.tokenizer.decode(progress.token_ids, skip_special_tokens=True).rstrip("\ufffd")
                yield progress
        finally:
            steps.close()

    @staticmethod
    def _advance(steps, progress: ReplyProgress) -> list[int] | None:
        """Run the model one step; the ids it added, or None when generation has ended. Timed."""
        start = time.perf_counter()
        with torch.no_grad():  # grad mode is per thread, and the server may resume us in another one
            step = next(steps, None)
            new_ids = None if step is None else step.tokens.tolist()
        progress.seconds += time.perf_counter() - start
        return new_ids

    def segments(self, progress: ReplyProgress) -> list[tuple[str, bool]]:
        """``(text, is_accepted_draft)`` runs of the answer so far."""
        return draft_segments(self.tokenizer, progress.token_ids, progress.draft_flags(),
                              progress.prefix_cache)

    def render(self, progress: ReplyProgress, highlight: bool) -> str:
        """The answer as chat Markdown, draft tokens marked when ``highlight``."""
        if highlight and progress.mode == EAGLE:
            segments = self.segments(progress)
            if segments and not progress.finished:  # hold back a half-decoded character, as in progress.text
                segments[-1] = (segments[-1][0].rstrip("\ufffd"), segments[-1][1])
            return render_highlighted(segments)
        return render_highlighted([(progress.text, False)])


class _ModelGuard:
    """Per model: the lock held while it computes a step, and which generation owns it now."""

    def __init__(self):
        self.lock = threading.Lock()
        self.counter = itertools.count(1)
        self.current = 0


_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GUARDS_LOCK = threading.Lock()


def _guard_of(model) -> _ModelGuard:
    """The one guard of ``model``, shared by every runner on it (its KV cache is shared too)."""
    with _GUARDS_LOCK:
        if model not in _GUARDS:
            _GUARDS[model] = _ModelGuard()
        return _GUARDS[model]


def _position_limit(model) -> int | None:
    config = getattr(getattr(model, "base_model", None), "config", None) or getattr(model, "config", None)
    if config is None:
        return None
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if isinstance(limit, int) and limit > 0 else None
