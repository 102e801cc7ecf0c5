"""The one generation loop. Plain decoding is the same loop with a drafter that proposes nothing.

Each step is four named functions of explicit inputs: draft (drafter), verify (target forward over the tree),
evaluate (accept a path), commit (keep the accepted KV entries and emit tokens).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from .target import LazyLogits, Target
from .tree import DraftTree, likeliest_subtree
from .verify import Sampler, verify_greedy, verify_sampling


# Rows projected through the LM head at once (see LazyLogits): in the verification forward itself, the root and its
# likeliest descendants; later, a row read beyond those and its likeliest descendants. On a CPU 8 rows cost about
# 1.2 to 1.3 times one.
LAZY_PROJECTION_ROWS = 8


@dataclass
class Step:
    """What one step emits: tokens (n,) on the target device, and how many of them came from accepted drafts
    (``accepted = n - 1`` for a full verification step, 0 for the prefill's first token; truncation at a stop token
    or the token budget can shorten ``tokens``)."""

    tokens: torch.Tensor
    accepted: int


def prefill(target: Target, input_ids: torch.Tensor, cache, sampler: Sampler | None, with_features: bool):
    """Run the prompt (1, S) into the empty cache. Returns (first new token (0-d), features (1, S, F) or None)."""
    length = input_ids.shape[1]
    out = target.forward(input_ids, cache, torch.arange(length), last_logits_only=True)
    root = choose_token(out.logits[-1], sampler)
    return root, (out.features if with_features else None)


def choose_token(logits: torch.Tensor, sampler: Sampler | None) -> torch.Tensor:
    """logits (V,) -> next token (0-d): argmax when greedy, else a draw from the processed distribution."""
    if sampler is None:
        return logits.argmax()
    return sampler.draw(sampler.probs(logits[None])[0])


def verify_tree(target: Target, tree: DraftTree, cache, lazy_logits: bool = False):
    """Target forward over the tree at positions prefix + depth. Returns (logits (N+1, V), features or None).

    ``lazy_logits``: where the target allows it, the logits are :class:`~eagle.model.target.LazyLogits`: the root
    and its likeliest descendants are projected in the forward pass, any other row when read (verification reads
    only the accepted path's) together with the likeliest nodes below it (see
    :func:`~eagle.model.tree.likeliest_subtree`)."""
    positions = tree.depths + cache.length
    tree_mask = tree.ancestor_mask if tree.size > 1 else None
    lazy = lazy_logits and tree.size > 1
    first_rows = likeliest_subtree(tree, 0, LAZY_PROJECTION_ROWS) if lazy else None
    out = target.forward(tree.tokens[None], cache, positions.cpu(), tree_mask=tree_mask, lazy_logits=lazy,
                         first_rows=first_rows)
    if isinstance(out.logits, LazyLogits):
        out.logits.rows_with = lambda node: likeliest_subtree(tree, node, LAZY_PROJECTION_ROWS)
    return out.logits, out.features


def evaluate(tree: DraftTree, logits: torch.Tensor, sampler: Sampler | None):
    """Accepted node ids (acc+1,) root first, and the target's next token after them."""
    if tree.size == 1:
        return torch.zeros(1, dtype=torch.long, device=tree.tokens.device), choose_token(logits[0], sampler)
    if sampler is None:
        return verify_greedy(tree, logits)
    return verify_sampling(tree, logits, sampler)


def commit(cache, prefix_length: int, path: torch.Tensor) -> None:
    """Keep the KV entries of the accepted nodes right after the committed prefix; drop the rest of the tree."""
    if path.numel() == 1:  # the root is already in place
        cache.crop(prefix_length + 1)
    else:
        cache.keep_path(path + prefix_length, prefix_length)


@torch.no_grad()  # on a generator: entered around each resumption, so the caller's grad mode is left alone
def speculative_decode(
    target: Target,
    drafter,
    cache,
    input_ids: torch.Tensor,
    sampler: Sampler | None,
    max_new_tokens: int,
    max_length: int,
    stop_token_ids: set[int],
) -> Iterator[Step]:
    """Generate after ``input_ids`` (1, S). Yields one :class:`Step` per target forward pass.

    Stops after the first stop token (included), after ``max_new_tokens`` tokens, or when the sequence reaches
    ``max_length``. Invariant between steps: the cache holds the committed tokens except the last emitted one
    (the root), which the next tree starts from.
    """
    budget = min(max_new_tokens, max_length - input_ids.shape[1])
    if budget <= 0:
        return
    drafter.reset()
    cache.crop(0)
    root, features = prefill(target, input_ids, cache, sampler, drafter.needs_features)
    next_tokens = torch.cat([input_ids[0, 1:].to(root.device), root.reshape(1)])[None]
    emitted = 0
    new = root.reshape(1)
    accepted = 0
    while True:
        new, done = _truncate(new, budget - emitted, stop_token_ids)
        emitted += new.shape[0]
        yield Step(tokens=new, accepted=min(accepted, new.shape[0]))
        if done or emitted >= budget:
            return
        tree = drafter.draft(features, next_tokens)  # rooted at the last emitted token
        prefix_length = cache.length
        logits, tree_features = verify_tree(target, tree, cache, lazy_logits=True)
        path, bonus = evaluate(tree, logits, sampler)
        commit(cache, prefix_length, path)
        drafted = tree.tokens[path[1:]]
        new = torch.cat([drafted, bonus.reshape(1)])
        accepted = drafted.shape[0]
        next_tokens = new[None]
        if tree_features is not None:
            features = tree_features[:, path.to(tree_features.device)]


def _truncate(tokens: torch.Tensor, room: int, stop_token_ids: set[int]) -> tuple[torch.Tensor, bool]:
    """Cut ``tokens`` after the first stop token and to at most ``room`` tokens; say whether generation ends."""
    values = tokens.tolist()
    for i, token in enumerate(values[:room]):
        if token in stop_token_ids:
            return tokens[: i + 1], True
    return tokens[:room], len(values) >= room
