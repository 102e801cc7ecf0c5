"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft trees from the continuations of the context's longest
suffix that occurred before, scored by how often each continuation followed it.

Each row indexes its own tokens (the prompt, then everything emitted); a :class:`SuffixStore` shared by one model's
requests indexes the outputs of earlier requests too (bounded: the oldest outputs are evicted first). Each step the
drafter finds the longest suffix of the row's tokens (up to :data:`MAX_MATCH` tokens) that occurred before, in the
row or in the store, counts the tokens that followed each of its occurrences into a small trie, and proposes that
trie's most frequent nodes as a draft tree: a node's score is the fraction of occurrences that continued through
it. The tree's size follows the match: :data:`NODES_PER_MATCHED_TOKEN` nodes per matched token, no tree below
:data:`MIN_MATCH` matched tokens (the root alone: plain decoding, at the cost of one dictionary look-up).

The structure. A suffix tree (or a trie of all suffixes up to some depth) answers "which continuations follow this
suffix, and how often" at its node for the suffix; but built in Python it costs a node object per distinct
substring (a depth-32 trie holds up to 32 nodes per token), and evicting old text from it means walking and
pruning paths. What a draft step needs is narrower: the occurrences of one suffix of at most 32 tokens, for
sequences of a few thousand tokens. :class:`SuffixIndex` keeps the tokens as a list and, per position, that position
under two keys, its token and its last three tokens (a hash index of 1- and 3-grams, positions ascending). A query
takes the most recent :data:`MAX_CANDIDATES` positions of the longest key that occurred, extends each match
backwards by comparing list slices (a C-level comparison per 8 tokens), and keeps the occurrences of the longest
match: the same set the suffix tree's node for that suffix holds, restricted to its most recent occurrences (the
likeliest to repeat). Adding a token costs two list appends; memory is a few list entries per token; evicting the
oldest text pops its positions off the front of their keys' lists. A step drafts in tens of microseconds.

