"""Verify and evaluate: one target forward over every row's draft tree, then the path each row accepts and the
token the target adds after it (greedy rows walked in lockstep, sampled rows by lossless recursive rejection).

Trees are padded to the largest row's node count (:class:`~eagle.model.drafting.tree.TreeBatch`; its ``valid``
marks the real nodes, which the linear backend computes alone, as it does a prefill's real prompt tokens).
"""

from __future__ import annotations

import torch

from eagle.model.drafting.tree import DraftTree, TreeBatch, likeliest_root_subtrees, likeliest_subtree, stack_trees
from eagle.model.engine.commit import Rows
from eagle.model.engine.acceptance import Sampler, verify_greedy, verify_greedy_batch, verify_sampling
from eagle.model.base.target import LazyLogits, Target

# Rows projected through the LM head at once (see LazyLogits): in the verification forward itself, the root and its
# likeliest descendants; later, a row read beyond those and its likeliest descendants. On a CPU 8 rows cost about
# 1.2 to 1.3 times one.
LAZY_PROJECTION_ROWS = 8


def prefill(target: Target, input_ids: torch.Tensor, cache, sampler: Sampler | None, with_features: bool,
            pads: list[int] | None = None):
    """Run the prompts (B, S), row b left-padded with ``pads[b]`` slots, into the empty cache. Returns (first new
    token of each row (B,), features (B, S, F) or None)."""
    length = input_ids.shape[1]
    positions, valid = torch.arange(length), None
    if pads and any(pads):
        slots = torch.arange(length, device=target.device)
        valid = slots >= torch.tensor(pads, device=target.device)[:, None]
        positions = (slots - torch.tensor(pads, device=target.device)[:, None]).clamp(min=0)
    out = target.forward(input_ids, cache, positions, last_logits_only=True, valid=valid, features=with_features)
    roots = choose_tokens(out.logits[:, -1], sampler)
    return roots, out.features


def choose_token(logits: torch.Tensor, sampler: Sampler | None) -> torch.Tensor:
    """logits (V,) -> next token (0-d): argmax when greedy, else a draw from the processed distribution."""
    if sampler is None:
        return logits.argmax()
    return sampler.draw(sampler.probs(logits[None])[0])


def choose_tokens(logits: torch.Tensor, sampler: Sampler | None) -> torch.Tensor:
    """logits (B, V) -> next token of each row (B,)."""
    if sampler is None:
        return logits.argmax(-1)
    return torch.stack([choose_token(row, sampler) for row in logits])


def verify_trees(target: Target, trees: TreeBatch, cache, rows: Rows, lazy_logits: bool = False,
                 features: bool = True):
    """Target forward over every row's tree, row b's nodes at positions (its committed tokens) + depth. Returns
    (logits: one indexable per row, node -> (V,); fetch (see :meth:`LazyLogits.fetch`) or None; features
    (B, N, F), or None when ``features`` is False or the target reads none).

    ``lazy_logits``: where the target allows it, the logits are :class:`~eagle.model.base.target.LazyLogits`: each
    tree's root and its likeliest descendants are projected with the forward pass, any other node when read
    (verification reads only the accepted paths') together with the likeliest nodes below it (see
    :func:`~eagle.model.drafting.tree.likeliest_subtree`)."""
    slots, device = cache.length, target.device
    valid, key_positions = rows.masks(slots, device)
    if valid is None and trees.padded:
        valid = torch.ones(len(rows.index), slots, dtype=torch.bool, device=device)
    if valid is not None:  # the committed slots, then the nodes: padding nodes are no row's tokens
        valid = torch.cat([valid, trees.valid.to(device)], dim=1)
    committed = torch.tensor([n - s for s, n in zip(rows.start, rows.length)], device=trees.depths.device)
    positions = trees.depths + committed[:, None]
    tree_mask = trees.ancestor_mask if trees.size > 1 else None
    lazy = lazy_logits and trees.size > 1
    first_rows = likeliest_root_subtrees(trees.trees, LAZY_PROJECTION_ROWS) if lazy else None
    out = target.forward(trees.tokens, cache, positions.cpu(), tree_mask=tree_mask, lazy_logits=lazy,
                         first_rows=first_rows, valid=valid, key_positions=key_positions, features=features)
    if isinstance(out.logits, LazyLogits):
        out.logits.rows_with = lambda row, node: likeliest_subtree(trees.trees[row], node, LAZY_PROJECTION_ROWS)
        return [out.logits.row(b) for b in range(len(trees.trees))], out.logits.fetch, out.features
    return list(out.logits), None, out.features


def verify_tree(target: Target, tree: DraftTree, cache, lazy_logits: bool = False):
    """One tree after a cache of one row: (logits indexable by node (N+1 rows of V), features (1, N+1, F) or
    None). See :func:`verify_trees`."""
    rows = Rows([0], [0], [cache.length])
    logits, _, features = verify_trees(target, stack_trees([tree]), cache, rows, lazy_logits)
    return logits[0], features


def evaluate(tree: DraftTree, logits, sampler: Sampler | None):
    """Accepted node ids (acc+1,) root first, and the target's next token after them."""
    if tree.size == 1:
        return torch.zeros(1, dtype=torch.long, device=tree.tokens.device), choose_token(logits[0], sampler)
    if sampler is None:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, sampler)


def evaluate_batch(trees: list[DraftTree], logits: list, fetch, sampler: Sampler | None):
    """:func:`evaluate` for every row: a list of (accepted node ids, next token). Greedy rows are walked in
    lockstep, so that the LM head projects what they read next together."""
    if sampler is None:
        return verify_greedy_batch(trees, logits, fetch)
    return [evaluate(tree, row_logits, sampler) for tree, row_logits in zip(trees, logits)]


def next_inputs(trees: TreeBatch, results: list, tree_features):
    """After evaluation: each row's new tokens (accepted drafts then the next token), and the drafter's next
    inputs: features (B, M, F) of the accepted nodes, the token after each (B, M), and which are real (B, M) bool,
    or None when every row accepted the same number (a batch of one)."""
    new = [torch.cat([tree.tokens[path[1:]], bonus.reshape(1)]) for tree, (path, bonus) in zip(trees.trees, results)]
    paths = [path for path, _ in results]
    width = max(tokens.shape[0] for tokens in new)
    if all(tokens.shape[0] == width for tokens in new):
        next_tokens, valid = torch.stack(new), None
        index = torch.stack(paths)
    else:
        next_tokens = torch.stack([torch.cat([t, t[-1:].expand(width - t.shape[0])]) for t in new])
        index = torch.stack([torch.cat([p, p[-1:].expand(width - p.shape[0])]) for p in paths])
        valid = torch.arange(width, device=index.device)[None] < torch.tensor([t.shape[0] for t in new],
                                                                              device=index.device)[:, None]
    features = None
    if tree_features is not None:
        index = index.to(tree_features.device)
        features = tree_features[torch.arange(index.shape[0], device=index.device)[:, None], index]
    return new, next_tokens, valid, features
