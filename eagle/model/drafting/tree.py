"""Draft trees: the data structure, and its construction from scored candidates (EAGLE-2 dynamic tree).

A tree has ``N + 1`` nodes; node 0 is the root (the token the target already chose), and every other node is a
draft token whose parent has a smaller index. All structure is derived with tensor operations (no Python loop
over nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DraftTree:
    """tokens: (N+1,) target ids, node 0 = root; parents: (N+1,) parent node index (-1 for the root);
    depths: (N+1,) root 0; ancestor_mask: (N+1, N+1) bool, row i marks i and its ancestors;
    retrieve_indices: (leaves, max_depth + 1) node ids along each root-to-leaf path, -1 padded on the right;
    scores: (N+1,) cumulative draft log-probabilities (root 0), used to order siblings."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    retrieve_indices: torch.Tensor
    scores: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[0]


def root_only_tree(root: torch.Tensor) -> DraftTree:
    """The tree of plain decoding: just the root."""
    return root_only_trees(root.reshape(1))[0]


def root_only_trees(roots: torch.Tensor) -> list[DraftTree]:
    """:func:`root_only_tree` for each of B roots (B,); the trees share their constant fields (never written)."""
    device = roots.device
    zero = torch.zeros(1, dtype=torch.long, device=device)
    parents, mask = zero - 1, torch.ones(1, 1, dtype=torch.bool, device=device)
    retrieve, scores = zero.reshape(1, 1), torch.zeros(1, device=device)
    return [DraftTree(root, parents, zero, mask, retrieve, scores) for root in roots.reshape(-1, 1)]


