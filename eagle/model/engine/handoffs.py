"""What the phases of a generation step hand each other (B rows; m newly committed positions; N tree nodes; F the
feature width; V the vocabulary):

- :class:`DraftInput`: what the drafter observes before it proposes (after a prefill, or after a step);
- :class:`~eagle.model.drafting.tree.TreeBatch`: the trees it proposed, padded for one verification forward pass;
- :class:`VerifyOutput`: that forward pass's logits and features;
- :class:`Accepted`: one row's accepted path and the target's token after it;
- :class:`StepResult`: each row's new tokens, and the drafter's next :class:`DraftInput`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from eagle.model.base.logits import TreeLogits


@dataclass(frozen=True)
class DraftInput:
    """What the target just committed, for the drafter to observe (:meth:`~eagle.model.drafting.protocol.Drafter.
    observe`): ``features`` (B, m, F) the target's features at the newly committed positions (None when the
    drafter reads none), ``next_tokens`` (B, m) the token after each (a row's last valid one is its root, the
    token its next tree starts from), ``valid`` (B, m) bool which pairs are a row's (a contiguous run ending at its
    root; None = all)."""

    features: torch.Tensor | None
    next_tokens: torch.Tensor
    valid: torch.Tensor | None = None

    def select(self, keep: list[int]) -> "DraftInput":
        """The rows ``keep`` (positions on dim 0, in that order)."""
        index = torch.tensor(keep)
        return DraftInput(*(None if t is None else t[index.to(t.device)]
                            for t in (self.features, self.next_tokens, self.valid)))

    def without_last(self) -> "DraftInput":
        """Every pair but each row's last."""
        return DraftInput(None if self.features is None else self.features[:, :-1], self.next_tokens[:, :-1],
                          None if self.valid is None else self.valid[:, :-1])

    def last(self) -> "DraftInput":
        """Each row's last pair (its root), valid in every row."""
        return DraftInput(None if self.features is None else self.features[:, -1:], self.next_tokens[:, -1:])

    def join(self, joining: "DraftInput") -> "DraftInput":
        """These rows followed by ``joining``'s, padded on the right to a common width (the padding is not
        valid)."""
        width = max(self.next_tokens.shape[1], joining.next_tokens.shape[1])

        def widen(t, fill=0):
            if t is None or t.shape[1] == width:
                return t
            return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)], dim=1)

        def valid_of(v, t):
            return widen(torch.ones(t.shape[:2], dtype=torch.bool, device=t.device) if v is None else v, False)

        tokens = self.next_tokens
        features = (None if self.features is None
                    else torch.cat([widen(self.features), widen(joining.features).to(self.features)]))
        return DraftInput(features, torch.cat([widen(tokens), widen(joining.next_tokens).to(tokens.device)]),
                          torch.cat([valid_of(self.valid, tokens),
                                     valid_of(joining.valid, joining.next_tokens).to(tokens.device)]))


@dataclass(frozen=True)
class VerifyOutput:
    """The verification forward pass over every row's tree: ``logits`` the target's logits after each node
    (:class:`~eagle.model.base.logits.TreeLogits`: ``logits.row(b)[node]`` (V,)), ``features`` (B, N, F) at each
    node (None when the drafter reads none)."""

    logits: TreeLogits
    features: torch.Tensor | None


class Accepted(NamedTuple):
    """One row's acceptance: ``path`` (a + 1,) the accepted node ids, root first (a accepted draft tokens), and
    ``bonus`` (0-d) the target's token after the path's last node."""

    path: torch.Tensor
    bonus: torch.Tensor


@dataclass(frozen=True)
class StepResult:
    """After acceptance: ``tokens[b]`` (a_b + 1,) row b's new tokens (its accepted draft tokens, then the target's
    own), and ``draft_input`` what the drafter observes next (features of the accepted nodes, the token after each,
    which are real: :class:`DraftInput`, of width max_b (a_b + 1))."""

    tokens: list[torch.Tensor]
    draft_input: DraftInput

    @property
    def accepted(self) -> list[int]:
        """Accepted draft tokens of each row."""
        return [tokens.shape[0] - 1 for tokens in self.tokens]
