"""The drafters by name: :data:`DRAFTERS`, :func:`register_drafter`, :func:`build_drafter`.

Drafters are built by name from :data:`DRAFTERS` (``"eagle3"``, ``"eagle1"``: an EAGLE head's dynamic tree;
``"none"``: the root alone, i.e. plain decoding); a spec ``"NAME+lookup"`` wraps a drafter in prompt lookup
(:class:`~eagle.model.drafting.lookup.LookupDrafter`, from :data:`COMBINATORS`), which grafts a chain copied from
earlier in the context onto whatever the inner drafter proposes (``"none+lookup"``, or ``"lookup"``, is
prompt-lookup decoding alone); ``"NAME+suffix"`` likewise merges a suffix-decoding tree
(:class:`~eagle.model.drafting.suffix.SuffixDrafter`: continuations of the context's longest repeated suffix, in the
row and in the model's store of earlier outputs, scored by frequency) into the inner drafter's tree (``"suffix"`` is
suffix decoding alone). A new drafter kind is a class with the methods of
:class:`~eagle.model.drafting.protocol.Drafter` and one :func:`register_drafter` call (a later registration of a
name replaces the earlier one).

This module imports the drafters and :mod:`eagle.model.drafting.protocol`; they import only the protocol, so the
modules depend one way.
"""

from __future__ import annotations

from collections.abc import Callable

from eagle.model.drafting.eagle import head_drafter
from eagle.model.drafting.lookup import LookupDrafter
from eagle.model.drafting.none import NoDrafter
from eagle.model.drafting.protocol import DraftContext, Drafter, DrafterFactory
from eagle.model.drafting.settings import TreePlan, TreeSettings
from eagle.model.drafting.suffix import SuffixDrafter

#: name -> factory(context) of a drafter. The docs' lists of drafters are checked against these keys
#: (tests/test_docs_registries.py).
DRAFTERS: dict[str, DrafterFactory] = {
    "eagle3": lambda context: head_drafter(context, version=3),
    "eagle1": lambda context: head_drafter(context, version=1),
    "none": lambda context: NoDrafter(),
    "suffix": lambda context: SuffixDrafter.around(context, NoDrafter()),
}
#: name -> wrap(context, inner drafter): ``"INNER+name"`` builds ``wrap(context, inner)``.
COMBINATORS: dict[str, Callable[[DraftContext, Drafter], Drafter]] = {"lookup": LookupDrafter.around,
                                                                      "suffix": SuffixDrafter.around}


def register_drafter(name: str, factory: DrafterFactory) -> None:
    """Make ``factory(context) -> Drafter`` buildable as ``name`` (see :func:`build_drafter`)."""
    if not name or "+" in name:
        raise ValueError(f"A drafter name must be non-empty and without '+', got {name!r}.")
    DRAFTERS[name] = factory


def build_drafter(spec: str, context: DraftContext) -> Drafter:
    """The drafter ``spec`` names: a registered drafter, optionally followed by ``+COMBINATOR`` parts
    (``"eagle3+lookup"``); a combinator alone wraps ``"none"`` (``"lookup"`` is prompt-lookup decoding)."""
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


def drafter_for_head(head, plan: TreePlan | TreeSettings) -> Drafter:
    """The drafter of ``head`` for ``plan`` (a :class:`~eagle.model.drafting.settings.TreePlan`, or one
    :class:`~eagle.model.drafting.settings.TreeSettings` for every batch size)."""
    plan = TreePlan(plan) if isinstance(plan, TreeSettings) else plan
    return build_drafter(head_spec(head, plan), DraftContext(head, plan))
