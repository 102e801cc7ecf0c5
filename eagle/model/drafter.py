"""Drafters: what proposes a tree of tokens for the target to verify.

The interface is two calls, in the spirit of transformers' candidate generators:

- ``reset()`` at the start of a generation;
- ``draft(features, next_tokens) -> DraftTree``: take the target features of the newly committed positions with
  the token that follows each of them (the last one being the root the target just chose), and return a tree
  rooted at that token.

``NoDrafter`` returns the root alone, which turns the speculative loop into plain decoding; ``EagleDrafter``
grows an EAGLE-2 dynamic tree with an EAGLE-1 or EAGLE-3 head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_layers import KVPair
from .lookup import find_continuation, graft_chain
from .tree import DraftTree, root_only_tree, select_tree


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


class NoDrafter:
    """Plain decoding in the speculative loop: no draft, the tree is the root alone."""

    needs_features = False

    def reset(self) -> None:
        pass

    def draft(self, features, next_tokens: torch.Tensor) -> DraftTree:
        return root_only_tree(next_tokens[0, -1])


class EagleDrafter:
    """EAGLE-2 dynamic tree drafting with an EAGLE head.

    State: the head's KV cache over the committed (feature, next token) pairs; it only ever holds committed
    positions, so a rejected tree needs no rollback. With ``settings.lookup_tokens``, also the committed tokens
    (the prompt without its first token, then everything emitted), where the lookup branch is searched.
    """

    needs_features = True

    def __init__(self, head, settings: TreeSettings):
        self.head = head
        self.settings = settings
        self.committed_kv: list[KVPair] | None = None
        self.history: torch.Tensor | None = None

    def reset(self) -> None:
        self.committed_kv = None
        self.history = None

    @property
    def committed_length(self) -> int:
        return self.committed_kv[0][0].shape[2] if self.committed_kv else 0

    @torch.no_grad()
    def draft(self, features: torch.Tensor, next_tokens: torch.Tensor) -> DraftTree:
        """features: (1, m, F) target features of the m newly committed positions; next_tokens: (1, m) the token
        after each (the last is the root). Returns a tree of at most ``total_token`` nodes."""
        head, k = self.head, self.settings.top_k
        device = next_tokens.device
        features = features.to(head.fc.weight.device)  # the head casts them to its own dtype
        hidden, self.committed_kv = head(features, next_tokens, past_key_values=self.committed_kv, use_cache=True)
        root = next_tokens[0, -1]
        context = self.committed_length

        # Level 0: the K best continuations of the root, from the last committed position.
        last = hidden[:, -1:]  # (1, 1, H)
        logp = torch.log_softmax(head.compute_logits(last)[0, 0].float(), dim=-1)
        scores, draft_ids = logp.topk(k)
        tokens = head.draft_to_target(draft_ids)
        cand_tokens, cand_scores = [tokens], [scores]
        cand_parents = [torch.full((k,), -1, dtype=torch.long, device=device)]
        frontier = torch.arange(k, device=device)  # candidate indices of the nodes to expand next
        offset = k  # candidates generated so far

        input_hidden = last.expand(1, k, -1)
        input_ids = tokens[None]
        ancestors = torch.eye(k, dtype=torch.bool, device=device)  # (K, expansion tokens so far)
        kv = self.committed_kv
        for step in range(self.settings.depth):
            mask = torch.cat([torch.ones(k, context, dtype=torch.bool, device=device), ancestors], dim=1)
            positions = torch.full((1, k), context + step, dtype=torch.long, device=device)
            out, kv = head(input_hidden, input_ids, attention_mask=mask[None, None], position_ids=positions,
                           past_key_values=kv, use_cache=True)  # (1, K, H)
            logp = torch.log_softmax(head.compute_logits(out)[0].float(), dim=-1)  # (K, Vd)
            child_scores, child_ids = logp.topk(k, dim=-1)  # (K, K)
            child_scores = child_scores + scores[:, None]  # cumulative log-prob along the path
            child_tokens = head.draft_to_target(child_ids).flatten()
            cand_tokens.append(child_tokens)
            cand_scores.append(child_scores.flatten())
            cand_parents.append(frontier.repeat_interleave(k))
            if step + 1 < self.settings.depth:
                scores, best = child_scores.flatten().topk(k)
                parent_slot = best // k
                frontier = offset + best
                input_hidden = out[:, parent_slot]
                input_ids = child_tokens[best][None]
                ancestors = torch.cat([ancestors[parent_slot], torch.eye(k, dtype=torch.bool, device=device)], dim=1)
            offset += k * k

        tree = select_tree(
            root,
            torch.cat(cand_tokens),
            torch.cat(cand_scores),
            torch.cat(cand_parents),
            self.settings.total_token - 1,
        )
        if self.settings.lookup_tokens:
            new = next_tokens[0]
            self.history = new if self.history is None else torch.cat([self.history, new])
            chain = find_continuation(self.history, self.settings.lookup_tokens)
            if chain.numel():
                tree = graft_chain(tree, chain)
        return tree
