"""``total_token=-1``: choose the tree size by timing tree verification on the device the model runs on.

On a GPU verifying 60 tokens costs about as much as one, so big trees win; on a CPU every extra tree token costs
time (see PERFORMANCE_NOTES), so small trees win. We time one verification pass per candidate size over a
realistic prefix, in the same code path generation uses, and maximise expected tokens per second under a simple
acceptance model: a tree of n nodes yields about ``1 + ACCEPT_SCALE * log2(n)`` tokens per step, capped by the
depth (``depth + 2`` tokens at most).
"""

from __future__ import annotations

import logging
import math
import time

import torch

from eagle.utils.device import synchronize

from .generation import verify_tree
from .tree import tree_from_parents

logger = logging.getLogger(__name__)

CANDIDATES = (4, 8, 12, 16, 24, 32, 48, 64)
ACCEPT_SCALE = 0.8
PREFIX = 256
REPEATS = 3


def expected_tokens(size: int, depth: int) -> float:
    """Modelled tokens per step for a tree of ``size`` nodes (root included)."""
    return min(1.0 + ACCEPT_SCALE * math.log2(size), depth + 2.0)


def time_verification(model, size: int, prefix: int = PREFIX, repeats: int = REPEATS) -> float:
    """Median seconds of one verification of a ``size``-node tree after a ``prefix``-token context: the target
    forward plus the logits rows an accepted path of the modelled length reads (on a CPU only those rows go
    through the LM head, see ``LazyLogits``)."""
    target = model._eagle_target
    vocab = model.vocab_size
    device = model.device
    cache = target.new_cache(prefix + size + 1)
    generator = torch.Generator().manual_seed(0)
    context = torch.randint(0, vocab, (1, prefix), generator=generator).to(device)
    # a bushy tree: node i hangs from node (i - 1) // top_k
    top_k = max(model.tree_settings.top_k, 1)
    parents = torch.tensor([-1] + [(i - 1) // top_k for i in range(1, size)])
    tree = tree_from_parents(torch.randint(0, vocab, (size,), generator=generator).to(device), parents.to(device),
                             torch.zeros(size, device=device))
    depth = model.tree_settings.depth
    path = tree.retrieve_indices[0][: max(1, round(expected_tokens(size, depth)))].tolist()
    path = [node for node in path if node >= 0]
    timings = []
    with torch.no_grad():
        target.forward(context, cache, torch.arange(prefix), last_logits_only=True)
        for _ in range(repeats + 1):  # the first run warms up
            cache.crop(prefix)
            synchronize(device)
            start = time.perf_counter()
            logits, _ = verify_tree(target, tree, cache, lazy_logits=True)
            for node in path:
                logits[node].argmax()
            synchronize(device)
            timings.append(time.perf_counter() - start)
    return sorted(timings[1:])[len(timings[1:]) // 2]


def choose_total_token(model, candidates=CANDIDATES) -> int:
    """The candidate size with the best modelled tokens per second on this device."""
    depth = model.tree_settings.depth
    best, best_rate = candidates[0], -1.0
    for size in candidates:
        seconds = time_verification(model, size)
        rate = expected_tokens(size, depth) / seconds
        logger.info("tree of %d tokens: verification %.1f ms, modelled %.2f tokens/step", size, seconds * 1e3,
                    expected_tokens(size, depth))
        if rate > best_rate:
            best, best_rate = size, rate
    return best
