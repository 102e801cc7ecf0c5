"""The logits of a tree verification as acceptance reads them: :class:`TreeLogits`, computed for every node
(:class:`NodeLogits`) or projected through the LM head when first read (:class:`LazyLogits`, grouped as a
:class:`LazyProjection` says)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


class TreeLogits:
    """The target's logits after each node of B draft trees (batch row b, node i), as acceptance reads them.

    - ``row(b)[i]``: the logits (V,) float after node ``i`` of batch row ``b``;
    - ``fetch(pairs)``: the (batch row, node) pairs about to be read, so that they are computed together (a
      no-op where every node's logits are computed already).
    """

    def row(self, batch_row: int):
        raise NotImplementedError

    def fetch(self, wanted: list[tuple[int, int]]) -> None:
        """Nothing to do: every node's logits are computed."""


class NodeLogits(TreeLogits):
    """Every node's logits, computed: ``rows[b]`` indexable by node (a (N, V) tensor, or anything that reads
    like one)."""

    def __init__(self, rows: Sequence):
        self.rows = list(rows)

    def row(self, batch_row: int):
        return self.rows[batch_row]


@dataclass(frozen=True)
class LazyProjection:
    """Which rows of a tree verification :class:`LazyLogits` projects through the LM head together.

    ``first``: for each batch row, the positions projected in the verification forward pass itself (position 0,
    the root, first); ``groups(b, i)``: the positions of batch row ``b`` projected together with position ``i``
    when it is read and not projected yet (``i`` first), e.g. the node's likeliest descendants, which acceptance
    reads next whenever the node is accepted."""

    first: list[list[int]]
    groups: Callable[[int, int], list[int]]

    def check(self, batch: int) -> None:
        """ValueError unless ``first`` gives, for each of ``batch`` rows, positions starting with 0."""
        if len(self.first) != batch or any(not rows or rows[0] != 0 for rows in self.first):
            raise ValueError(f"LazyProjection.first must give, for each of the {batch} rows, positions starting "
                             f"with 0; got {self.first}.")


class LazyLogits(TreeLogits):
    """Logits after each of T new positions of B rows, each (row, position) projected through the LM head when
    first read.

    On a CPU the LM head (hidden x vocabulary, e.g. 576 x 49,152) costs as much as several layers for every row of
    a draft tree, and acceptance reads only the rows on the accepted path: projecting those alone saves most of
    that cost.

    Reading the LM head's weights dominates a projection, so a few rows cost little more than one (timings:
    docs/PERFORMANCE.md). The rows read first are therefore projected in the verification forward pass
    (``first_rows``: the projection's ``first``), and a position read later is projected together with the
    positions its ``projection.groups`` names, so a long accepted path costs one or two projections instead of one
    per token, and a short one none. :meth:`fetch` projects what several batch rows read next in one call.

    ``logits[i]`` reads position ``i`` of batch row 0; ``logits.row(b)[i]`` of row ``b``.
    """

    def __init__(self, first_rows: dict[tuple[int, int], torch.Tensor], last_hidden: torch.Tensor, project,
                 projection: LazyProjection):
        self._rows = dict(first_rows)
        self._hidden = last_hidden  # (B, T, H)
        self._project = project
        self._groups = projection.groups

    def fetch(self, wanted: list[tuple[int, int]]) -> None:
        """Project, in one call, the (batch row, position) pairs not projected yet, each with its group."""
        todo: list[tuple[int, int]] = []
        for batch_row, index in wanted:
            if (batch_row, index) in self._rows:
                continue
            todo += [(batch_row, i) for i in self._groups(batch_row, index)
                     if (batch_row, i) not in self._rows and (batch_row, i) not in todo]
        if todo:
            rows, positions = zip(*todo)
            device = self._hidden.device
            projected = self._project(self._hidden[torch.tensor(rows, device=device), torch.tensor(positions, device=device)])
            self._rows.update(zip(todo, projected))

    def get(self, batch_row: int, index) -> torch.Tensor:
        key = (batch_row, int(index))
        if key not in self._rows:
            self.fetch([key])
        return self._rows[key]

    def row(self, batch_row: int) -> "_LazyRow":
        return _LazyRow(self, batch_row)

    def __getitem__(self, index) -> torch.Tensor:
        return self.get(0, index)


class _LazyRow:
    """One batch row of :class:`LazyLogits`, indexable by position."""

    def __init__(self, logits: LazyLogits, batch_row: int):
        self.logits, self.batch_row = logits, batch_row

    def __getitem__(self, index) -> torch.Tensor:
        return self.logits.get(self.batch_row, index)
