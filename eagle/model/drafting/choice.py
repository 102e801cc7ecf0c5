"""The drafter a model generates with, chosen by name: :class:`DrafterChoice`, the API a model face (``EaModel``)
shares over its engine (:meth:`~eagle.model.engine.engine.Engine.drafter_spec`, the one place a spec is resolved
and checked)."""

from __future__ import annotations

from eagle.model.drafting.registry import reference_drafter, runnable_drafters


class DrafterChoice:
    """``drafter`` (the default spec), ``runnable_drafters()`` and ``check_drafter()`` of an object with an
    ``engine`` (an :class:`~eagle.model.engine.engine.Engine`) and the head it drafts with, ``ea_layer``."""

    @property
    def drafter(self) -> str:
        """The default drafter spec: the one chosen (``from_pretrained(drafter=...)``, or assigned), else the head's
        own (``"eagle3"`` / ``"eagle1"``, with ``+lookup`` when some tree grafts lookup chains), else ``"none"``.
        Assigning a spec checks it against the head; None restores the head's own."""
        return self.engine.drafter_spec(None)

    @drafter.setter
    def drafter(self, spec: str | None) -> None:
        self.engine.set_drafter(spec)

    def runnable_drafters(self) -> list[str]:
        """Every drafter spec this model can run, its head's first (see
        :func:`~eagle.model.drafting.registry.runnable_drafters`)."""
        return runnable_drafters(self.ea_layer)

    def check_drafter(self, drafter: str | None = None, use_eagle: bool | None = None) -> str:
        """The spec a call with ``drafter`` (or the reference's ``use_eagle``, its alias; neither: :attr:`drafter`)
        runs; a ``ValueError`` saying why this model cannot run it, and what it can run."""
        return self.engine.drafter_spec(reference_drafter(drafter, use_eagle=use_eagle))
