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
name replaces the earlier one). :func:`check_drafter` and :func:`runnable_drafters` say which specs a model (its
head, or none) can run: every place a user names a drafter (``EaModel``, the server, the web UI, the commands, the
benchmark) checks it there.

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
#: drafter name -> the EAGLE version of the head it drafts with (a drafter not named here needs no head).
HEAD_VERSIONS: dict[str, int] = {"eagle3": 3, "eagle1": 1}
#: plain decoding's spec.
NONE = "none"
#: the spec of the model's own head's drafter (``"eagle3"`` / ``"eagle1"``, see :func:`head_spec`).
HEAD = "head"


def register_drafter(name: str, factory: DrafterFactory, head_version: int | None = None) -> None:
    """Make ``factory(context) -> Drafter`` buildable as ``name`` (see :func:`build_drafter`); ``head_version``:
    the EAGLE version of the head it needs (None: it runs without a head)."""
    if not name or "+" in name:
        raise ValueError(f"A drafter name must be non-empty and without '+', got {name!r}.")
    DRAFTERS[name] = factory
    HEAD_VERSIONS.pop(name, None)
    if head_version is not None:
        HEAD_VERSIONS[name] = head_version


def known_drafters() -> str:
    """The registry's names and combinators in one phrase, for error messages and help texts."""
    combinators = ", ".join("+" + name for name in sorted(COMBINATORS))
    return f"{', '.join(sorted(DRAFTERS))} and the combinators {combinators} (\"NAME+COMBINATOR\", or one alone)"


class UnknownDrafter(ValueError):
    """A spec that names no registered drafter or combinator: ``problem`` is the sentence naming the part that is
    wrong; the message adds the known names."""

    def __init__(self, problem: str):
        self.problem = problem
        super().__init__(f"{problem}; available: {known_drafters()}.")


def spec_parts(spec: str) -> list[str]:
    """``spec``'s drafter then its combinators (``"lookup"`` -> ``["none", "lookup"]``); :class:`UnknownDrafter` (a
    ``ValueError``) listing the known names for an unknown part or a spec that is not a non-empty string."""
    if not isinstance(spec, str) or not spec.strip():
        raise UnknownDrafter(f"A drafter must be a name such as 'eagle3' or 'none', not {spec!r}")
    names = [name.strip() for name in spec.strip().split("+")]
    if names[0] in COMBINATORS:
        names.insert(0, NONE)
    if names[0] not in DRAFTERS:
        raise UnknownDrafter(f"Unknown drafter {names[0]!r} in {spec!r}")
    for name in names[1:]:
        if name not in COMBINATORS:
            raise UnknownDrafter(f"Unknown drafter combinator {name!r} in {spec!r}")
    return names


def canonical_spec(parts: list[str]) -> str:
    """The one spelling of a spec's parts: ``"none+lookup"`` is ``"lookup"``."""
    return "+".join(parts[1:] if parts[0] == NONE and len(parts) > 1 else parts)


def canonical(spec: str) -> str:
    """``spec`` in its one spelling (``"none+lookup"`` -> ``"lookup"``); ``ValueError`` as :func:`spec_parts`."""
    return canonical_spec(spec_parts(spec))


def spec_head_version(spec: str) -> int | None:
    """The EAGLE version of the head ``spec``'s drafter drafts with (None: it needs no head; ``"eagle3+lookup"``
    -> 3); ``ValueError`` as :func:`spec_parts`."""
    return HEAD_VERSIONS.get(spec_parts(spec)[0])


def head_version(head) -> int | None:
    """The EAGLE version of ``head`` (None: no head)."""
    return None if head is None else int(head.eagle_version)


def runnable_drafters(head) -> list[str]:
    """Every spec a model with ``head`` (None: loaded without one) can run: each drafter it can run, alone and
    with each combinator (``"none"``'s combinations spelled as the combinator alone), the head's own first."""
    version = head_version(head)
    bases = [name for name in DRAFTERS if HEAD_VERSIONS.get(name, version) == version]
    bases.sort(key=lambda name: name not in HEAD_VERSIONS)  # the head's drafter, then the rest in registry order
    specs = (canonical_spec([base, *extra]) for base in bases for extra in ([], *([name] for name in COMBINATORS))
             if extra != [base])  # a drafter that is also a combinator ("suffix") does not wrap itself
    return list(dict.fromkeys(specs))  # "suffix" alone and "none+suffix" are one spec


def check_drafter(spec: str, head) -> str:
    """``spec`` in its one spelling if a model with ``head`` (None: no head) can run it; else a ``ValueError``
    saying why (an unknown name, with the known ones; a drafter needing an EAGLE head the model lacks or has in
    the other version) and which drafters it can run."""
    def runnable() -> str:  # only for the error: every call of a generation method checks its spec
        return ", ".join(runnable_drafters(head))

    try:
        parts = spec_parts(spec)
    except ValueError as err:
        raise ValueError(f"{str(err)[:-1]}; this model can run: {runnable()}.") from None
    needed, version = HEAD_VERSIONS.get(parts[0]), head_version(head)
    if needed is not None and version is None:
        raise ValueError(f"The drafter {spec!r} drafts with an EAGLE-{needed} head, and this model was loaded "
                         f"without an EAGLE head; it can run: {runnable()}.")
    if needed is not None and needed != version:
        raise ValueError(f"The drafter {spec!r} needs an EAGLE-{needed} head, but this model's head is EAGLE-"
                         f"{version} (the two versions read different target features and are not "
                         f"interchangeable); it can run: {runnable()}.")
    return canonical_spec(parts)


def build_drafter(spec: str, context: DraftContext) -> Drafter:
    """The drafter ``spec`` names: a registered drafter, optionally followed by ``+COMBINATOR`` parts
    (``"eagle3+lookup"``); a combinator alone wraps ``"none"`` (``"lookup"`` is prompt-lookup decoding)."""
    names = spec_parts(spec)
    drafter = DRAFTERS[names[0]](context)
    for name in names[1:]:
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


def reference_drafter(drafter: str | None = None, *, use_eagle: bool | None = None,
                      use_eagle3: bool | None = None) -> str | None:
    """The drafter spec a call names, the reference's booleans read as aliases: ``use_eagle=True`` is the head's own
    drafter (:data:`HEAD`), ``use_eagle=False`` plain decoding (``"none"``); ``use_eagle3`` (which head version
    loads) names no drafter but must agree with ``drafter``'s head. None: the model's default. ``ValueError`` when
    a boolean contradicts ``drafter``."""
    if use_eagle is not None:
        alias = HEAD if use_eagle else NONE
        if drafter is not None and (NONE if drafter == NONE else HEAD) != alias:
            raise ValueError(f"use_eagle={use_eagle} contradicts drafter={drafter!r}: pass drafter alone "
                             "(use_eagle=False is drafter='none').")
        drafter = alias if drafter is None else drafter
    if use_eagle3 is None or drafter in (None, HEAD):
        return drafter
    needed = spec_head_version(drafter)
    if needed is not None and (needed == 3) != use_eagle3:
        raise ValueError(f"use_eagle3={use_eagle3} loads an EAGLE-{3 if use_eagle3 else 1} head, which cannot run "
                         f"drafter={drafter!r}: pass drafter alone.")
    return drafter
