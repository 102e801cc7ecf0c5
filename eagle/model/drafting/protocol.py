"""What proposes tokens for the target to verify: the :class:`Drafter` interface and its registry.

A drafter is two calls per step, in the spirit of transformers' candidate generators (propose; learn from the
result): :meth:`Drafter.observe` takes, for each of B rows, what the target just committed (its features at the
newly committed positions and the token that follows each; the last valid one is the root the target chose), and
:meth:`Drafter.propose` returns one draft tree per row, rooted at that token. Rows leave a running batch
(:meth:`Drafter.select_rows`) and join it (:meth:`Drafter.add_rows`) between steps.

Drafters are built by name from :data:`DRAFTERS` (``"eagle3"``, ``"eagle1"``: an EAGLE head's dynamic tree;
``"none"``: the root alone, i.e. plain decoding); a spec ``"NAME+lookup"`` wraps a drafter in prompt lookup
(:class:`~eagle.model.drafting.lookup.LookupDrafter`), which grafts a chain copied from earlier in the context onto
whatever the inner drafter proposes (``"none+lookup"``, or ``"lookup"``, is prompt-lookup decoding alone). A new
drafter kind is a class with these methods and one :func:`register_drafter` call.
"""

from __future__ import annotations

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
    """What a drafter may be built from: the model's draft head (None without one) and the tree plan."""

    head: object | None
    plan: TreePlan


DrafterFactory = Callable[[DraftContext], Drafter]
DRAFTERS: dict[str, DrafterFactory] = {}
COMBINATORS: dict[str, Callable[[DraftContext, Drafter], Drafter]] = {}


def register_drafter(name: str, factory: DrafterFactory) -> None:
    """Make ``factory(context) -> Drafter`` buildable as ``name`` (see :func:`build_drafter`)."""
    if not name or "+" in name:
        raise ValueError(f"A drafter name must be non-empty and without '+', got {name!r}.")
    DRAFTERS[name] = factory


def register_combinator(name: str, wrap: Callable[[DraftContext, Drafter], Drafter]) -> None:
    """Make ``"INNER+name"`` build ``wrap(context, inner drafter)``."""
    COMBINATORS[name] = wrap


def build_drafter(spec: str, context: DraftContext) -> Drafter:
    """The drafter ``spec`` names: a registered drafter, optionally followed by ``+COMBINATOR`` parts
    (``"eagle3+lookup"``); a combinator alone wraps ``"none"`` (``"lookup"`` is prompt-lookup decoding)."""
    _register_builtins()
    names = spec.split("+")
    if names[0] in COMBINATORS:
        names.insert(0, "none")
    if names[0] not in DRAFTERS:
        raise ValueError(f"Unknown drafter {names[0]!r} in {spec!r}; available: {', '.join(sorted(DRAFTERS))} "
                         f"(combine with: {', '.join('+' + name for name in sorted(COMBINATORS))}).")
    drafter = DRAFTERS[names[0]](context)
    for name in names[1:]:
        if name not in COMBINATORS:
            raise ValueError(f"Unknown drafter combinator {name!r} in {spec!r}; available: "
                             f"{', '.join(sorted(COMBINATORS))}.")
        drafter = COMBINATORS[name](context, drafter)
    return drafter


def head_spec(head, plan: TreePlan) -> str:
    """The spec of a head's own drafter: ``"eagle3"`` / ``"eagle1"``, with ``+lookup`` when some tree of ``plan``
    grafts lookup chains."""
    return f"eagle{head.eagle_version}" + ("+lookup" if plan.looks_up else "")


def drafter_for_head(head, plan) -> Drafter:
    """The drafter of ``head`` for ``plan`` (a :class:`~eagle.model.drafting.settings.TreePlan`, or one
    :class:`~eagle.model.drafting.settings.TreeSettings` for every batch size)."""
    from eagle.model.drafting.settings import TreeSettings

    plan = TreePlan(plan) if isinstance(plan, TreeSettings) else plan
    return build_drafter(head_spec(head, plan), DraftContext(head, plan))


_builtins_registered = False


def _register_builtins() -> None:
    """The drafters this package ships (registered on first use: no import-time work; a user's registration of the
    same name wins)."""
    global _builtins_registered
    if _builtins_registered:
        return
    _builtins_registered = True
    from eagle.model.drafting.eagle import head_drafter
    from eagle.model.drafting.lookup import LookupDrafter
    from eagle.model.drafting.none import NoDrafter

    DRAFTERS.setdefault("eagle3", lambda context: head_drafter(context, version=3))
    DRAFTERS.setdefault("eagle1", lambda context: head_drafter(context, version=1))
    DRAFTERS.setdefault("none", lambda context: NoDrafter())
    COMBINATORS.setdefault("lookup", LookupDrafter.around)