def tree_from_parents(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> DraftTree:
    """Complete a tree given its nodes. tokens/parents/scores: (N+1,), parents[0] = -1, parents[i] < i. All
    structure is derived with tensor operations (see :func:`trees_from_parents`)."""
    return trees_from_parents(tokens[None], parents[None], scores[None])[0]


def likeliest_subtree(tree: DraftTree, node: int, limit: int) -> list[int]:
    """``node`` and at most ``limit - 1`` of its descendants, the best-scored first: the rows a verifier that
    accepts ``node`` is likeliest to read next."""
    below = tree.ancestor_mask[:, node].clone()
    below[node] = False
    descendants = below.nonzero()[:, 0]
    best = descendants[torch.argsort(tree.scores[descendants], descending=True, stable=True)[: limit - 1]]
    return [node] + best.tolist()


def likeliest_root_subtrees(trees: list[DraftTree], limit: int) -> list[list[int]]:
    """``likeliest_subtree(tree, 0, limit)`` for each of B trees, ranked for all of them at once (every node
    descends from the root, so a row ranks all its nodes but the root; a smaller tree's missing nodes rank last)."""
    size = max(tree.size for tree in trees)
    if all(tree.size == size for tree in trees):
        scores = torch.stack([tree.scores for tree in trees])
    else:
        scores = torch.full((len(trees), size), -float("inf"), dtype=trees[0].scores.dtype,
                            device=trees[0].scores.device)
        for row, tree in enumerate(trees):
            scores[row, : tree.size] = tree.scores
    best = (torch.argsort(scores[:, 1:], dim=1, descending=True, stable=True)[:, : limit - 1] + 1).tolist()
    return [[0] + row[: tree.size - 1] for row, tree in zip(best, trees)]


def select_tree(
    root: torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_scores: torch.Tensor,
    cand_parents: torch.Tensor,
    num_nodes: int,
) -> DraftTree:
    """Keep the ``num_nodes`` best candidates by cumulative score and build the tree (EAGLE-2 re-ranking).

    cand_tokens/cand_scores/cand_parents: (C,) candidates in generation order; cand_parents[c] is the candidate
    index of c's parent (-1 when the parent is the root) and always < c. Because a child's cumulative log-prob
    never exceeds its parent's and the sort is stable (earlier index first among equal scores), every kept node's
    parent is kept too, even with exact ties.
    """
    num_nodes = min(num_nodes, cand_tokens.shape[0])
    order = torch.sort(cand_scores, descending=True, stable=True).indices[:num_nodes]
    return tree_of_candidates(root, cand_tokens, cand_scores, cand_parents, order.sort().values)


def tree_of_candidates(root: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
                       cand_parents: torch.Tensor, kept: torch.Tensor) -> DraftTree:
    """The tree of the candidates ``kept`` (ascending candidate indices, every one's parent kept too) below
    ``root``; candidates as in :func:`select_tree`."""
    num_nodes = kept.shape[0]
    # node id of candidate c = position in `kept` + 1 (0 is the root)
    node_of = torch.full((cand_tokens.shape[0] + 1,), -1, dtype=torch.long, device=kept.device)
    node_of[kept] = torch.arange(1, num_nodes + 1, device=kept.device)
    node_of[-1] = 0  # index -1 (parent = root) maps to node 0
    parents = torch.cat([torch.tensor([-1], device=kept.device), node_of[cand_parents[kept]]])
    if bool((parents[1:] < 0).any()):
        raise RuntimeError("Draft tree selection kept a node without its parent; this is a bug.")
    tokens = torch.cat([root.reshape(1), cand_tokens[kept]])
    scores = torch.cat([torch.zeros(1, device=cand_scores.device, dtype=cand_scores.dtype), cand_scores[kept]])
    return tree_from_parents(tokens, parents, scores)


def select_trees(roots: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
                 cand_parents: torch.Tensor, num_nodes: int) -> list[DraftTree]:
    """:func:`select_tree` for each of B rows (roots (B,), candidates (B, C) each), computed for all rows at once:
    the same trees, node for node and field for field, as the row-by-row path."""
    batch, count = cand_tokens.shape
    num_nodes = min(num_nodes, count)
    device = cand_tokens.device
    order = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices[:, :num_nodes]
    kept = order.sort(dim=1).values  # (B, n) ascending candidate indices
    # node id of candidate c = position in `kept` + 1; index C (parent = root) maps to node 0
    node_of = torch.full((batch, count + 1), -1, dtype=torch.long, device=device)
    node_of.scatter_(1, kept, torch.arange(1, num_nodes + 1, device=device).expand(batch, num_nodes))
    node_of[:, count] = 0
    kept_parents = cand_parents.gather(1, kept)
    kept_parents = torch.where(kept_parents < 0, torch.full_like(kept_parents, count), kept_parents)
    parents = torch.cat([torch.full((batch, 1), -1, dtype=torch.long, device=device),
                         node_of.gather(1, kept_parents)], dim=1)
    if bool((parents[:, 1:] < 0).any()):
        raise RuntimeError("Draft tree selection kept a node without its parent; this is a bug.")
    tokens = torch.cat([roots.reshape(batch, 1), cand_tokens.gather(1, kept)], dim=1)
    scores = torch.cat([cand_scores.new_zeros(batch, 1), cand_scores.gather(1, kept)], dim=1)
    return trees_from_parents(tokens, parents, scores)


# Trees of at most this many nodes on the CPU derive their structure from Python lists: a handful of tensors built
# once instead of a few dozen tensor operations, the same fields bit for bit (see _small_trees_from_parents).
SMALL_TREE_NODES = 32


def trees_from_parents(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> list[DraftTree]:
    """:func:`tree_from_parents` for B trees of the same node count at once: tokens/parents/scores (B, N+1)."""
    if tokens.shape[1] <= SMALL_TREE_NODES and tokens.device.type == "cpu":
        trees = _small_trees_from_parents(tokens, parents, scores)
        if trees is not None:
            return trees
    return _tensor_trees_from_parents(tokens, parents, scores)


def _small_trees_from_parents(tokens: torch.Tensor, parents: torch.Tensor,
                              scores: torch.Tensor) -> list[DraftTree] | None:
    """:func:`trees_from_parents` by walking each row's parent list in Python (None when a parent does not
    precede its node: the tensor path handles any order)."""
    batch, size = tokens.shape
    masks, depths, retrieves = [], [], []
    for row in parents.tolist():
        ancestors: list[list[bool]] = []
        depth: list[int] = []
        has_child = [False] * size
        for node, parent in enumerate(row):
            if parent >= node or (parent < 0 and node > 0):
                return None
            marks = list(ancestors[parent]) if parent >= 0 else [False] * size
            marks[node] = True
            ancestors.append(marks)
            depth.append(depth[parent] + 1 if parent >= 0 else 0)
            if parent >= 0:
                has_child[parent] = True
        width = max(depth) + 1
        paths = []
        for node in range(size):
            if not has_child[node]:  # a leaf: its ancestors, root first (node ids ascend along a path)
                path = [i for i in range(size) if ancestors[node][i]]
                paths.append(path + [-1] * (width - len(path)))
        masks.append(ancestors)
        depths.append(depth)
        retrieves.append(torch.tensor(paths, dtype=torch.long))
    masks, depths = torch.tensor(masks, dtype=torch.bool), torch.tensor(depths, dtype=torch.long)
    return [DraftTree(tokens[b], parents[b], depths[b], masks[b], retrieves[b], scores[b]) for b in range(batch)]


def _tensor_trees_from_parents(tokens: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> list[DraftTree]:
    """:func:`trees_from_parents` with tensor operations only (any device, any node order)."""
    batch, size = tokens.shape
    device = tokens.device
    nodes = torch.arange(size, device=device)
    ancestor_mask = torch.eye(size, dtype=torch.bool, device=device).repeat(batch, 1, 1)
    current = parents.clone()
    # Walk up one generation per iteration over all rows (at most the deepest row's depth iterations).
    has = current >= 0
    while bool(has.any()):  # a row that has reached the root marks its own diagonal again (already set)
        ancestor_mask.scatter_(2, torch.where(has, current, nodes)[:, :, None], True)
        current = torch.where(has, parents.gather(1, current.clamp(min=0)), current)
        has = current >= 0
    depths = ancestor_mask.sum(2) - 1

    is_parent = torch.zeros(batch, size + 1, dtype=torch.bool, device=device)
    is_parent.scatter_(1, torch.where(parents >= 0, parents, torch.full_like(parents, size)), True)
    is_leaf = ~is_parent[:, :size]
    leaf_rows, leaf_nodes = is_leaf.nonzero(as_tuple=True)
    counts_and_depths = torch.stack([is_leaf.sum(1), depths.max(1).values]).tolist()
    # A path's node ids ascend from root to leaf, so sorting each leaf's ancestor set gives the path in order.
    big = size + 1
    paths = torch.where(ancestor_mask[leaf_rows, leaf_nodes], nodes[None, :], torch.full_like(nodes, big)[None, :])
    paths = paths.sort(dim=1).values
    paths = torch.where(paths == big, torch.full_like(paths, -1), paths)
    trees = []
    for b, (row_paths, max_depth) in enumerate(zip(paths.split(counts_and_depths[0]), counts_and_depths[1])):
        trees.append(DraftTree(tokens[b], parents[b], depths[b], ancestor_mask[b], row_paths[:, : max_depth + 1],
                               scores[b]))
    return trees


@dataclass
class TreeBatch:
    """B trees padded to the same node count for one verification forward pass.

    tokens, depths: (B, N); ancestor_mask: (B, N, N); valid: (B, N) bool, which nodes are real (row b's first
    ``trees[b].size``). A padding node (beyond a row's own tree) carries the row's root token at depth 0 and sees
    only itself, and no real node sees it: its KV entry is written and dropped, and the target's linear layers skip
    it (see :func:`~eagle.model.backends.linear.real_rows_only`)."""

    trees: list[DraftTree]
    tokens: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    valid: torch.Tensor

    @property
    def size(self) -> int:
        return self.tokens.shape[1]

    @property
    def padded(self) -> bool:
        """Whether some row's tree is smaller than the batch's largest."""
        return any(tree.size < self.size for tree in self.trees)


def stack_trees(trees: list[DraftTree]) -> TreeBatch:
    """Pad ``trees`` to the largest one's node count (see :class:`TreeBatch`)."""
    size = max(tree.size for tree in trees)
    device = trees[0].tokens.device
    valid = torch.arange(size, device=device)[None] < torch.tensor([t.size for t in trees], device=device)[:, None]
    if all(tree.size == size for tree in trees):
        return TreeBatch(trees, torch.stack([t.tokens for t in trees]), torch.stack([t.depths for t in trees]),
                         torch.stack([t.ancestor_mask for t in trees]), valid)
    tokens = torch.stack([t.tokens[:1].expand(size) for t in trees]).clone()
    depths = torch.zeros(len(trees), size, dtype=trees[0].depths.dtype, device=device)
    ancestors = torch.eye(size, dtype=torch.bool, device=device).repeat(len(trees), 1, 1)
    for row, tree in enumerate(trees):
        tokens[row, : tree.size] = tree.tokens
        depths[row, : tree.size] = tree.depths
        ancestors[row, : tree.size, : tree.size] = tree.ancestor_mask
    return TreeBatch(trees, tokens, depths, ancestors, valid)


def children_by_token(tree: DraftTree) -> dict[int, dict[int, int]]:
    """node -> {draft token: child node}. Siblings carry distinct tokens (each level is a top-k); were two equal,
    the first (smaller node id) would be kept."""
    children: dict[int, dict[int, int]] = {}
    for node, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist())):
        if parent >= 0:
            children.setdefault(parent, {}).setdefault(token, node)
    return children


def merge_below_root(tree: DraftTree, tokens: list[int], parents: list[int]) -> tuple[list[int], list[int]]:
    """Where the nodes of a trie land when it is merged into ``tree`` below the root. ``tokens`` / ``parents``: the
    trie's nodes, parents first (-1: the root, else an earlier index). A node whose token is already a child of
    where its parent landed follows that child; the others become new nodes, numbered from ``tree.size`` on in the
    trie's order. Returns the node each trie node landed on and the parent of each new node."""
    children = children_by_token(tree) if tree.size > 1 else {}
    landed: list[int] = []
    new_parents: list[int] = []
    for token, parent in zip(tokens, parents):
        above = landed[parent] if parent >= 0 else 0
        node = children.setdefault(above, {}).get(token)
        if node is None:
            node = children[above][token] = tree.size + len(new_parents)
            new_parents.append(above)
        landed.append(node)
    return landed, new_parents
