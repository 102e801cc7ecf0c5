"""The engine of one model: its target, the preallocated cache, the drafters and the running batches.

``EaModel`` is the reference API over it; the serving worker drives its :class:`ContinuousBatch`. A request flows one
way: checked once into a :class:`~eagle.model.engine.request.GenerationRequest` (:meth:`Engine.request`), run by the
one loop (:class:`~eagle.model.engine.loop.RunningBatch`), emitted as :class:`~eagle.model.engine.steps.RowStep` s.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

from eagle.model.drafting.protocol import DraftContext, Drafter
from eagle.model.drafting.registry import HEAD, NONE, build_drafter, check_drafter, head_spec, runnable_drafters
from eagle.model.drafting.settings import TreePlan
from eagle.model.drafting.suffix import SuffixStore
from eagle.model.engine.logprobs import TokenLogprobs, check_top, prompt_logprobs
from eagle.model.engine.loop import RunningBatch
from eagle.model.engine.request import GenerationRequest, build_request
from eagle.model.engine.steps import BatchStep, RowStep
from eagle.model.engine.stops import pad_token_id, stop_token_ids, token_id_set
from eagle.model.base.kv_cache import TreeKVCache, check_cache_fits
from eagle.model.base.target import Target
from eagle.utils.threads import ThreadPolicy

logger = logging.getLogger(__name__)


class Engine:
    """Generation for ``base_model`` with its draft ``head`` (None: plain decoding only). ``plan``: the trees the
    head drafts (replace it to change them); ``feature_layers``: what the head reads from the target (see
    :class:`~eagle.model.base.target.Target`); ``allow_unknown_attention``: serve a model whose attention the
    tree masks may not express (:mod:`eagle.model.base.families`) instead of refusing it. ``thread_policy``: for
    a model on the CPU, a :class:`~eagle.utils.threads.ThreadPolicy` that the generation loop consults around each
    verification step (``engine.thread_policy``, replaceable; None: torch's thread count is left alone). Elsewhere
    the CPU threads do not carry the step, and there is none."""

    def __init__(self, base_model, head, tokenizer, plan: TreePlan, feature_layers: list[int] | None,
                 allow_unknown_attention: bool = False, thread_policy: bool = False, drafter: str | None = None):
        self.base_model, self.head, self.tokenizer = base_model, head, tokenizer
        self.set_drafter(drafter)  # default_drafter; None: the head's own
        self.target = Target(base_model, feature_layers, allow_unknown_attention)
        self.plan = plan
        self.vocab_size = base_model.get_output_embeddings().weight.shape[0]
        self.cache: TreeKVCache | None = None
        self.suffix_store = SuffixStore()  # earlier outputs, which this model's suffix drafters match against
        self.thread_policy = ThreadPolicy() if thread_policy and self.device.type == "cpu" else None

    @property
    def device(self) -> torch.device:
        return self.target.device

    # ------------------------------------------------------------------------------------------------ requests
    def stop_token_ids(self, is_llama3: bool = False) -> set[int]:
        return stop_token_ids(self.base_model, self.tokenizer, is_llama3)

    def request(self, input_ids, attention_mask=None, *, is_llama3: bool = False, stop_ids=None,
                pad_token_id: int | None = None, **settings) -> GenerationRequest:
        """Check a call's prompts and settings (``ValueError`` / ``TypeError`` before anything runs). ``settings``:
        ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``, ``max_length``, ``drafter``, ``generator``;
        ``stop_ids`` replace the model's stop tokens, ``pad_token_id`` the filler of rows that end early."""
        stop_ids = self.stop_token_ids(is_llama3) if stop_ids is None else token_id_set(stop_ids)
        if pad_token_id is None:
            pad_token_id = self._pad_token_id(stop_ids)
        settings["drafter"] = self.drafter_spec(settings.get("drafter"))  # checked before anything runs
        return build_request(input_ids, attention_mask, vocab_size=self.vocab_size, device=self.device,
                             stop_token_ids=stop_ids, pad_token_id=pad_token_id, **settings)

    def _pad_token_id(self, stop_ids) -> int:
        return pad_token_id(self.base_model, self.tokenizer, self.vocab_size, stop_ids)

    # ------------------------------------------------------------------------------------------------ drafters
    def drafter_spec(self, kind: str | None) -> str:
        """The registry spec of ``kind`` in its one spelling, checked against the head (a ``ValueError`` saying
        why and what would run, see :func:`~eagle.model.drafting.registry.check_drafter`). None: the default,
        ``default_drafter`` where one is set, else the head's own, else ``"none"``; ``"head"`` (EAGLE): the default
        where one is set, else the head's own, ``"eagle3"`` / ``"eagle1"`` with ``+lookup`` when some tree of the
        plan grafts lookup chains."""
        if kind in (None, HEAD) and self.default_drafter is not None:
            return self.default_drafter
        if kind is None:
            kind = NONE if self.head is None else HEAD
        if kind != HEAD:
            return check_drafter(kind, self.head)
        if self.head is None:
            raise ValueError("This model has no draft head (loaded without an EAGLE head), so EAGLE generation "
                             f"cannot run; it can run: {', '.join(runnable_drafters(None))} (use_eagle=False or "
                             "drafter='none' is plain decoding).")
        return head_spec(self.head, self.plan)

    def set_drafter(self, spec: str | None) -> None:
        """Make ``spec`` the default drafter (checked against the head); None: the head's own again."""
        self.default_drafter = None if spec is None else check_drafter(spec, self.head)

    def drafter(self, kind: str | None) -> Drafter:
        """A new drafter of ``kind`` (see :meth:`drafter_spec`) for this model."""
        return build_drafter(self.drafter_spec(kind), DraftContext(self.head, self.plan, self.suffix_store))

    # ------------------------------------------------------------------------------------------------ generation
    def run(self, request: GenerationRequest) -> Iterator[BatchStep]:
        """The generation loop over ``request``: one :class:`~eagle.model.engine.steps.BatchStep` per target
        forward pass (a row that has finished keeps its finish reason, with no tokens)."""
        if max(request.budgets) <= 0:
            return iter(())
        drafter = self.drafter(request.drafter)
        capacity = max(request.lengths) + max(request.budgets) + drafter.max_nodes(request.batch_size)
        running = RunningBatch(self.target, drafter, self.reserve_cache(request.batch_size, capacity, fresh=True),
                               request.sampler(), set(request.stop_token_ids), self.thread_policy)
        running.add(list(request.prompts), list(request.budgets))
        return _batch_steps(running, request.batch_size, request.input_ids.new_zeros(0))

    def open_batch(self, *, drafter: str | None = HEAD, temperature=0.0, top_p=0.0, top_k=0, max_length=2048,
                   is_llama3=False, generator: torch.Generator | None = None, stop_ids=None) -> "ContinuousBatch":
        """A running batch that prompts join and leave between steps, with one set of sampling settings."""
        stop_ids = self.stop_token_ids(is_llama3) if stop_ids is None else token_id_set(stop_ids)
        settings = dict(temperature=temperature, top_p=top_p, top_k=top_k, max_length=max_length,
                        drafter=self.drafter_spec(drafter), generator=generator)
        return ContinuousBatch(self, settings, stop_ids)

    def prompt_logprobs(self, prompt, top: int = 0, temperature: float = 0.0) -> TokenLogprobs:
        """The log-probabilities of ``prompt`` (S,)'s tokens 1..S-1, each after the tokens before it, with ``top``
        alternatives each (see :mod:`~eagle.model.engine.logprobs`): one forward pass over the prompt in a cache of
        its own, so a running batch is left as it was."""
        ids = torch.as_tensor(prompt, dtype=torch.long).flatten()
        if ids.numel() == 0:
            raise ValueError("The prompt is empty: prompt_logprobs needs at least one token.")
        check_cache_fits(self.target.slot_bytes(), 1, ids.numel(), self.device)
        return prompt_logprobs(self.target, ids, check_top(top), temperature)

    # ------------------------------------------------------------------------------------------------ the cache
    def reserve_cache(self, batch_size: int, capacity: int, fresh: bool) -> TreeKVCache:
        """The shared cache, with room for ``batch_size`` rows of ``capacity`` slots (checked against the free
        memory first: a ``ValueError`` when it would not fit). ``fresh``: a generation starts, a cache too small is
        replaced; else (rows join a running batch) it grows in place, keeping its rows."""
        slot_bytes = self.target.slot_bytes()
        if self.cache is None or self.cache.capacity < capacity:
            check_cache_fits(slot_bytes, batch_size, capacity, self.device)
            if self.cache is None or fresh:
                self.cache = None  # free the old one first
                self.cache = self.target.new_cache(capacity)  # grown for this call; reused by later ones
            else:
                self.cache.grow(capacity)
        elif self.cache.batch_size != batch_size:  # reallocated for this batch size when first written
            check_cache_fits(slot_bytes, batch_size, self.cache.capacity, self.device)
        return self.cache


def _batch_steps(running: RunningBatch, batch: int, empty: torch.Tensor) -> Iterator[BatchStep]:
    """The running batch's updates as steps of all ``batch`` rows, in row order."""
    ended: list[str | None] = [None] * batch
    for update in running:
        rows = [RowStep(empty, 0, reason) for reason in ended]
        for row, part in update.items():
            rows[row] = part
            ended[row] = part.finish_reason
        yield BatchStep(rows)


class ContinuousBatch:
    """A running batch of an :class:`Engine` (``EaModel.continuous_batch``): the engine's
    :class:`~eagle.model.engine.loop.RunningBatch`, each prompt checked as every generation method checks it.

    - ``add(input_ids, attention_mask=None, max_new_tokens=512, logprobs=None) -> list[int]``: one prompt (S,) or
      (1, S), a left-padded batch or a list of prompts, each with its own budget; returns their row numbers. With
      ``logprobs`` (0 to 20 alternatives per token) their steps carry the tokens' log-probabilities. Checked at
      once (``ValueError``; the cache grows if it must, refused when it would not fit in memory); the rows join at
      the next step boundary (prefilled together, then verified with the others).
    - ``cancel(row)``: the row leaves at the next step boundary (a client that went away); that step reports it
      with ``finish_reason="cancelled"``.
    - Iterating yields, after each target forward pass, a dict {row: :class:`~eagle.model.engine.steps.RowStep`}.
      Each row's greedy tokens are those of its prompt alone; sampled rows follow the target distribution.
      Iteration ends when no row generates or waits; ``close()`` abandons it.
    """

    def __init__(self, engine: Engine, settings: dict, stop_ids: set[int]):
        self.engine, self.settings, self.stop_ids = engine, settings, stop_ids
        self._running: RunningBatch | None = None
        self._capacity = 0

    def add(self, input_ids, attention_mask=None, max_new_tokens: int = 512, logprobs: int | None = None) -> list[int]:
        if logprobs is not None:
            check_top(logprobs)
        request = self.engine.request(input_ids, attention_mask, max_new_tokens=max_new_tokens,
                                      stop_ids=self.stop_ids, **self.settings)
        rows = request.batch_size + (self._running.size if self._running is not None else 0)
        drafter = self._running.drafter if self._running is not None else self.engine.drafter(request.drafter)
        self._capacity = max(self._capacity, max(request.lengths) + max(request.budgets) + drafter.max_nodes(rows))
        cache = self.engine.reserve_cache(rows, self._capacity, fresh=self._running is None)
        if self._running is None:
            self._running = RunningBatch(self.engine.target, drafter, cache, request.sampler(), set(self.stop_ids),
                                         self.engine.thread_policy)
        return self._running.add(list(request.prompts), list(request.budgets), [logprobs] * request.batch_size)

    def cancel(self, row: int) -> None:
        if self._running is not None:
            self._running.cancel(row)

    @property
    def size(self) -> int:
        """Rows generating or waiting to join."""
        return 0 if self._running is None else self._running.size

    def __iter__(self) -> Iterator[dict[int, RowStep]]:
        return iter(self._running) if self._running is not None else iter(())

    def close(self) -> None:
        if self._running is not None:
            self._running.close()


__all__ = ["Engine", "ContinuousBatch", "HEAD"]
