"""EAGLE-2 dynamic draft trees grown by an EAGLE-1 or EAGLE-3 head, for B rows at once (one tree per row)."""

from __future__ import annotations

import torch

from eagle.model.drafting.protocol import DraftContext, StepDrafter, last_valid
from eagle.model.drafting.settings import TreePlan
from eagle.model.drafting.tree import DraftTree, select_trees
from eagle.model.heads.draft_layers import KVPair


def head_drafter(context: DraftContext, version: int) -> "EagleDrafter":
    """The registry's ``"eagle3"`` / ``"eagle1"``: the context's head, which must be of that version."""
    head = context.head
    if head is None:
        raise ValueError(f"The eagle{version} drafter needs a draft head; this model has none.")
    if head.eagle_version != version:
        raise ValueError(f"The eagle{version} drafter was asked for, but the model's head is an EAGLE-"
                         f"{head.eagle_version} head: use eagle{head.eagle_version}.")
    return EagleDrafter(head, context.plan)


class EagleDrafter(StepDrafter):
    """EAGLE-2 dynamic tree drafting with an EAGLE head; each draft uses the plan's tree for the number of rows it
    drafts (``settings`` then holds the tree in use).

    State: the head's KV cache over the committed (feature, next token) pairs of every row; it only ever holds
    committed positions, so a rejected tree needs no rollback. Rows commit different numbers of pairs per step, so
    once a step brings padding, ``valid`` (B, slots) says which cache slots hold a row's pairs and ``counts`` (B,)
    how many it has (its next head position)."""

    needs_features = True

    def __init__(self, head, plan: TreePlan):
        self.head, self.plan = head, plan
        self.settings = plan.batch1
        self.reset()

    def reset(self, batch_size: int = 1) -> None:
        self.committed_kv: list[KVPair] | None = None
        self.valid: torch.Tensor | None = None  # (B, slots) bool; None while every slot is valid
        self.counts: torch.Tensor | None = None  # (B,) committed pairs per row
        self._roots: tuple[torch.Tensor, torch.Tensor] | None = None  # (head state (B, 1, H), root tokens (B,))
        self.batch_size = batch_size

    def select_rows(self, index: torch.Tensor) -> None:
        self.committed_kv = [(k[index.to(k.device)], v[index.to(v.device)]) for k, v in self.committed_kv or []] or None
        self.valid = None if self.valid is None else self.valid[index.to(self.valid.device)]
        self.counts = None if self.counts is None else self.counts[index.to(self.counts.device)]
        self.batch_size = index.numel()
        self._compact()

    def add_rows(self, features: torch.Tensor, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """k rows join the batch (after the existing ones): the head commits their pairs (features (k, m, F),
        next_tokens (k, m), valid (k, m) bool or None; m may be 0) in a pass of their own, and its cache rows are
        appended to the batch's (the shorter side padded with slots no row sees)."""
        joining = EagleDrafter(self.head, self.plan)
        joining.reset(next_tokens.shape[0])
        if next_tokens.shape[1]:
            joining._commit(features, next_tokens, valid)
        self._append(joining)

    def _append(self, other: "EagleDrafter") -> None:
        """Append ``other``'s rows after this drafter's."""
        rows = (self.batch_size, other.batch_size)
        lengths = (self.committed_length, other.committed_length)
        slots = max(lengths)
        present = [t for t in (self.counts, other.counts, self.valid, other.valid) if t is not None]
        device = present[0].device if present else self.head.weight.device
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
        self.batch_size += other.batch_size
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

    def max_nodes(self, batch_size: int) -> int:
        return max(self.plan.for_batch(size).total_token for size in range(1, batch_size + 1))

    @property
    def committed_length(self) -> int:
        return self.committed_kv[0][0].shape[2] if self.committed_kv else 0

    @torch.no_grad()
    def observe(self, features: torch.Tensor, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Run the head over the new pairs (features (B, m, F), next_tokens (B, m), valid (B, m) bool, a contiguous
        run per row; None = all) into its committed cache; each row's root is its last valid next token."""
        hidden, last = self._commit(features, next_tokens, valid)
        rows = torch.arange(next_tokens.shape[0], device=next_tokens.device)
        self._roots = (hidden[rows, last][:, None], next_tokens[rows, last])

    @torch.no_grad()
    def propose(self) -> list[DraftTree]:
        """B trees of the plan's tree for B rows, each of ``total_token`` nodes: the root's K best continuations
        from its last committed position, grown ``depth`` levels, the best-scored kept (EAGLE-2)."""
        state, roots = self._roots
        self.settings = self.plan.for_batch(roots.shape[0])
        logp = torch.log_softmax(self.head.compute_logits(state)[:, 0].float(), dim=-1)  # (B, Vd)
        scores, draft_ids = logp.topk(self.settings.top_k, dim=-1)
        candidates = self._expand(state, self.head.draft_to_target(draft_ids), scores)
        return select_trees(roots, *candidates, self.settings.total_token - 1)

    def _commit(self, features, next_tokens, valid):
        """Run the head over the new pairs into its committed cache. Returns its states (B, m, H) and the index of
        each row's last valid pair (B,)."""
        batch, length = next_tokens.shape
        device = next_tokens.device
        if self.counts is None:
            self.counts = torch.zeros(batch, dtype=torch.long, device=device)
        features = features.to(self.head.weight.device)  # the head casts them to its own dtype
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
