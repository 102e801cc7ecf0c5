"""Draft trees for batches: the nodes a batch verifies per row shrink as the batch grows.

One verification forward carries every row's tree. On a GPU that costs little more than B tokens; on a CPU it
turns compute-bound as the rows' nodes add up, so the tree that is fastest for one sequence wastes time in a batch:
at batch 8 a row's 8-node tree plus a 16-token lookup branch is up to 8 x 24 rows per forward against plain
decoding's 8. A head therefore carries, besides its batch-1 tree (:mod:`eagle.model.tuning.head_tree`), the trees measured
fastest for batches, per kind of device, in its ``config.json``::

    "eagle_batch_tree": {
        "cpu": {"4": {"total_token": 6, "depth": 1, "top_k": 4, "lookup_tokens": 4},
                "8": {"total_token": 4, "depth": 1, "top_k": 3, "lookup_tokens": 0}}
    }

A key is the smallest batch size its tree applies to (up to the next key); batch sizes below every key use the
batch-1 tree. Batch trees apply only from the kind whose batch-1 tree was chosen (or a more specific one): the ``"cpu"`` batch
trees, measured with float32 weights, do not apply on the GGUF kernels where the head has a ``"cpu-gguf-int8"``
batch-1 tree of its own. Each value holds the four settings of :class:`~eagle.model.drafting.settings.TreeSettings` (a missing
one takes the batch-1 tree's); every row of the batch drafts that tree. The loop re-chooses the tree each step from
the rows still generating, so the last rows of a batch get the larger trees of small batches (the
:class:`~eagle.model.drafting.settings.TreePlan` the drafters read).

``EaModel.from_pretrained`` reads them when no tree argument is given; an explicit tree (arguments, ``total_token=-1``
tuning, ``set_tree``, assigning ``tree_settings``) applies to every batch size; ``EaModel.set_batch_trees`` sets
per-batch trees again.
"""

from __future__ import annotations

from eagle.model.drafting.settings import TreeSettings, largest_tree_size, tree_for_batch
from eagle.model.tuning.head_tree import TREE_KEYS, check_tree_entry, first_tree, head_tree_kind, tree_kinds

BATCH_TREE_FIELD = "eagle_batch_tree"
__all__ = ["BATCH_TREE_FIELD", "parse_batch_trees", "head_batch_trees", "tree_for_batch", "largest_tree_size"]


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


def head_batch_trees(config, device, base: TreeSettings, backend: str | None = None) -> dict[int, TreeSettings]:
    """The batch trees a head's config (an ``EConfig`` or a dict) gives for ``device``'s kind (with ``backend``: see
    :func:`~eagle.model.tuning.head_tree.tree_kinds`); empty if none."""
    value = config.get(BATCH_TREE_FIELD) if isinstance(config, dict) else getattr(config, BATCH_TREE_FIELD, None)
    return first_tree(parse_batch_trees(value, base), batch_tree_kinds(config, device, backend)) or {}


def batch_tree_kinds(config, device, backend: str | None = None) -> list[str]:
    """The kinds whose batch trees apply on ``device`` / ``backend``: those :func:`tree_kinds` lists, cut at the
    first kind that has a batch-1 tree (``eagle_tree``): batch trees measured on another kind's costs (the float32
    ``"cpu"`` ones under the int8 kernels' ``"cpu-gguf-int8"`` tree) would give batches larger trees than the
    batch-1 tree those costs chose."""
    kinds = tree_kinds(device, backend)
    chosen = head_tree_kind(config, device, backend)[0]
    return kinds if chosen is None else kinds[: kinds.index(chosen) + 1]
