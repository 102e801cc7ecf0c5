"""The target's forward passes in the generation loop: the prefill of joining rows, and one verification forward
pass over every row's draft tree (acceptance, what each row keeps of it, is :mod:`eagle.model.engine.acceptance`).

Trees are padded to the largest row's node count (:class:`~eagle.model.drafting.tree.TreeBatch`; its ``valid``
marks the real nodes, which the linear backend computes alone, as it does a prefill's real prompt tokens).
"""

from __future__ import annotations

import torch

from eagle.model.base.logits import LazyProjection, NodeLogits, TreeLogits
from eagle.model.base.target import Target
from eagle.model.drafting.tree import DraftTree, TreeBatch, likeliest_root_subtrees, likeliest_subtree, stack_trees
from eagle.model.engine.acceptance import Sampler, choose_tokens
from eagle.model.engine.commit import Rows
from eagle.model.engine.handoffs import DraftInput, VerifyOutput

# Rows projected through the LM head at once (see LazyLogits): in the verification forward itself, the root and its
# likeliest descendants; later, a row read beyond those and its likeliest descendants. On a CPU 8 rows cost about
# 1.2 to 1.3 times one.
LAZY_PROJECTION_ROWS = 8


def prefill(target: Target, input_ids: torch.Tensor, cache, sampler: Sampler | None, with_features: bool,
            pads: list[int] | None = None) -> DraftInput:
    """Run the prompts (B, S), row b left-padded with ``pads[b]`` slots, into the empty cache and choose each row's
    first new token. Returns what the drafter observes first: the prompt's features (B, S, F) (None unless
    ``with_features``), the token after each slot (the prompt's next, then the new token: the row's root) and
    which slots are real (None without padding)."""
    return prefill_step(target, input_ids, cache, sampler, with_features, pads)[0]


def prefill_step(target: Target, input_ids: torch.Tensor, cache, sampler: Sampler | None, with_features: bool,
                 pads: list[int] | None = None) -> tuple[DraftInput, torch.Tensor]:
    """:func:`prefill`, and the logits (B, V) each row's first new token was chosen from."""
    valid = None
    if pads and any(pads):
        slots = torch.arange(input_ids.shape[1], device=target.device)
        valid = slots >= torch.tensor(pads, device=target.device)[:, None]
    out = target.prefill(input_ids, cache, valid=valid, features=with_features)
    roots = choose_tokens(out.logits[:, -1], sampler)
    next_tokens = torch.cat([input_ids[:, 1:].to(roots.device), roots[:, None]], dim=1)
    return DraftInput(out.features, next_tokens, None if valid is None else valid.to(roots.device)), out.logits[:, -1]


def tree_projection(trees: list[DraftTree]) -> LazyProjection:
    """Which rows a lazy verification projects together: each tree's root and its likeliest descendants in the
    forward pass; a node read later with its likeliest descendants (see
    :func:`~eagle.model.drafting.tree.likeliest_subtree`)."""
    return LazyProjection(likeliest_root_subtrees(trees, LAZY_PROJECTION_ROWS),
                          lambda row, node: likeliest_subtree(trees[row], node, LAZY_PROJECTION_ROWS))


def verify_trees(target: Target, trees: TreeBatch, cache, rows: Rows, lazy_logits: bool = False,
                 features: bool = True) -> VerifyOutput:
    """Target forward over every row's tree, row b's nodes at positions (its committed tokens) + depth
    (:meth:`Target.verify <eagle.model.base.target.Target.verify>`; trees that are their root alone, as in plain
    decoding, :meth:`Target.decode <eagle.model.base.target.Target.decode>`). Features (B, N, F), or None when
    ``features`` is False or the target reads none.

    ``lazy_logits``: where the target allows it, the logits are :class:`~eagle.model.base.logits.LazyLogits`: each
    tree's root and its likeliest descendants are projected with the forward pass, any other node when read
    (acceptance reads only the accepted paths') together with the likeliest nodes below it
    (:func:`tree_projection`)."""
    slots, device = cache.length, target.device
    valid, key_positions = rows.masks(slots, device)
    if valid is None and trees.padded:
        valid = torch.ones(len(rows.index), slots, dtype=torch.bool, device=device)
    if valid is not None:  # the committed slots, then the nodes: padding nodes are no row's tokens
        valid = torch.cat([valid, trees.valid.to(device)], dim=1)
    committed = torch.tensor([n - s for s, n in zip(rows.start, rows.length)], device=trees.depths.device)
    positions = (trees.depths + committed[:, None]).cpu()
    if trees.size == 1:
        out = target.decode(trees.tokens, cache, positions, valid=valid, key_positions=key_positions,
                            features=features)
    else:
        out = target.verify(trees.tokens, cache, positions, trees.ancestor_mask, valid=valid,
                            key_positions=key_positions, features=features,
                            projection=tree_projection(trees.trees) if lazy_logits else None)
    logits = out.logits if isinstance(out.logits, TreeLogits) else NodeLogits(out.logits)
    return VerifyOutput(logits, out.features)


def verify_tree(target: Target, tree: DraftTree, cache, lazy_logits: bool = False):
    """One tree after a cache of one row: (logits indexable by node (N+1 rows of V), features (1, N+1, F) or
    None). See :func:`verify_trees`."""
    rows = Rows([0], [0], [cache.length])
    out = verify_trees(target, stack_trees([tree]), cache, rows, lazy_logits)
    return out.logits.row(0), out.features
