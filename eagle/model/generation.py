"""The one generation loop, for a batch of B sequences (one sequence is the batch of one). Plain decoding is the
same loop with a drafter that proposes nothing.

Each step is four named functions of explicit inputs: draft (drafter: one tree per row), verify (one target forward
over every row's tree), evaluate (accept a path per row), commit (keep each row's accepted KV entries and emit
tokens).

Batches. The prompts come left-padded to a common length S (``pads[b]`` padding slots before row b's first real
token). All rows share the cache's slot axis: every forward pass writes every row at the same slots, and row b's
committed tokens sit at slots ``start[b] .. length[b] - 1`` (:class:`Rows`). Its RoPE positions count from its
first real token, so each row computes what its prompt alone would (the pad slots and a row's leftovers past its
own length are masked out, never attended). Trees are padded to the largest row's node count
(:class:`~eagle.model.tree.TreeBatch`; its ``valid`` marks the real nodes, and packed CPU linear layers compute
those alone, as they do a prefill's real prompt tokens); after verification each row moves its own accepted path (ragged lengths) to
its own committed length. Stops and budgets are per row; a finished row leaves the batch (its cache and drafter
rows are dropped, see :func:`drop_finished`), so it costs nothing afterwards.

For a server's scheduler, :func:`speculative_decode_batch` (``EaModel.generate_batch_steps``) is the batched step
iterator: after each target forward it yields a :class:`BatchStep` with, for every row of the batch, the new
tokens, how many came from accepted drafts, and whether the row is finished. The batch is fixed when the iterator
starts (rows leave it, none join); abandoning the iterator leaves the model usable.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..utils.openmp import release_openmp_threads
from ..utils.threads import NO_THREAD_POLICY
from .target import LazyLogits, Target
from .tree import DraftTree, TreeBatch, likeliest_root_subtrees, likeliest_subtree, stack_trees
from .verify import Sampler, verify_greedy, verify_greedy_batch, verify_sampling


# Rows projected through the LM head at once (see LazyLogits): in the verification forward itself, the root and its
# likeliest descendants; later, a row read beyond those and its likeliest descendants. On a CPU 8 rows cost about
# 1.2 to 1.3 times one.
LAZY_PROJECTION_ROWS = 8


@dataclass
class Step:
    """What one step emits for one sequence: tokens (n,) on the target device, and how many of them came from
    accepted drafts (``accepted = n - 1`` for a full verification step, 0 for the prefill's first token; truncation
    at a stop token or the token budget can shorten ``tokens``)."""

    tokens: torch.Tensor
    accepted: int


@dataclass
class BatchStep:
    """What one step emits for a batch of B rows (lists of length B, in the caller's row order): ``tokens[b]``
    (n_b,) the new tokens of row b (empty once the row has finished), ``accepted[b]`` how many of them came from
    accepted drafts, ``finished[b]`` whether row b has ended (from the step that emits its last token on)."""

    tokens: list[torch.Tensor]
    accepted: list[int]
    finished: list[bool]


@dataclass
class Rows:
    """Where the rows still generating sit in the shared cache: ``index`` their numbers in the caller's batch; row
    i's committed tokens at slots ``start[i] .. length[i] - 1``."""

    index: list[int]
    start: list[int]
    length: list[int]

    def select(self, keep: list[int]) -> "Rows":
        return Rows([self.index[i] for i in keep], [self.start[i] for i in keep], [self.length[i] for i in keep])

    def masks(self, slots: int, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(valid (B, slots) bool, key positions (B, slots)) of the first ``slots`` cache slots; (None, None) when
        every row holds exactly those slots from position 0 (a batch of one)."""
        if all(s == 0 for s in self.start) and all(n == slots for n in self.length):
            return None, None
        ids = torch.arange(slots, device=device)
        start = torch.tensor(self.start, device=device)[:, None]
        valid = (ids >= start) & (ids < torch.tensor(self.length, device=device)[:, None])
        return valid, ids - start


def prefill(target: Target, input_ids: torch.Tensor, cache, sampler: Sampler | None, with_features: bool,
            pads: list[int] | None = None):
    """Run the prompts (B, S), row b left-padded with ``pads[b]`` slots, into the empty cache. Returns (first new
    token of each row (B,), features (B, S, F) or None)."""
    length = input_ids.shape[1]
    positions, valid = torch.arange(length), None
    if pads and any(pads):
        slots = torch.arange(length, device=target.device)
        valid = slots >= torch.tensor(pads, device=target.device)[:, None]
        positions = (slots - torch.tensor(pads, device=target.device)[:, None]).clamp(min=0)
    out = target.forward(input_ids, cache, positions, last_logits_only=True, valid=valid)
    roots = choose_tokens(out.logits[:, -1], sampler)
    return roots, (out.features if with_features else None)


def choose_token(logits: torch.Tensor, sampler: Sampler | None) -> torch.Tensor:
    """logits (V,) -> next token (0-d): argmax when greedy, else a draw from the processed distribution."""
    if sampler is None:
        return logits.argmax()
    return sampler.draw(sampler.probs(logits[None])[0])


def choose_tokens(logits: torch.Tensor, sampler: Sampler | None) -> torch.Tensor:
    """logits (B, V) -> next token of each row (B,)."""
    if sampler is None:
        return logits.argmax(-1)
    return torch.stack([choose_token(row, sampler) for row in logits])


def verify_trees(target: Target, trees: TreeBatch, cache, rows: Rows, lazy_logits: bool = False):
    """Target forward over every row's tree, row b's nodes at positions (its committed tokens) + depth. Returns
    (logits: one indexable per row, node -> (V,); fetch (see :meth:`LazyLogits.fetch`) or None; features
    (B, N, F) or None).

    ``lazy_logits``: where the target allows it, the logits are :class:`~eagle.model.target.LazyLogits`: each
    tree's root and its likeliest descendants are projected with the forward pass, any other node when read
    (verification reads only the accepted paths') together with the likeliest nodes below it (see
    :func:`~eagle.model.tree.likeliest_subtree`)."""
    slots, device = cache.length, target.device
    valid, key_positions = rows.masks(slots, device)
    if valid is None and trees.padded:
        valid = torch.ones(len(rows.index), slots, dtype=torch.bool, device=device)
    if valid is not None:  # the committed slots, then the nodes: padding nodes are no row's tokens
        valid = torch.cat([valid, trees.valid.to(device)], dim=1)
    committed = torch.tensor([n - s for s, n in zip(rows.start, rows.length)], device=trees.depths.device)
    positions = trees.depths + committed[:, None]
    tree_mask = trees.ancestor_mask if trees.size > 1 else None
    lazy = lazy_logits and trees.size > 1
    first_rows = likeliest_root_subtrees(trees.trees, LAZY_PROJECTION_ROWS) if lazy else None
    out = target.forward(trees.tokens, cache, positions.cpu(), tree_mask=tree_mask, lazy_logits=lazy,
                         first_rows=first_rows, valid=valid, key_positions=key_positions)
    if isinstance(out.logits, LazyLogits):
        out.logits.rows_with = lambda row, node: likeliest_subtree(trees.trees[row], node, LAZY_PROJECTION_ROWS)
        return [out.logits.row(b) for b in range(len(trees.trees))], out.logits.fetch, out.features
    return list(out.logits), None, out.features


def verify_tree(target: Target, tree: DraftTree, cache, lazy_logits: bool = False):
    """One tree after a cache of one row: (logits indexable by node (N+1 rows of V), features (1, N+1, F) or
    None). See :func:`verify_trees`."""
    rows = Rows([0], [0], [cache.length])
    logits, _, features = verify_trees(target, stack_trees([tree]), cache, rows, lazy_logits)
    return logits[0], features


def evaluate(tree: DraftTree, logits, sampler: Sampler | None):
    """Accepted node ids (acc+1,) root first, and the target's next token after them."""
    if tree.size == 1:
        return torch.zeros(1, dtype=torch.long, device=tree.tokens.device), choose_token(logits[0], sampler)
    if sampler is None:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, sampler)


def evaluate_batch(trees: list[DraftTree], logits: list, fetch, sampler: Sampler | None):
    """:func:`evaluate` for every row: a list of (accepted node ids, next token). Greedy rows are walked in
    lockstep, so that the LM head projects what they read next together."""
    if sampler is None:
        return verify_greedy_batch(trees, logits, fetch)
    return [evaluate(tree, row_logits, sampler) for tree, row_logits in zip(trees, logits)]


def commit(cache, prefix_length: int, path: torch.Tensor) -> None:
    """Keep the KV entries of the accepted nodes right after the committed prefix; drop the rest of the tree."""
    if path.numel() == 1:  # the root is already in place
        cache.crop(prefix_length + 1)
    else:
        cache.keep_path(path + prefix_length, prefix_length)


def commit_batch(cache, rows: Rows, paths: list[torch.Tensor], tree_size: int) -> None:
    """Each row keeps the KV entries of its accepted nodes (the trees of ``tree_size`` nodes fill the cache's last
    slots) right after its own committed tokens; ``rows.length`` grows by each path's length. A row whose path
    already sits there (its committed tokens end where the trees begin and it accepted nodes 0, 1, ..., as plain
    decoding's root-only trees always do) moves nothing."""
    slots = cache.length - tree_size
    if len(paths) == 1 and rows.length[0] == slots:
        commit(cache, slots, paths[0])
        rows.length[0] += paths[0].numel()
        return
    counts = [path.numel() for path in paths]
    width, device = max(counts), paths[0].device
    padded = torch.nn.utils.rnn.pad_sequence(paths, batch_first=True)  # (B, width), 0-padded on the right
    last = torch.tensor(counts, device=device)[:, None] - 1
    sources = padded.gather(1, torch.arange(width, device=device).expand(len(paths), width).minimum(last))
    # Node ids ascend along a path from the root (node 0), so a path is 0, 1, ... exactly when it ends at count - 1.
    ends = padded.gather(1, last)[:, 0].tolist()
    moving = [b for b, (end, count, length) in enumerate(zip(ends, counts, rows.length))
              if end != count - 1 or length != slots]
    targets = torch.tensor([rows.length[b] for b in moving], device=device)[:, None]
    rows.length = [n + count for n, count in zip(rows.length, counts)]
    if not moving:
        cache.crop(max(rows.length))
        return
    index = torch.tensor(moving, device=device)
    targets = targets + torch.arange(width, device=device)
    cache.keep_rows(sources[index] + slots, targets, max(rows.length), rows=index)


def drop_finished(keep: list[int], rows: Rows, cache, drafter, carried: list):
    """Shrink the batch to the rows ``keep`` (positions among the rows still generating): the cache's and the
    drafter's rows, and every tensor of ``carried`` (indexed on dim 0; None passes). Returns (rows, carried)."""
    index = torch.tensor(keep)
    cache.select_rows(index)
    drafter.select_rows(index)
    rows = rows.select(keep)
    cache.crop(max(rows.length))
    return rows, [None if t is None else t[index.to(t.device)] for t in carried]


def next_inputs(trees: TreeBatch, results: list, tree_features):
    """After evaluation: each row's new tokens (accepted drafts then the next token), and the drafter's next
    inputs: features (B, M, F) of the accepted nodes, the token after each (B, M), and which are real (B, M) bool,
    or None when every row accepted the same number (a batch of one)."""
    new = [torch.cat([tree.tokens[path[1:]], bonus.reshape(1)]) for tree, (path, bonus) in zip(trees.trees, results)]
    paths = [path for path, _ in results]
    width = max(tokens.shape[0] for tokens in new)
    if all(tokens.shape[0] == width for tokens in new):
        next_tokens, valid = torch.stack(new), None
        index = torch.stack(paths)
    else:
        next_tokens = torch.stack([torch.cat([t, t[-1:].expand(width - t.shape[0])]) for t in new])
        index = torch.stack([torch.cat([p, p[-1:].expand(width - p.shape[0])]) for p in paths])
        valid = torch.arange(width, device=index.device)[None] < torch.tensor([t.shape[0] for t in new],
                                                                              device=index.device)[:, None]
    features = None
    if tree_features is not None:
        index = index.to(tree_features.device)
        features = tree_features[torch.arange(index.shape[0], device=index.device)[:, None], index]
    return new, next_tokens, valid, features


class OneSequenceDrafter:
    """Serves a batch of one with a drafter of the one-sequence interface (``reset()``, ``draft(features,
    next_tokens) -> DraftTree``, no ``draft_batch``)."""

    def __init__(self, drafter):
        self.drafter, self.needs_features = drafter, drafter.needs_features

    def reset(self, batch_size: int = 1) -> None:
        if batch_size != 1:
            raise ValueError(f"{type(self.drafter).__name__} drafts one sequence at a time (it has no draft_batch).")
        self.drafter.reset()

    def select_rows(self, index: torch.Tensor) -> None:
        pass

    def add_rows(self, features, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        raise ValueError(f"{type(self.drafter).__name__} drafts one sequence at a time: rows cannot join its batch.")

    def draft_batch(self, features, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> list[DraftTree]:
        return [self.drafter.draft(features, next_tokens)]


@dataclass
class RowStep:
    """One row's part of a :class:`RunningBatch` step: its new tokens, how many came from accepted drafts, and
    whether the row has ended (this is then its last step)."""

    tokens: torch.Tensor
    accepted: int
    finished: bool


class RunningBatch:
    """The generation loop over a batch that rows join and leave between steps (continuous batching).

    ``add(input_ids, pads, budgets)`` queues rows (left-padded prompts (k, S), ``pads[b]`` padding slots before
    row b's tokens, at most ``budgets[b]`` new tokens each) and returns their row numbers (0, 1, ... in the order
    added); ``cancel(row)`` makes a row leave. Both take effect at the next step boundary: iterating yields, after
    each target forward pass, a dict {row: :class:`RowStep`} of the rows that pass computed for (the rows that
    joined, after the prefill of joining rows; every row generating, after a verification). A row ends after its
    first stop token (included) or its budget, and then leaves the batch (its cache and drafter rows are dropped,
    see :func:`drop_finished`). Iteration ends when no row generates or waits; rows added after that start it
    again.

    Joining rows are prefilled together in a cache of their own, then appended as batch rows of the target cache
    (:meth:`~eagle.model.kv_cache.TreeKVCache.add_rows`) and of the drafter's state (``add_rows``): every row keeps
    its own committed slots ``start .. length - 1`` (:class:`Rows`), so each computes what its prompt alone
    computes. All rows share the sampler (one set of sampling settings). Invariant between steps: the cache holds
    each row's committed tokens except the last emitted one (the root), which its next tree starts from. The cache
    must have room for every row (prompt, budget and one tree: the caller grows it, see ``EaModel``).
    ``threads``: a :class:`~eagle.utils.threads.ThreadPolicy` called around each verification step, or None.
    """

    def __init__(self, target: Target, drafter, cache, sampler: Sampler | None, stop_token_ids: set[int],
                 threads=None):
        self.target, self.cache, self.sampler = target, cache, sampler
        self.threads = NO_THREAD_POLICY if threads is None else threads
        self.drafter = drafter if hasattr(drafter, "draft_batch") else OneSequenceDrafter(drafter)
        self.stop_token_ids = set(stop_token_ids)
        self.rows = Rows([], [], [])
        self.carried: tuple = (None, None, None)  # the drafter's next inputs: features, next tokens, valid
        self._pending: list[tuple[int, torch.Tensor]] = []  # (row, prompt tokens (n,))
        self._budget: dict[int, int] = {}
        self._emitted: dict[int, int] = {}
        self._ended: set[int] = set()  # finished or cancelled, still in the cache until the next boundary
        self._next_row = 0
        self._steps: Iterator | None = None

    def add(self, input_ids: torch.Tensor, pads: list[int], budgets: list[int]) -> list[int]:
        rows = list(range(self._next_row, self._next_row + input_ids.shape[0]))
        self._next_row += len(rows)
        for row, ids, pad, budget in zip(rows, input_ids, pads, budgets):
            self._pending.append((row, ids[pad:]))
            self._budget[row], self._emitted[row] = budget, 0
        if self._steps is None:
            self._steps = self._loop()
        return rows

    def cancel(self, row: int) -> None:
        self._pending = [(r, ids) for r, ids in self._pending if r != row]
        if row in self.rows.index:
            self._ended.add(row)

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
        try:
            while True:
                self._retire()
                if self._pending:
                    yield self._admit()
                    continue
                if not self.rows.index:
                    self._steps = None  # ended: the next add starts a new loop
                    return
                yield self._verify_step()
        finally:  # whichever thread generates next gets the CPUs (see eagle.utils.openmp)
            release_openmp_threads()

    def _retire(self) -> None:
        """Rows that ended (or were cancelled) leave the batch."""
        keep = [i for i, row in enumerate(self.rows.index) if row not in self._ended]
        if len(keep) == len(self.rows.index):
            return
        for row in self.rows.index:
            if row in self._ended:
                self._ended.discard(row)
                del self._budget[row], self._emitted[row]
        if keep:
            self.rows, carried = drop_finished(keep, self.rows, self.cache, self.drafter, list(self.carried))
            self.carried = tuple(carried)
        else:
            self.rows, self.carried = Rows([], [], []), (None, None, None)

    def _admit(self) -> dict[int, RowStep]:
        """Prefill the waiting rows and make them batch rows; emit their first tokens."""
        pending, self._pending = self._pending, []
        joining = [row for row, _ in pending]
        ids, pads = _left_pad([tokens for _, tokens in pending])
        alone = not self.rows.index
        if alone:  # the batch starts (again): straight into the cache
            self.drafter.reset(len(joining))
            self.cache.reset(len(joining))
            cache = self.cache
        else:
            cache = self.target.new_cache(self.cache.capacity)
        roots, features = prefill(self.target, ids, cache, self.sampler, self.drafter.needs_features, pads)
        width = ids.shape[1]
        rows = Rows(joining, list(pads), [width] * len(joining))
        next_tokens = torch.cat([ids[:, 1:].to(roots.device), roots[:, None]], dim=1)
        valid = None
        if any(pads):  # pair j (feature j, token j + 1) is row b's when slot j holds one of its tokens
            valid = torch.arange(width, device=roots.device)[None] >= torch.tensor(pads, device=roots.device)[:, None]
        if alone:
            self.rows, self.carried = rows, (features, next_tokens, valid)
        else:  # the head commits their prompt pairs now; the last pair (root) goes with the batch's next draft
            self.cache.add_rows(cache)
            self.drafter.add_rows(None if features is None else features[:, :-1], next_tokens[:, :-1],
                                  None if valid is None else valid[:, :-1])
            last = (None if features is None else features[:, -1:], next_tokens[:, -1:], None)
            self.carried = _join_carried(self.carried, last)
            self.rows = Rows(self.rows.index + rows.index, self.rows.start + rows.start,
                             self.rows.length + rows.length)
        return self._emit(joining, [root.reshape(1) for root in roots], [0] * len(joining))

    def _verify_step(self) -> dict[int, RowStep]:
        """Draft, verify, evaluate and commit every row; emit their new tokens."""
        self.threads.step_started()
        features, next_tokens, valid = self.carried
        trees = stack_trees(self.drafter.draft_batch(features, next_tokens, valid))  # rooted at the last emitted
        logits, fetch, tree_features = verify_trees(self.target, trees, self.cache, self.rows, lazy_logits=True)
        results = evaluate_batch(trees.trees, logits, fetch, self.sampler)
        commit_batch(self.cache, self.rows, [path for path, _ in results], trees.size)
        new, next_tokens, valid, features = next_inputs(trees, results, tree_features)
        self.carried = (features, next_tokens, valid)
        self.threads.step_finished(trees.tokens.numel())
        return self._emit(self.rows.index, new, [tokens.shape[0] - 1 for tokens in new])

    def _emit(self, rows: list[int], new: list[torch.Tensor], accepted: list[int]) -> dict[int, RowStep]:
        """Cut each row's new tokens at its stop token and budget; rows that end leave at the next boundary."""
        step = {}
        for row, tokens, count in zip(rows, new, accepted):
            tokens, done = _truncate(tokens, self._budget[row] - self._emitted[row], self.stop_token_ids)
            self._emitted[row] += tokens.shape[0]
            finished = done or self._emitted[row] >= self._budget[row]
            if finished:
                self._ended.add(row)
            step[row] = RowStep(tokens, min(count, tokens.shape[0]), finished)
        return step


def _left_pad(prompts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """Prompts (n_b,) -> (ids (k, S) left-padded with each row's first token, pads)."""
    width = max(p.shape[0] for p in prompts)
    pads = [width - p.shape[0] for p in prompts]
    return torch.stack([torch.cat([p[:1].expand(pad), p]) for p, pad in zip(prompts, pads)]), pads


def _join_carried(carried: tuple, joining: tuple) -> tuple:
    """The drafter's next inputs of the batch's rows followed by those of joining rows, padded on the right to a
    common width (the padding is not valid)."""
    features, tokens, valid = carried
    new_features, new_tokens, new_valid = joining
    width = max(tokens.shape[1], new_tokens.shape[1])

    def widen(t, fill=0):
        if t is None or t.shape[1] == width:
            return t
        return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)], dim=1)

    def valid_of(v, t):
        return widen(torch.ones(t.shape[:2], dtype=torch.bool, device=t.device) if v is None else v, False)

    joined_features = None if features is None else torch.cat([widen(features), widen(new_features).to(features)])
    return (joined_features, torch.cat([widen(tokens), widen(new_tokens).to(tokens.device)]),
            torch.cat([valid_of(valid, tokens), valid_of(new_valid, new_tokens).to(tokens.device)]))


@torch.no_grad()  # on a generator: entered around each resumption, so the caller's grad mode is left alone
def speculative_decode_batch(
    target: Target,
    drafter,
    cache,
    input_ids: torch.Tensor,
    pads: list[int],
    sampler: Sampler | None,
    budgets: list[int],
    stop_token_ids: set[int],
    threads=None,
) -> Iterator[BatchStep]:
    """Generate after the left-padded prompts ``input_ids`` (B, S) (row b: ``pads[b]`` padding slots, then its
    tokens): a :class:`RunningBatch` that no row joins. Yields one :class:`BatchStep` per target forward pass.

    Row b stops after its first stop token (included) or after ``budgets[b]`` tokens. ``threads``: see
    :class:`RunningBatch`.
    """
    batch = input_ids.shape[0]
    if max(budgets) <= 0:
        return
    running = RunningBatch(target, drafter, cache, sampler, stop_token_ids, threads)
    running.add(input_ids, pads, budgets)
    finished, empty = [False] * batch, input_ids.new_zeros(0)
    for update in running:
        step = BatchStep([empty] * batch, [0] * batch, list(finished))
        for row, part in update.items():
            step.tokens[row], step.accepted[row] = part.tokens, part.accepted
            step.finished[row] = finished[row] = part.finished
        yield step


def speculative_decode(
    target: Target,
    drafter,
    cache,
    input_ids: torch.Tensor,
    sampler: Sampler | None,
    max_new_tokens: int,
    max_length: int,
    stop_token_ids: set[int],
) -> Iterator[Step]:
    """Generate after one sequence ``input_ids`` (1, S): :func:`speculative_decode_batch` for a batch of one,
    yielding one :class:`Step` per target forward pass.

    Stops after the first stop token (included), after ``max_new_tokens`` tokens, or when the sequence reaches
    ``max_length``.
    """
    budget = min(max_new_tokens, max_length - input_ids.shape[1])
    for step in speculative_decode_batch(target, drafter, cache, input_ids, [0], sampler, [budget], stop_token_ids):
        yield Step(tokens=step.tokens[0], accepted=step.accepted[0])


def _truncate(tokens: torch.Tensor, room: int, stop_token_ids: set[int]) -> tuple[torch.Tensor, bool]:
    """Cut ``tokens`` after the first stop token and to at most ``room`` tokens; say whether generation ends."""
    values = tokens.tolist()
    for i, token in enumerate(values[:room]):
        if token in stop_token_ids:
            return tokens[: i + 1], True
    return tokens[:room], len(values) >= room
