"""Drafters: what proposes a tree of tokens for the target to verify.

The interface is three calls, in the spirit of transformers' candidate generators:

- ``reset(batch_size)`` at the start of a generation;
- ``draft_batch(features, next_tokens, valid) -> list[DraftTree]``: take, for each of B rows, the target features
  of the newly committed positions with the token that follows each of them (the last valid one being the root
  the target just chose), and return one tree per row rooted at that token (``draft`` does it for one row);
- ``select_rows(index)``: keep the rows ``index`` (finished rows leave the batch);
- ``add_rows(features, next_tokens, valid)``: rows join the batch after the given committed pairs (a running
  batch takes new requests between steps; see :class:`~eagle.model.generation.RunningBatch`).

``NoDrafter`` returns the root alone, which turns the speculative loop into plain decoding; ``EagleDrafter``
grows an EAGLE-2 dynamic tree with an EAGLE-1 or EAGLE-3 head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_layers import KVPair
from .batch_budget import LookupRate, select_batch_trees
from .lookup import find_match, graft_chain
from .tree import DraftTree, root_only_trees, select_trees


@dataclass(frozen=True)
class TreeSettings:
    """total_token: nodes verified per step including the root (N + 1); depth: draft expansion steps after the
    first (the tree has up to depth + 1 draft levels); top_k: children kept per expanded node and nodes expanded
    per level; lookup_tokens: at most this many tokens copied from earlier in the context are grafted onto the
    tree (see :mod:`eagle.model.lookup`; 0 = off, the reference's behaviour), so a step may verify up to
    ``total_token + lookup_tokens`` nodes."""

    total_token: int = 60
    depth: int = 7
    top_k: int = 10
    lookup_tokens: int = 0

    def __post_init__(self):
        if self.total_token < 1 or self.depth < 0 or self.top_k < 1 or self.lookup_tokens < 0:
            raise ValueError(
                f"Invalid tree settings total_token={self.total_token}, depth={self.depth}, top_k={self.top_k}, "
                f"lookup_tokens={self.lookup_tokens}: expected total_token >= 1 (or -1 to auto-tune), depth >= 0, "
                "top_k >= 1, lookup_tokens >= 0."
            )

    @property
    def max_tree_size(self) -> int:
        """The most nodes one step verifies (root included)."""
        return self.total_token + self.lookup_tokens


def tree_for_batch(settings: TreeSettings, batch_trees: dict[int, TreeSettings] | None,
                   batch_size: int) -> TreeSettings:
    """The tree for ``batch_size`` rows: the entry of ``batch_trees`` ({smallest batch size: settings}, see
    :mod:`eagle.model.batch_tree`) with the largest key <= ``batch_size``, else ``settings`` (the batch-1 tree)."""
    chosen = settings
    for size, tree in sorted((batch_trees or {}).items()):
        if size <= batch_size:
            chosen = tree
    return chosen


class NoDrafter:
    """Plain decoding in the speculative loop: no draft, the tree is the root alone."""

    needs_features = False

    def reset(self, batch_size: int = 1) -> None:
        pass

    def select_rows(self, index: torch.Tensor) -> None:
        pass

    def add_rows(self, features, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        pass

    def draft_batch(self, features, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> list[DraftTree]:
        if valid is None:
            return root_only_trees(next_tokens[:, -1])
        last = last_valid(valid).to(next_tokens.device)
        return root_only_trees(next_tokens.gather(1, last[:, None])[:, 0])

    def draft(self, features, next_tokens: torch.Tensor) -> DraftTree:
        return self.draft_batch(features, next_tokens)[0]


def last_valid(valid: torch.Tensor) -> torch.Tensor:
    """(B, m) bool (each row's True entries a contiguous run, at least one) -> the index of each row's last (B,)."""
    return (valid.long() * torch.arange(1, valid.shape[1] + 1, device=valid.device)).argmax(1)


ROW_LISTS = ("history", "chains", "matches", "grafted")  # EagleDrafter's per-row lists, kept in row order


class EagleDrafter:
    """EAGLE-2 dynamic tree drafting with an EAGLE head, for B rows at once (one tree per row; with ``shared_budget``
    B > 1 rows share one node budget, :mod:`eagle.model.batch_budget`).

    ``batch_trees`` ({smallest batch size: settings}, see :mod:`eagle.model.batch_tree`): each draft uses the tree
    for the number of rows it drafts (``settings`` when none applies); ``settings`` then holds the tree in use.

    State: the head's KV cache over the committed (feature, next token) pairs of every row; it only ever holds
    committed positions, so a rejected tree needs no rollback. Rows commit different numbers of pairs per step, so
    once a step brings padding, ``valid`` (B, slots) says which cache slots hold a row's pairs and ``counts`` (B,)
    how many it has (its next head position). With ``settings.lookup_tokens``, also each row's committed tokens
    (the prompt without its first token, then everything emitted), where its lookup branch is searched, its last
    chain with the length of the context match it came from and how many of its tokens were verified
    (``chains``, ``matches``, ``grafted``), and ``lookup_rate``, the running
    estimate of how often a chain token is accepted, which scores chains against the head's nodes.
    """

    needs_features = True
    # True: a batch's rows share one node budget (:mod:`eagle.model.batch_budget`); off by default, since ragged
    # trees measured slower on a CPU than the same tree per row (BENCHMARKS.md, "One node budget per batch").
    shared_budget = False

    def __init__(self, head, settings: TreeSettings, batch_trees: dict[int, TreeSettings] | None = None):
        self.head = head
        self.settings = self.batch1_settings = settings
        self.batch_trees = dict(batch_trees or {})
        self.reset()

    def reset(self, batch_size: int = 1) -> None:
        self.committed_kv: list[KVPair] | None = None
        self.valid: torch.Tensor | None = None  # (B, slots) bool; None while every slot is valid
        self.counts: torch.Tensor | None = None  # (B,) committed pairs per row
        # per row (ROW_LISTS): its committed tokens, its last lookup chain, the length of the context match that
        # chain came from, and how many of the chain's tokens its last tree verified
        self.history: list[torch.Tensor | None] = [None] * batch_size
        self.chains: list[torch.Tensor | None] = [None] * batch_size
        self.matches: list[int] = [0] * batch_size
        self.grafted: list[int] = [0] * batch_size
        self.lookup_rate = LookupRate()

    def select_rows(self, index: torch.Tensor) -> None:
        self.committed_kv = [(k[index.to(k.device)], v[index.to(v.device)]) for k, v in self.committed_kv or []] or None
        self.valid = None if self.valid is None else self.valid[index.to(self.valid.device)]
        self.counts = None if self.counts is None else self.counts[index.to(self.counts.device)]
        for name in ROW_LISTS:
            setattr(self, name, [getattr(self, name)[i] for i in index.tolist()])
        self._compact()

    def add_rows(self, features: torch.Tensor, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """k rows join the batch (after the existing ones): the head commits their pairs (features (k, m, F),
        next_tokens (k, m), valid (k, m) bool or None; m may be 0) in a pass of their own, and its cache rows are
        appended to the batch's (the shorter side padded with slots no row sees)."""
        joining = EagleDrafter(self.head, self.settings)
        joining.reset(next_tokens.shape[0])
        if next_tokens.shape[1]:
            joining._commit(features, next_tokens, valid)
            joining.history = [row if valid is None else row[valid[b]] for b, row in enumerate(next_tokens)]
        self._append(joining)

    def _append(self, other: "EagleDrafter") -> None:
        """Append ``other``'s rows after this drafter's."""
        rows = (len(self.history), len(other.history))
        lengths = (self.committed_length, other.committed_length)
        slots = max(lengths)
        present = [t for t in (self.counts, other.counts, self.valid, other.valid) if t is not None]
        device = present[0].device if present else self.head.fc.weight.device
        if slots:
            layers = len(self.committed_kv or other.committed_kv)
            pairs = zip(self.committed_kv or [(None, None)] * layers, other.committed_kv or [(None, None)] * layers)
            self.committed_kv = [(_stack_rows(k1, k2, rows, slots), _stack_rows(v1, v2, rows, slots))
                                 for (k1, v1), (k2, v2) in pairs]
            self.valid = torch.cat([_slots_valid(valid, n, length, slots, device)
                                    for valid, n, length in zip((self.valid, other.valid), rows, lengths)])
        if self.counts is not None or other.counts is not None:
            self.counts = torch.cat([c.to(device) if c is not None else torch.zeros(n, dtype=torch.long, device=device)
                                     for c, n in zip((self.counts, other.counts), rows)])
        for name in ROW_LISTS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._compact()

    def _compact(self) -> None:
        """Once most head-cache slots hold no row's pair (rows commit ragged numbers of pairs per step, leave and
        join), move each row's pairs to the first slots, in order, and drop the rest: a batch that rows keep
        joining stays as long as its longest row. Exact: attention reads a set of slots, positions come from
        ``counts``."""
        if self.valid is None or not self.committed_kv:
            return
        longest = int(self.counts.max()) if self.counts.numel() else 0
        if self.valid.shape[1] <= 2 * longest + 64:
            return
        order = torch.sort((~self.valid).to(torch.int8), dim=1, stable=True).indices[:, :longest]  # valid first
        self.committed_kv = [(_gather_slots(k, order), _gather_slots(v, order)) for k, v in self.committed_kv]
        self.valid = torch.arange(longest, device=self.valid.device)[None] < self.counts.to(self.valid.device)[:, None]

    @property
    def committed_length(self) -> int:
        return self.committed_kv[0][0].shape[2] if self.committed_kv else 0

    def draft(self, features: torch.Tensor, next_tokens: torch.Tensor) -> DraftTree:
        """One row: features (1, m, F), next_tokens (1, m). See :meth:`draft_batch`."""
        return self.draft_batch(features, next_tokens)[0]

    @torch.no_grad()
    def draft_batch(self, features: torch.Tensor, next_tokens: torch.Tensor,
                    valid: torch.Tensor | None = None) -> list[DraftTree]:
        """features: (B, m, F) target features of the m newly committed positions; next_tokens: (B, m) the token
        after each; valid: (B, m) bool, which of them are a row's (a contiguous run; None = all). The root of row
        b is its last valid next token. Returns B trees of the tree for B rows (``batch_trees``): each row gets
        ``total_token`` nodes plus a grafted lookup chain, or with ``shared_budget`` B > 1 rows share one budget
        of ``B x (total_token - 1)`` draft nodes, chains included (:mod:`eagle.model.batch_budget`)."""
        self.settings = tree_for_batch(self.batch1_settings, self.batch_trees, next_tokens.shape[0])
        head, k = self.head, self.settings.top_k
        hidden, last = self._commit(features, next_tokens, valid)
        batch = next_tokens.shape[0]
        rows = torch.arange(batch, device=next_tokens.device)
        roots = next_tokens[rows, last]
        # Level 0: the K best continuations of each root, from its last committed position.
        logp = torch.log_softmax(head.compute_logits(hidden[rows, last][:, None])[:, 0].float(), dim=-1)  # (B, Vd)
        scores, draft_ids = logp.topk(k, dim=-1)
        candidates = self._expand(hidden[rows, last][:, None], head.draft_to_target(draft_ids), scores)
        chains = [None] * batch
        if any(tree.lookup_tokens for tree in (self.batch1_settings, *self.batch_trees.values())):
            chains = [self._lookup_chain(b, next_tokens[b] if valid is None else next_tokens[b][valid[b]])
                      for b in range(batch)]
        if batch == 1 or not self.shared_budget:
            trees = select_trees(roots, *candidates, self.settings.total_token - 1)
            self.grafted = [0 if chain is None else chain.numel() for chain in chains]
            return [graft_chain(tree, chain) if chain is not None else tree for tree, chain in zip(trees, chains)]
        rates = [self.lookup_rate.log_rate(match) for match in self.matches]
        trees, self.grafted = select_batch_trees(roots, *candidates, batch * (self.settings.total_token - 1), chains,
                                                 rates)
        return trees

    def _commit(self, features, next_tokens, valid):
        """Run the head over the new pairs into its committed cache. Returns its states (B, m, H) and the index of
        each row's last valid pair (B,)."""
        batch, length = next_tokens.shape
        device = next_tokens.device
        if self.counts is None:
            self.counts = torch.zeros(batch, dtype=torch.long, device=device)
        features = features.to(self.head.fc.weight.device)  # the head casts them to its own dtype
        if valid is None or bool(valid.all()):
            valid = None
        if valid is None and self.valid is None:  # no padding so far: plain causal positions
            hidden, self.committed_kv = self.head(features, next_tokens, past_key_values=self.committed_kv,
                                                  use_cache=True)
            self.counts = self.counts + length
            return hidden, torch.full((batch,), length - 1, dtype=torch.long, device=device)
        new_valid = torch.ones(batch, length, dtype=torch.bool, device=device) if valid is None else valid.to(device)
        past_valid = self.valid
        if past_valid is None:
            past_valid = torch.ones(batch, self.committed_length, dtype=torch.bool, device=device)
        positions = (self.counts[:, None] + new_valid.long().cumsum(1) - 1).clamp(min=0)
        causal = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
        new_block = (causal & new_valid[:, None, :]) | torch.eye(length, dtype=torch.bool, device=device)
        mask = torch.cat([past_valid[:, None, :].expand(batch, length, -1), new_block], dim=2)[:, None]
        hidden, self.committed_kv = self.head(features, next_tokens, attention_mask=mask, position_ids=positions,
                                              past_key_values=self.committed_kv, use_cache=True)
        self.valid = torch.cat([past_valid, new_valid], dim=1)
        self.counts = self.counts + new_valid.sum(1)
        return hidden, last_valid(new_valid)

    def _expand(self, last: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor):
        """Grow ``depth`` levels below the K best root children, K nodes expanded per level. last: (B, 1, H) the
        head state at each row's root; tokens, scores: (B, K) the root's children. Returns the candidates
        (tokens, cumulative scores, parent candidate index or -1), each (B, C), in generation order."""
        head, k = self.head, self.settings.top_k
        batch, device = tokens.shape[0], tokens.device
        cand_tokens, cand_scores = [tokens], [scores]
        cand_parents = [torch.full((batch, k), -1, dtype=torch.long, device=device)]
        frontier = torch.arange(k, device=device).expand(batch, k)  # candidate indices of the nodes to expand next
        offset = k  # candidates generated so far
        input_hidden, input_ids = last.expand(batch, k, -1), tokens
        ancestors = torch.eye(k, dtype=torch.bool, device=device).expand(batch, k, k)  # (B, K, expansion tokens)
        past = self._past_mask(batch, k, device)
        kv = self.committed_kv
        for step in range(self.settings.depth):
            mask = torch.cat([past, ancestors], dim=2)[:, None]
            positions = (self.counts + step)[:, None].expand(batch, k)
            out, kv = head(input_hidden, input_ids, attention_mask=mask, position_ids=positions, past_key_values=kv,
                           use_cache=True)  # (B, K, H)
            logp = torch.log_softmax(head.compute_logits(out).float(), dim=-1)  # (B, K, Vd)
            child_scores, child_ids = logp.topk(k, dim=-1)  # (B, K, K)
            child_scores = (child_scores + scores[:, :, None]).flatten(1)  # cumulative log-prob along the path
            child_tokens = head.draft_to_target(child_ids).flatten(1)
            cand_tokens.append(child_tokens)
            cand_scores.append(child_scores)
            cand_parents.append(frontier.repeat_interleave(k, dim=1))
            if step + 1 < self.settings.depth:
                scores, best = child_scores.topk(k, dim=-1)
                parent_slot = best // k
                frontier = offset + best
                input_hidden = out.gather(1, parent_slot[:, :, None].expand(-1, -1, out.shape[-1]))
                input_ids = child_tokens.gather(1, best)
                chosen = ancestors.gather(1, parent_slot[:, :, None].expand(-1, -1, ancestors.shape[2]))
                ancestors = torch.cat([chosen, torch.eye(k, dtype=torch.bool, device=device).expand(batch, k, k)],
                                      dim=2)
            offset += k * k
        return torch.cat(cand_tokens, 1), torch.cat(cand_scores, 1), torch.cat(cand_parents, 1)

    def _past_mask(self, batch: int, k: int, device) -> torch.Tensor:
        """(B, K, committed slots) bool: which committed slots each expanded node sees."""
        if self.valid is None:
            return torch.ones(batch, k, self.committed_length, dtype=torch.bool, device=device)
        return self.valid[:, None, :].expand(batch, k, -1)

    def _lookup_chain(self, row: int, new_tokens: torch.Tensor) -> torch.Tensor | None:
        """Extend the row's history (kept whenever some batch size's tree looks up, so that a batch whose rows
        leave can switch to one), with ``shared_budget`` score its last chain against what the row committed since
        (:class:`~eagle.model.batch_budget.LookupRate`), and return its lookup continuation, or None when there is
        none or the tree in use does not look up."""
        history = self.history[row]
        self.history[row] = history = new_tokens if history is None else torch.cat([history, new_tokens])
        if self.shared_budget and self.chains[row] is not None:  # the estimate scores chains in a shared budget only
            self.lookup_rate.observe(self.chains[row], self.matches[row], self.grafted[row], new_tokens)
        self.chains[row], self.matches[row] = None, 0
        if not self.settings.lookup_tokens:
            return None
        chain, match = find_match(history, self.settings.lookup_tokens)
        if chain.numel():
            self.chains[row], self.matches[row] = chain, match
        return self.chains[row]


def _stack_rows(first, second, rows: tuple[int, int], slots: int) -> torch.Tensor:
    """Two (rows, heads, slots, dim) head-cache tensors (either may be None: no slots yet), padded to ``slots``
    slots with zeros and stacked on the batch axis."""
    like = first if first is not None else second
    parts = []
    for tensor, n in zip((first, second), rows):
        tensor = like.new_zeros(n, like.shape[1], 0, like.shape[3]) if tensor is None else tensor.to(like.device)
        parts.append(torch.cat([tensor, like.new_zeros(n, like.shape[1], slots - tensor.shape[2], like.shape[3])],
                               dim=2))
    return torch.cat(parts)


def _gather_slots(tensor: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """(B, heads, slots, dim) -> (B, heads, L, dim): row b's slots ``order[b]`` (B, L)."""
    order = order.to(tensor.device)[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
    return tensor.gather(2, order)


def _slots_valid(valid, rows: int, length: int, slots: int, device) -> torch.Tensor:
    """(rows, slots) bool: which head-cache slots hold a row's pairs (``valid`` (rows, length) or None = all)."""
    if valid is None:
        valid = torch.ones(rows, length, dtype=torch.bool, device=device)
    return torch.cat([valid.to(device), torch.zeros(rows, slots - length, dtype=torch.bool, device=device)], dim=1)
