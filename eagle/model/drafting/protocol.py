"""What proposes tokens for the target to verify: the :class:`Drafter` interface.

A drafter is two calls per step, in the spirit of transformers' candidate generators (propose; learn from the
result): :meth:`Drafter.observe` takes, for each of B rows, what the target just committed (its features at the
newly committed positions and the token that follows each; the last valid one is the root the target chose), and
:meth:`Drafter.propose` returns one draft tree per row, rooted at that token. Rows leave a running batch
(:meth:`Drafter.select_rows`) and join it (:meth:`Drafter.add_rows`) between steps.

This module imports no drafter: the drafters import it, and :mod:`eagle.model.drafting.registry` imports them all
and builds them by name.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from eagle.model.drafting.settings import TreePlan
from eagle.model.drafting.tree import DraftTree


@runtime_checkable
class Drafter(Protocol):
    """The interface the generation loop drives (shapes: B rows, m new committed positions, F feature width)."""

    #: whether :meth:`observe` needs the target's features (the loop asks the target for them only then)
    needs_features: bool

    def reset(self, batch_size: int) -> None:
        """A generation of ``batch_size`` rows starts: forget everything."""

    def observe(self, features: torch.Tensor | None, next_tokens: torch.Tensor,
                valid: torch.Tensor | None = None) -> None:
        """The rows committed m positions: features (B, m, F) or None, the token after each (B, m), and which
        pairs are a row's (B, m) bool (a contiguous run ending at its root; None = all)."""

    def propose(self) -> list[DraftTree]:
        """One tree per row, rooted at the row's last observed token."""

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (1-D, in that order): finished rows leave."""

    def add_rows(self, features: torch.Tensor | None, next_tokens: torch.Tensor,
                 valid: torch.Tensor | None = None) -> None:
        """k rows join after the existing ones, with these committed pairs (as :meth:`observe`; m may be 0); their
        roots come with the batch's next :meth:`observe`."""

    def max_nodes(self, batch_size: int) -> int:
        """The most nodes (root included) a row's tree holds in a batch that starts with ``batch_size`` rows: what
        the target cache must leave room for."""


class StepDrafter:
    """Shared conveniences of the drafters: one call that observes and proposes, for a batch or one row."""

    def draft_batch(self, features, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> list[DraftTree]:
        """:meth:`observe` then :meth:`propose`."""
        self.observe(features, next_tokens, valid)
        return self.propose()

    def draft(self, features, next_tokens: torch.Tensor) -> DraftTree:
        """One row: features (1, m, F), next_tokens (1, m)."""
        return self.draft_batch(features, next_tokens)[0]


class Combinator(StepDrafter, ABC):
    """A drafter around another (the registry's combinators, ``"INNER+lookup"``, ``"INNER+suffix"``): each row's
    tree from ``inner`` with up to ``extra_nodes(batch_size)`` nodes of the wrapper's own grafted into it
    (:meth:`graft_row`; none when that is 0). Every call reaches ``inner`` first, then the wrapper's own rows
    (:meth:`reset_rows`, :meth:`observe_rows`, :meth:`keep_rows`, :meth:`join_rows`)."""

    def __init__(self, inner: Drafter, extra_nodes: Callable[[int], int]):
        self.inner, self.extra_nodes = inner, extra_nodes
        self.needs_features = inner.needs_features

    def reset(self, batch_size: int = 1) -> None:
        self.inner.reset(batch_size)
        self.reset_rows(batch_size)

    def observe(self, features, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        self.inner.observe(features, next_tokens, valid)
        self.observe_rows(next_tokens, valid)

    def propose(self) -> list[DraftTree]:
        trees = self.inner.propose()
        limit = self.extra_nodes(len(trees))
        if not limit:
            return trees
        return [self.graft_row(tree, row, limit) for row, tree in enumerate(trees)]

    def max_nodes(self, batch_size: int) -> int:
        return self.inner.max_nodes(batch_size) + max(self.extra_nodes(size) for size in range(1, batch_size + 1))

    def select_rows(self, index: torch.Tensor) -> None:
        self.inner.select_rows(index)
        self.keep_rows(index)

    def add_rows(self, features, next_tokens: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        self.inner.add_rows(features, next_tokens, valid)
        self.join_rows(next_tokens, valid)

    @abstractmethod
    def reset_rows(self, batch_size: int) -> None:
        """A generation of ``batch_size`` rows starts."""

    @abstractmethod
    def observe_rows(self, next_tokens: torch.Tensor, valid: torch.Tensor | None) -> None:
        """The rows committed these tokens (as :meth:`Drafter.observe`)."""

    @abstractmethod
    def keep_rows(self, index: torch.Tensor) -> None:
        """Keep the rows ``index`` (as :meth:`Drafter.select_rows`)."""

    @abstractmethod
    def join_rows(self, next_tokens: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Rows join with these committed tokens (as :meth:`Drafter.add_rows`)."""

    @abstractmethod
    def graft_row(self, tree: DraftTree, row: int, limit: int) -> DraftTree:
        """``inner``'s tree of ``row`` with at most ``limit`` nodes of the wrapper's own grafted into it."""


def last_valid(valid: torch.Tensor) -> torch.Tensor:
    """(B, m) bool (each row's True entries a contiguous run, at least one) -> the index of each row's last (B,)."""
    return (valid.long() * torch.arange(1, valid.shape[1] + 1, device=valid.device)).argmax(1)


def roots_of(next_tokens: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Each row's root (B,): its last valid next token."""
    if valid is None:
        return next_tokens[:, -1]
    return next_tokens.gather(1, last_valid(valid).to(next_tokens.device)[:, None])[:, 0]


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may be built from: the model's draft head (None without one), the tree plan, and the
    model's :class:`~eagle.model.drafting.suffix.SuffixStore` of earlier outputs (None: suffix drafters match
    each row's own tokens only)."""

    head: object | None
    plan: TreePlan
    suffix_store: object | None = None


DrafterFactory = Callable[[DraftContext], Drafter]
