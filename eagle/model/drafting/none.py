"""Plain decoding in the speculative loop: a drafter that proposes nothing, so each tree is its root alone."""

from __future__ import annotations

import torch

from eagle.model.drafting.protocol import StepDrafter, roots_of
from eagle.model.drafting.tree import DraftTree, root_only_trees


class NoDrafter(StepDrafter):
    """Proposes the root alone (the token the target chose): the loop then is plain decoding."""

    needs_features = False

    def __init__(self):
        self._roots: torch.Tensor | None = None

    def reset(self, batch_size: int = 1) -> None:
        self._roots = None

    def observe(self, features, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        self._roots = roots_of(next_tokens, valid)

    def propose(self) -> list[DraftTree]:
        return root_only_trees(self._roots)

    def select_rows(self, index: torch.Tensor) -> None:
        pass

    def add_rows(self, features, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        pass

    def max_nodes(self, batch_size: int) -> int:
        return 1
