"""Draft tree settings: the tree of one sequence (:class:`TreeSettings`) and the trees of batches (:class:`TreePlan`).

A verification forward carries every row's tree, so on a CPU the tree that is fastest for one sequence wastes time in
a batch. A :class:`TreePlan` holds the batch-1 tree and, per smallest batch size, the tree a batch of that many rows
drafts with (re-chosen each step from the rows still generating). It is the one settings object the drafters read;
``EaModel`` replaces it when the user changes a tree (it is frozen: nothing changes it in place).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TreeSettings:
    """total_token: nodes verified per step including the root (N + 1); depth: draft expansion steps after the
    first (the tree has up to depth + 1 draft levels); top_k: children kept per expanded node and nodes expanded
    per level; lookup_tokens: at most this many tokens copied from earlier in the context are grafted onto the
    tree (see :mod:`eagle.model.drafting.lookup`; 0 = off, the reference's behaviour), so a step may verify up to
    ``total_token + lookup_tokens`` nodes."""

    total_token: int = 60
    depth: int = 7
    top_k: int = 10
    lookup_tokens: int = 0

    def __post_init__(self):
        if self.total_token < 1 or self.depth < 0 or self.top_k < 1 or self.lookup_tokens < 0:
            raise ValueError(
                f"Invalid tree settings total_token={self.total_token}, depth={self.depth}, top_k={self.top_k}, "
                f"lookup_tokens={self.lookup_tokens}: expected total_token >= 1, depth >= 0, top_k >= 1, "
                "lookup_tokens >= 0 (total_token=-1, tuning the tree on this device, is an argument of "
                "EaModel.from_pretrained and the commands, not a tree)."
            )

    @property
    def max_tree_size(self) -> int:
        """The most nodes one step verifies (root included)."""
        return self.total_token + self.lookup_tokens

    def describe(self) -> str:
        return (f"total_token={self.total_token} depth={self.depth} top_k={self.top_k} "
                f"lookup_tokens={self.lookup_tokens}")


def check_batch_trees(trees) -> dict[int, TreeSettings]:
    """``{smallest batch size (>= 2): TreeSettings}`` checked, sorted by batch size."""
    if not isinstance(trees, dict):
        raise ValueError(f"Batch trees must be a dict {{smallest batch size: TreeSettings}}, got {trees!r}.")
    for size, tree in trees.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 2 or not isinstance(tree, TreeSettings):
            raise ValueError(f"Batch tree {size!r}: {tree!r}; expected a batch size >= 2 and a TreeSettings.")
    return dict(sorted(trees.items()))


def tree_for_batch(settings: TreeSettings, batch_trees: dict[int, TreeSettings] | None,
                   batch_size: int) -> TreeSettings:
    """The tree for ``batch_size`` rows: the entry of ``batch_trees`` ({smallest batch size: settings}) with the
    largest key <= ``batch_size``, else ``settings`` (the batch-1 tree)."""
    chosen = settings
    for size, tree in sorted((batch_trees or {}).items()):
        if size <= batch_size:
            chosen = tree
    return chosen


def largest_tree_size(settings: TreeSettings, batch_trees: dict[int, TreeSettings] | None, batch_size: int) -> int:
    """The most nodes one row's tree can hold in a step of a batch that starts with ``batch_size`` rows (rows leave,
    so every smaller batch's tree counts)."""
    return max(tree_for_batch(settings, batch_trees, size).max_tree_size for size in range(1, batch_size + 1))


@dataclass(frozen=True)
class TreePlan:
    """The trees every drafter reads: ``batch1`` for one sequence (and every batch size ``by_batch`` has no entry
    for), ``by_batch`` ``{smallest batch size (>= 2): TreeSettings}``."""

    batch1: TreeSettings = field(default_factory=TreeSettings)
    by_batch: dict[int, TreeSettings] = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.batch1, TreeSettings):
            raise ValueError(f"The batch-1 tree must be a TreeSettings, got {self.batch1!r}.")
        object.__setattr__(self, "by_batch", check_batch_trees(self.by_batch))

    def for_batch(self, batch_size: int) -> TreeSettings:
        """The tree ``batch_size`` rows draft with."""
        return tree_for_batch(self.batch1, self.by_batch, batch_size)

    def largest_tree(self, batch_size: int) -> int:
        """The most nodes a row's tree holds in a batch that starts with ``batch_size`` rows."""
        return largest_tree_size(self.batch1, self.by_batch, batch_size)

    @property
    def looks_up(self) -> bool:
        """Whether some batch size's tree grafts prompt-lookup chains."""
        return any(tree.lookup_tokens for tree in (self.batch1, *self.by_batch.values()))

    def describe_batches(self) -> str:
        return ", ".join(f"batch >= {size}: " + "/".join(str(v) for v in asdict(tree).values())
                         for size, tree in self.by_batch.items()) or "the batch-1 tree for every batch size"
