"""The one generation loop, for a batch of B sequences that rows join and leave between steps (one sequence is the
batch of one; plain decoding is the same loop with a drafter that proposes nothing).

Each step is four named phases over explicit inputs, handing each other the types of
:mod:`eagle.model.engine.handoffs`::

    drafter.observe(d.features, d.next_tokens, d.valid) # learn what the target just committed (d: DraftInput)
    trees = stack_trees(drafter.propose())              # draft: one tree per row (TreeBatch)
    verified = verify_trees(target, trees, ...)         # verify: one target forward over every row's tree
                                                        #   (Target.verify, or Target.decode for root-only trees)
    accepted = evaluate_batch(trees.trees, verified.logits, sampler)  # evaluate: each row's Accepted path, token
    commit_batch(cache, rows, paths, trees.size)        # commit: keep the accepted KV entries
    step = step_result(trees, accepted, verified.features)  # each row's new tokens, the next DraftInput

Stops and budgets are per row; a row that ends leaves the batch at the next step boundary (its cache and drafter
rows are dropped, see :func:`~eagle.model.engine.commit.drop_finished`), so it costs nothing afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from eagle.model.drafting.tree import stack_trees
from eagle.model.engine.acceptance import Sampler, evaluate_batch, step_result
from eagle.model.engine.commit import Rows, commit_batch, drop_finished
from eagle.model.engine.handoffs import DraftInput
from eagle.model.engine.logprobs import token_logprobs
from eagle.model.engine.steps import CANCELLED, LENGTH, STOP, RowStep
from eagle.model.engine.verify import prefill_step, verify_trees
from eagle.model.base.target import Target
from eagle.utils.threads import NO_THREAD_POLICY


class RunningBatch:
    """The generation loop over a batch that rows join and leave between steps (continuous batching).

    ``add(prompts, budgets, logprobs)`` queues rows (prompts (n_b,), at most ``budgets[b]`` new tokens each; with
    ``logprobs[b]`` not None, row b's steps carry its tokens' log-probabilities with that many alternatives each,
    see :mod:`~eagle.model.engine.logprobs`) and returns their row numbers (0, 1, ... in the order added); ``cancel(row)`` makes a row leave. Both take effect at the next
    step boundary: iterating yields, after each target forward pass, a dict {row: :class:`RowStep`} of the rows
    that pass computed for (the rows that joined, after the prefill of joining rows; every row generating, after a
    verification), plus a ``"cancelled"`` step for each row cancelled since. A row ends after its first stop token
    (included) or its budget, and then leaves the batch. Iteration ends when no row generates or waits; rows added
    after that start it again.

    Joining rows are prefilled together in a cache of their own (left-padded to their longest prompt), then
    appended as batch rows of the target cache (:meth:`~eagle.model.base.kv_cache.TreeKVCache.add_rows`) and of
    the drafter's state (``add_rows``): every row keeps its own committed slots ``start .. length - 1``
    (:class:`~eagle.model.engine.commit.Rows`), so each computes what its prompt alone computes. All rows share the
    sampler (one set of sampling settings). Invariant between steps: the cache holds each row's committed tokens
    except the last emitted one (the root), which its next tree starts from. The cache must have room for every
    row (prompt, budget and one tree: the caller grows it, see :class:`~eagle.model.engine.engine.Engine`).
    ``threads``: a :class:`~eagle.utils.threads.ThreadPolicy` told when each verification step starts and ends (it
    may change torch's thread count between steps), or None.
    """

    def __init__(self, target: Target, drafter, cache, sampler: Sampler | None, stop_token_ids: set[int],
                 threads=None):
        self.target, self.drafter, self.cache, self.sampler = target, drafter, cache, sampler
        self.threads = NO_THREAD_POLICY if threads is None else threads
        self.stop_token_ids = set(stop_token_ids)
        self.rows = Rows([], [], [])
        self.draft_input: DraftInput | None = None  # what the drafter observes next (None: no rows)
        self._pending: list[tuple[int, torch.Tensor]] = []  # (row, prompt tokens (n,))
        self._budget: dict[int, int] = {}
        self._logprobs: dict[int, int] = {}  # rows that want logprobs: alternatives per token
        self._emitted: dict[int, int] = {}
        self._ended: set[int] = set()  # finished or cancelled, still in the cache until the next boundary
        self._cancelled: list[int] = []  # cancelled since the last step: reported with the next one
        self._next_row = 0
        self._steps: Iterator | None = None

    def add(self, prompts: list[torch.Tensor], budgets: list[int], logprobs: list[int | None] | None = None) -> list[int]:
        rows = list(range(self._next_row, self._next_row + len(prompts)))
        self._next_row += len(rows)
        for row, prompt, budget, top in zip(rows, prompts, budgets, logprobs or [None] * len(rows)):
            self._pending.append((row, prompt))
            self._budget[row], self._emitted[row] = budget, 0
            if top is not None:
                self._logprobs[row] = top
        if self._steps is None:
            self._steps = self._loop()
        return rows

    def cancel(self, row: int) -> None:
        waiting = [r for r, _ in self._pending]
        if row in waiting or (row in self.rows.index and row not in self._ended):
            self._cancelled.append(row)
        self._pending = [(r, ids) for r, ids in self._pending if r != row]
        if row in self.rows.index:
            self._ended.add(row)
        if self._steps is None and self._cancelled:
            self._steps = self._loop()  # the cancellation is still to be reported

    @property
    def size(self) -> int:
        """Rows generating or waiting to join."""
        return len(self.rows.index) - len(self._ended) + len(self._pending)

    def __iter__(self) -> "RunningBatch":
        return self

    def __next__(self) -> dict[int, RowStep]:
        if self._steps is None:
            raise StopIteration
        return next(self._steps)

    def close(self) -> None:
        if self._steps is not None:
            self._steps.close()

    @torch.no_grad()  # on a generator: entered around each resumption, so the caller's grad mode is left alone
    def _loop(self) -> Iterator[dict[int, RowStep]]:
        while True:
            self._retire()
            if self._pending:
                yield self._reported(self._admit())
            elif self.rows.index:
                yield self._reported(self._verify_step())
            else:
                if self._cancelled:
                    yield self._reported({})
                self._steps = None  # ended: the next add starts a new loop
                return

    def _reported(self, step: dict[int, RowStep]) -> dict[int, RowStep]:
        """``step`` with a ``"cancelled"`` step for every row cancelled since the last one."""
        for row in self._cancelled:
            step[row] = RowStep(torch.zeros(0, dtype=torch.long, device=self.target.device), 0, CANCELLED)
        self._cancelled = []
        return step

    def _retire(self) -> None:
        """Rows that ended (or were cancelled) leave the batch."""
        keep = [i for i, row in enumerate(self.rows.index) if row not in self._ended]
        if len(keep) == len(self.rows.index):
            return
        for row in self.rows.index:
            if row in self._ended:
                self._ended.discard(row)
                del self._budget[row], self._emitted[row]
                self._logprobs.pop(row, None)
        if keep:
            self.rows = drop_finished(keep, self.rows, self.cache, self.drafter)
            self.draft_input = self.draft_input.select(keep)
        else:
            self.rows, self.draft_input = Rows([], [], []), None

    def _admit(self) -> dict[int, RowStep]:
        """Prefill the waiting rows and make them batch rows; emit their first tokens."""
        pending, self._pending = self._pending, []
        joining = [row for row, _ in pending]
        ids, pads = left_pad([tokens for _, tokens in pending])
        alone = not self.rows.index
        if alone:  # the batch starts (again): straight into the cache
            self.drafter.reset(len(joining))
            self.cache.reset(len(joining))
            cache = self.cache
        else:
            cache = self.target.new_cache(self.cache.capacity)
        first, logits = prefill_step(self.target, ids, cache, self.sampler, self.drafter.needs_features, pads)
        rows = Rows(joining, list(pads), [ids.shape[1]] * len(joining))
        if alone:
            self.rows, self.draft_input = rows, first
        else:  # the drafter takes their prompt pairs now; the last pair (root) goes with the batch's next step
            self.cache.add_rows(cache)
            prompt = first.without_last()
            self.drafter.add_rows(prompt.features, prompt.next_tokens, prompt.valid)
            self.draft_input = self.draft_input.join(first.last())
            self.rows = Rows(self.rows.index + rows.index, self.rows.start + rows.start,
                             self.rows.length + rows.length)
        roots = first.next_tokens[:, -1]
        return self._emit(joining, [root.reshape(1) for root in roots], [0] * len(joining), lambda i: logits[i:i + 1])

    def _verify_step(self) -> dict[int, RowStep]:
        """Draft, verify, evaluate and commit every row; emit their new tokens."""
        self.threads.step_started()
        seen = self.draft_input
        self.drafter.observe(seen.features, seen.next_tokens, seen.valid)
        trees = stack_trees(self.drafter.propose())  # rooted at the last emitted tokens
        verified = verify_trees(self.target, trees, self.cache, self.rows, lazy_logits=True,
                                features=self.drafter.needs_features)
        accepted = evaluate_batch(trees.trees, verified.logits, self.sampler)
        commit_batch(self.cache, self.rows, [path for path, _ in accepted], trees.size)
        step = step_result(trees, accepted, verified.features)
        self.draft_input = step.draft_input
        self.threads.step_finished(trees.tokens.numel())

        def path_logits(i: int) -> torch.Tensor:  # the rows acceptance read: no projection happens here
            return torch.stack([verified.logits.row(i)[node] for node in accepted[i].path.tolist()])

        return self._emit(self.rows.index, step.tokens, step.accepted, path_logits)

    def _emit(self, rows: list[int], new: list[torch.Tensor], accepted: list[int], logits_of) -> dict[int, RowStep]:
        """Cut each row's new tokens at its stop token and budget; rows that end leave at the next boundary.
        ``logits_of(i)``: the target's logits (n, V) that produced ``new[i]``, read for the rows that want
        logprobs only."""
        step = {}
        for i, (row, tokens, count) in enumerate(zip(rows, new, accepted)):
            tokens, reason = truncate(tokens, self._budget[row] - self._emitted[row], self.stop_token_ids)
            self._emitted[row] += tokens.shape[0]
            if reason is not None:
                self._ended.add(row)
            logprobs = None
            if row in self._logprobs:
                temperature = self.sampler.temperature if self.sampler is not None else 0.0
                logprobs = token_logprobs(logits_of(i)[: tokens.shape[0]], tokens, self._logprobs[row], temperature)
            step[row] = RowStep(tokens, min(count, tokens.shape[0]), reason, logprobs)
        return step


def left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Prompts (n_b,) -> (ids (k, S) left-padded with each row's first token, pads)."""
    width = max(p.shape[0] for p in prompts)
    pads = [width - p.shape[0] for p in prompts]
    return torch.stack([torch.cat([p[:1].expand(pad), p]) for p, pad in zip(prompts, pads)]), pads


def truncate(tokens: torch.Tensor, room: int, stop_token_ids: set[int]) -> tuple[torch.Tensor, str | None]:
    """Cut ``tokens`` after the first stop token and to at most ``room`` tokens. Returns them and why the row ends
    (``"stop"``, ``"length"``) or None."""
    values = tokens.tolist()
    for i, token in enumerate(values[:room]):
        if token in stop_token_ids:
            return tokens[: i + 1], STOP
    return tokens[:room], LENGTH if len(values) >= room else None