Verification treats the drafted nodes like any draft token, so greedy and sampling stay lossless; only the number
of tokens a step verifies changes. Around another drafter (``"eagle3+suffix"``) the suffix tree is merged into that
drafter's tree below the root, following its nodes where the tokens coincide (siblings stay distinct).
"""

from __future__ import annotations

import math
import threading
import weakref
from bisect import bisect_left, bisect_right
from collections import deque

import torch

from eagle.model.drafting.lookup import GRAFT_LOG_PROB  # a merged node ranks after the inner drafter's siblings
from eagle.model.drafting.protocol import Combinator
from eagle.model.drafting.tree import DraftTree, merge_below_root, tree_from_parents

#: The longest suffix a query matches (longer matches count as this long).
MAX_MATCH = 32
#: Fewest matched tokens that earn a tree (a single shared token is weak evidence).
MIN_MATCH = 2
#: Tree nodes (the root aside) per matched token, up to the drafter's limit: a longer match earns a larger tree.
#: (Greedy outputs of the embedded pair on MT-bench and the rewrite set: after a 2-token match the next 4 tokens
#: follow the earlier occurrence about one time in five, after 4 tokens the next 8, after 12 or more the next 24.)
NODES_PER_MATCHED_TOKEN = 2
#: The most recent occurrences of a key whose match a query measures, and of the longest match whose
#: continuations it counts.
MAX_CANDIDATES = 16
MAX_CONTINUATIONS = 8
#: Nodes a row's suffix tree adds at most for one row (batch 1); a batch of B rows adds at most
#: ``max(MIN_BATCH_NODES, SUFFIX_NODES // B)`` per row (verifying trees costs more per row as the batch grows).
SUFFIX_NODES = 24
MIN_BATCH_NODES = 4
#: Tokens of earlier outputs a :class:`SuffixStore` keeps by default (about 45 MiB where no 3-gram repeats).
STORE_TOKENS = 1 << 17
# Separates documents in a store: never a token id, so no match or continuation crosses it.
SEPARATOR = -1
GRAM = 3


class SuffixIndex:
    """Token ids with each position indexed by its token and its last :data:`GRAM` tokens.

    ``tokens[i]`` is the token at position ``base + i`` (a store drops its oldest positions and raises ``base``);
    ``unigrams`` / ``grams`` map a key to the positions it ends at, ascending."""

    def __init__(self):
        self.tokens: list[int] = []
        self.base = 0
        self.unigrams: dict[int, list[int]] = {}
        self.grams: dict[tuple[int, ...], list[int]] = {}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, new: list[int]) -> None:
        """Append ``new`` and index its positions (a :data:`SEPARATOR` and the keys spanning one are not indexed)."""
        tokens, unigrams, grams = self.tokens, self.unigrams, self.grams
        for token in new:
            position = self.base + len(tokens)
            tokens.append(token)
            if token == SEPARATOR:
                continue
            unigrams.setdefault(token, []).append(position)
            if len(tokens) >= GRAM:
                key = tuple(tokens[-GRAM:])
                if SEPARATOR not in key:
                    grams.setdefault(key, []).append(position)

    def drop_front(self, count: int) -> None:
        """Forget the oldest ``count`` tokens (their positions leave the fronts of their keys' lists)."""
        tokens, end = self.tokens, self.base + count
        for offset in range(count):
            token = tokens[offset]
            if token == SEPARATOR:
                continue
            _drop_below(self.unigrams, token, end)
            if offset >= GRAM - 1:
                key = tuple(tokens[offset - GRAM + 1 : offset + 1])
                if SEPARATOR not in key:
                    _drop_below(self.grams, key, end)
        del tokens[:count]
        self.base = end

    def occurrences(self, query: list[int], own: bool) -> tuple[int, list[int]]:
        """The longest match (up to :data:`MAX_MATCH` tokens) of ``query``'s suffix that has a token after it here,
        and the local indices of the tokens after its most recent occurrences (newest first, at most
        :data:`MAX_CONTINUATIONS`). ``own``: ``query`` is this index's own tokens (its last position, the query's
        end, is not an earlier occurrence). (0, []) when no suffix of :data:`MIN_MATCH` tokens or more matches."""
        last = len(self.tokens) - 1 - (1 if own else 0)  # the newest local index with a token after it
        candidates, known = self._candidates(query, self.base + last)
        best, found = 0, []
        for position in reversed(candidates):
            local = position - self.base
            if self.tokens[local + 1] == SEPARATOR:
                continue
            length = match_length(self.tokens, local, query, known)
            if length > best:
                best, found = length, [local + 1]
            elif length == best and len(found) < MAX_CONTINUATIONS:
                found.append(local + 1)
        return (best, found) if best >= MIN_MATCH else (0, [])

    def _candidates(self, query: list[int], newest: int) -> tuple[list[int], int]:
        """The most recent positions up to ``newest`` of ``query``'s last :data:`GRAM` tokens, else of its last
        token, and how many tokens of the match they share for certain."""
        if len(query) >= GRAM:
            positions = self.grams.get(tuple(query[-GRAM:]))
            if positions:
                end = bisect_right(positions, newest)
                if end:
                    return positions[max(0, end - MAX_CANDIDATES) : end], GRAM
        positions = self.unigrams.get(query[-1]) or []
        end = bisect_right(positions, newest)
        return positions[max(0, end - MAX_CANDIDATES) : end], 1

    def continuation(self, start: int, count: int) -> list[int]:
        """Up to ``count`` tokens from local index ``start``, cut at a :data:`SEPARATOR`."""
        tokens = self.tokens[start : start + count]
        return tokens[: tokens.index(SEPARATOR)] if SEPARATOR in tokens else tokens


def _drop_below(index: dict, key, end: int) -> None:
    positions = index.get(key)
    if positions is None:
        return
    del positions[: bisect_left(positions, end)]
    if not positions:
        del index[key]


def match_length(tokens: list[int], local: int, query: list[int], known: int) -> int:
    """How many tokens ending at ``tokens[local]`` equal the end of ``query`` (at most :data:`MAX_MATCH`), the
    last ``known`` being equal already."""
    length, size = known, len(query)
    while length < MAX_MATCH:
        step = min(8, MAX_MATCH - length, local + 1 - length, size - length)
        if step <= 0:
            return length
        ours = tokens[local + 1 - length - step : local + 1 - length]
        theirs = query[size - length - step : size - length]
        if ours != theirs:
            for back in range(1, step + 1):
                if ours[-back] != theirs[-back]:
                    return length + back - 1
        length += step
    return length


class SuffixStore:
    """The outputs of one model's earlier requests, for every suffix drafter of that model to match against.

    At most ``max_tokens`` tokens are kept: adding an output past that evicts the oldest outputs first (an output
    longer than the bound keeps its last tokens). A lock guards every call, so drafters on different threads may
    share a store. A store only changes which tokens are proposed, never what generation outputs."""

    def __init__(self, max_tokens: int = STORE_TOKENS):
        if not isinstance(max_tokens, int) or max_tokens < 2:
            raise ValueError(f"A suffix store's max_tokens must be an integer >= 2, got {max_tokens!r}.")
        self.max_tokens = max_tokens
        self.index = SuffixIndex()
        self._ends: deque[int] = deque()  # each output's end (past its separator), as an absolute position
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    def clear(self) -> None:
        """Forget every output."""
        with self._lock:
            self.index, self._ends = SuffixIndex(), deque()

    def add(self, output: list[int]) -> None:
        """Keep one finished output (token ids); outputs of fewer than :data:`MIN_MATCH` + 1 tokens are ignored."""
        output = list(output[-(self.max_tokens - 1) :])
        if len(output) <= MIN_MATCH:
            return
        with self._lock:
            index = self.index
            while self._ends and len(index) + len(output) + 1 > self.max_tokens:
                index.drop_front(self._ends.popleft() - index.base)
            index.extend(output + [SEPARATOR])
            self._ends.append(index.base + len(index))

    def occurrences(self, query: list[int], count: int) -> tuple[int, list[list[int]]]:
        """:meth:`SuffixIndex.occurrences` of ``query`` here, with the continuations themselves (up to ``count``
        tokens each), read under the lock."""
        with self._lock:
            length, starts = self.index.occurrences(query, own=False)
            return length, [self.index.continuation(start, count) for start in starts]


def continuation_trie(continuations: list[list[int]], nodes: int) -> tuple[list[int], list[int], list[float]]:
    """The ``nodes`` most frequent nodes of the trie of ``continuations`` (token sequences; among equally frequent
    nodes the shallower, then the earlier continuation's): tokens, parents (-1: the root, else an index into these
    lists, always smaller) and log conditional frequencies (log of the share of its parent's occurrences that
    continued with it), parents before children."""
    tokens, parents, counts, depths = [], [], [], []
    children: dict[tuple[int, int], int] = {}
    for sequence in continuations:
        node = -1
        for depth, token in enumerate(sequence[:nodes]):
            child = children.get((node, token))
            if child is None:
                child = children[(node, token)] = len(tokens)
                tokens.append(token), parents.append(node), counts.append(0), depths.append(depth)
            counts[child] += 1
            node = child
    # A parent occurs at least as often as its child, is shallower and was created before it, so keeping a prefix
    # of this order keeps every kept node's parent.
    kept = sorted(sorted(range(len(tokens)), key=lambda i: (-counts[i], depths[i]))[:nodes])
    renumber = {old: new for new, old in enumerate(kept)}
    total = len(continuations)
    return ([tokens[i] for i in kept], [renumber.get(parents[i], -1) for i in kept],
            [math.log(counts[i] / (counts[parents[i]] if parents[i] >= 0 else total)) for i in kept])


def graft_trie(tree: DraftTree, tokens: list[int], parents: list[int], log_freqs: list[float]) -> DraftTree:
    """``tree`` with a trie (see :func:`continuation_trie`) merged below its root
    (:func:`~eagle.model.drafting.tree.merge_below_root`): a trie node whose token is already a child of where its
    parent went follows that child, the others become new nodes (scored their parent's score plus their log
    frequency plus :data:`GRAFT_LOG_PROB`, so they rank after the inner drafter's own nodes). Returns ``tree``
    itself when nothing is added."""
    landed, new_parents = merge_below_root(tree, tokens, parents)
    if not new_parents:
        return tree
    all_tokens, all_scores = tree.tokens.tolist(), tree.scores.tolist()
    for node, token, log_freq in zip(landed, tokens, log_freqs):
        if node == len(all_tokens):  # a new node (they are numbered in the trie's order)
            all_tokens.append(token)
            all_scores.append(all_scores[new_parents[node - tree.size]] + log_freq + GRAFT_LOG_PROB)
    return tree_from_parents(torch.tensor(all_tokens, dtype=tree.tokens.dtype, device=tree.tokens.device),
                             torch.tensor(tree.parents.tolist() + new_parents, dtype=tree.parents.dtype,
                                          device=tree.parents.device),
                             torch.tensor(all_scores, dtype=tree.scores.dtype, device=tree.scores.device))


class _Row:
    """One row's tokens (the prompt without its first token, then every emitted token) and where its output
    starts (None until the row's first observation, whose last token is its first output token)."""

    __slots__ = ("index", "output_start")

    def __init__(self, tokens: list[int] | None = None, output_start: int | None = None):
        self.index = SuffixIndex()
        self.index.extend(tokens or [])
        self.output_start = output_start

    def output(self) -> list[int]:
        return self.index.tokens[self.output_start :] if self.output_start is not None else []


def _hand_over(store: SuffixStore | None, rows: list[_Row]) -> None:
    """Rows that finished: their outputs go to ``store`` (if any)."""
    if store is not None:
        for row in rows:
            store.add(row.output())


class SuffixDrafter(Combinator):
    """Suffix decoding around any drafter: each row's tree from ``inner``, with the row's suffix tree (see the
    module's docstring) merged below its root when the row's last tokens occurred before, in the row or in
    ``store``.

    ``nodes_for(batch_size)``: the most nodes a row's suffix tree adds in a batch of that many rows. Rows that leave
    (:meth:`select_rows`), the rows of a batch that starts again (:meth:`reset`) and the rows left when the drafter
    is dropped hand their outputs to ``store``."""

    def __init__(self, inner, nodes_for, store: SuffixStore | None = None):
        super().__init__(inner, nodes_for)
        self.store = store
        self.rows: list[_Row] = []  # changed in place only: the finalizer below holds this list
        weakref.finalize(self, _hand_over, store, self.rows)

    @classmethod
    def around(cls, context, inner) -> "SuffixDrafter":
        """The registry's ``+suffix`` (and ``"suffix"``, around plain decoding): up to :data:`SUFFIX_NODES`
        nodes per row at batch 1, fewer in larger batches, matched against the context's store as well."""
        return cls(inner, lambda batch_size: max(MIN_BATCH_NODES, SUFFIX_NODES // batch_size),
                   context.suffix_store)

    def reset_rows(self, batch_size: int) -> None:
        _hand_over(self.store, self.rows)
        self.rows[:] = [_Row() for _ in range(batch_size)]

    def observe_rows(self, next_tokens: torch.Tensor, valid: torch.Tensor | None) -> None:
        for row, new in zip(self.rows, _committed(next_tokens, valid)):
            if row.output_start is None:
                row.output_start = len(row.index) + len(new) - 1
            row.index.extend(new)

    def graft_row(self, tree: DraftTree, row: int, limit: int) -> DraftTree:
        """``tree`` with row ``row``'s suffix tree of at most ``limit`` nodes merged in."""
        index = self.rows[row].index
        query = index.tokens
        length, starts = index.occurrences(query, own=True)
        continuations = [index.continuation(start, limit) for start in starts]
        if self.store is not None:
            stored_length, stored = self.store.occurrences(query, limit)
            if stored_length > length:
                length, continuations = stored_length, stored
            elif stored_length == length:
                continuations += stored
        nodes = min(limit, NODES_PER_MATCHED_TOKEN * length)
        if not nodes:
            return tree
        return graft_trie(tree, *continuation_trie(continuations, nodes))

    def keep_rows(self, index: torch.Tensor) -> None:
        kept = index.tolist()
        staying = set(kept)
        _hand_over(self.store, [row for i, row in enumerate(self.rows) if i not in staying])
        self.rows[:] = [self.rows[i] for i in kept]

    def join_rows(self, next_tokens: torch.Tensor, valid: torch.Tensor | None) -> None:
        self.rows += [_Row(tokens, len(tokens)) for tokens in _committed(next_tokens, valid)]


def _committed(next_tokens: torch.Tensor, valid: torch.Tensor | None) -> list[list[int]]:
    """Each row's committed tokens, as lists."""
    rows = next_tokens.tolist()
    if valid is None:
        return rows
    return [[token for token, real in zip(row, flags) if real] for row, flags in zip(rows, valid.tolist())]
