"""Draft trees for batches: the nodes a batch verifies per row shrink as the batch grows.

One verification forward carries every row's tree. On a GPU that costs little more than B tokens; on a CPU it
turns compute-bound as the rows' nodes add up, so the tree that is fastest for one sequence wastes time in a batch:
at batch 8 a row's 8-node tree plus a 16-token lookup branch is up to 8 x 24 rows per forward against plain
decoding's 8. A head therefore carries, besides its batch-1 tree (:mod:`eagle.model.head_tree`), the trees measured
fastest for batches, per kind of device, in its ``config.json``::

    "eagle_batch_tree": {
        "cpu": {"4": {"total_token": 6, "depth": 1, "top_k": 4, "lookup_tokens": 4},
                "8": {"total_token": 4, "depth": 1, "top_k": 3, "lookup_tokens": 0}}
    }

A key is the smallest batch size its tree applies to (up to the next key); batch sizes below every key use the
batch-1 tree. Each value holds the four settings of :class:`~eagle.model.drafter.TreeSettings` (a missing one
takes the batch-1 tree's); every row of the batch drafts that tree. With ``EagleDrafter.shared_budget = True``
they mean one node budget for a batch of B > 1 rows (:mod:`eagle.model.batch_budget`): the batch verifies B roots
plus ``B x (total_token - 1)`` draft nodes, taken by score over all rows' candidates (``depth`` and ``top_k`` say
how far the head grows them) and lookup chains (``lookup_tokens``: the longest chain a row may graft), so
``total_token`` is the mean tree size per row; a single row (batch 1, or the last row of a batch) verifies
``total_token`` nodes plus its chain, as a sequence alone. Configs written before the budget load unchanged. The loop re-chooses the
tree each step from the rows still generating, so the last rows of a batch get the larger trees of small batches.

``EaModel.from_pretrained`` reads them when no tree argument is given; an explicit tree (arguments, ``total_token=-1``
tuning, ``set_tree``, assigning ``tree_settings``) applies to every batch size, with the same budget meaning;
``EaModel.set_batch_trees`` sets per-batch trees again.
"""

from __future__ import annotations

from dataclasses import asdict

from .batch_budget import row_tree_limit
from .drafter import EagleDrafter, TreeSettings, tree_for_batch
from .head_tree import TREE_KEYS, check_tree_entry, device_kind

BATCH_TREE_FIELD = "eagle_batch_tree"
__all__ = ["BATCH_TREE_FIELD", "parse_batch_trees", "head_batch_trees", "check_batch_trees", "tree_for_batch",
           "largest_tree_size", "describe_batch_trees"]


def parse_batch_trees(value, base: TreeSettings, source: str = "the head's config.json"
                      ) -> dict[str, dict[int, TreeSettings]]:
    """Check an ``eagle_batch_tree`` field (None: none) and return ``{device kind: {smallest batch size:
    settings}}``, each entry's missing settings taken from ``base``."""
    if value is None:
        return {}
    expected = (f'expected {{"cpu": {{"4": {{"total_token": 6, "depth": 1, "top_k": 4, "lookup_tokens": 4}}, ...}}}}: '
                f"batch sizes >= 2 as keys, settings {', '.join(TREE_KEYS)}")
    if not isinstance(value, dict):
        raise ValueError(f"{BATCH_TREE_FIELD} in {source} must be an object by device kind; {expected}.")
    trees: dict[str, dict[int, TreeSettings]] = {}
    for kind, by_size in value.items():
        if not isinstance(by_size, dict):
            raise ValueError(f"{BATCH_TREE_FIELD}[{kind!r}] in {source} is {by_size!r}; {expected}.")
        trees[kind] = {}
        for size, tree in by_size.items():
            label = f"{BATCH_TREE_FIELD}[{kind!r}][{size!r}]"
            if not str(size).isdigit() or int(size) < 2:
                raise ValueError(f"{label} in {source} is {tree!r}; {expected}.")
            trees[kind][int(size)] = check_tree_entry(tree, label, source, expected, base)
    return trees


def head_batch_trees(config, device, base: TreeSettings) -> dict[int, TreeSettings]:
    """The batch trees a head's config (an ``EConfig`` or a dict) gives for ``device``'s kind; empty if none."""
    value = config.get(BATCH_TREE_FIELD) if isinstance(config, dict) else getattr(config, BATCH_TREE_FIELD, None)
    return parse_batch_trees(value, base).get(device_kind(device), {})


def check_batch_trees(trees) -> dict[int, TreeSettings]:
    """``{smallest batch size (>= 2): TreeSettings}`` checked, sorted by batch size."""
    if not isinstance(trees, dict):
        raise ValueError(f"Batch trees must be a dict {{smallest batch size: TreeSettings}}, got {trees!r}.")
    for size, tree in trees.items():
        if not isinstance(size, int) or isinstance(size, bool) or size < 2 or not isinstance(tree, TreeSettings):
            raise ValueError(f"Batch tree {size!r}: {tree!r}; expected a batch size >= 2 and a TreeSettings.")
    return dict(sorted(trees.items()))


def largest_tree_size(settings: TreeSettings, batch_trees: dict[int, TreeSettings] | None, batch_size: int) -> int:
    """The most nodes one row's tree can hold in a step of a batch that starts with ``batch_size`` rows (rows
    leave, so every smaller batch's tree counts; with ``EagleDrafter.shared_budget`` a row may take more than its
    share, see :func:`~eagle.model.batch_budget.row_tree_limit`)."""
    if not EagleDrafter.shared_budget:
        return max(tree_for_batch(settings, batch_trees, size).max_tree_size for size in range(1, batch_size + 1))
    return max(row_tree_limit(tree.total_token, tree.depth, tree.top_k, tree.lookup_tokens, size)
               for size in range(1, batch_size + 1)
               for tree in [tree_for_batch(settings, batch_trees, size)])


def describe_batch_trees(batch_trees: dict[int, TreeSettings]) -> str:
    return ", ".join(f"batch >= {size}: " + "/".join(str(v) for v in asdict(tree).values())
                     for size, tree in sorted(batch_trees.items())) or "the batch-1 tree for every batch size"
