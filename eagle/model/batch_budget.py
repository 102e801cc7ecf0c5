"""One draft-node budget for a whole batch, spent where the head is most confident (EAGLE-2's dynamic tree, across
rows).

For one sequence EAGLE-2 keeps the ``total_token - 1`` draft candidates of highest cumulative draft probability:
the expected number of tokens a step accepts is the sum of the kept nodes' path probabilities, and the best-scored
nodes maximise it. In a batch the same holds for the sum over rows, so instead of the same number of nodes per row
the batch takes ``B x (total_token - 1)`` nodes from all rows' candidates together: a row whose head is confident
gets a long chain, an unsure one little or nothing beyond its root (every row keeps its root, so it still advances
one token). Once the verification forward computes only the rows' real nodes (padding free), this is worth more
tokens per step for the same forward.

A row's lookup chain (:mod:`eagle.model.lookup`) competes for the same budget: its ``i``-th token is scored
``i x log(rate)``, where ``rate`` (:class:`LookupRate`) is a running estimate of how often a lookup token is
accepted after its predecessor was, for chains found by a context match of the same length; at most
``lookup_tokens`` of a chain are taken. Which nodes are verified never
changes what verification accepts, so greedy stays equal to plain decoding and sampling keeps the target's
distribution.
"""

from __future__ import annotations

import math

import torch

from .lookup import graft_chain
from .tree import DraftTree, tree_of_candidates

# How often a lookup token is accepted after its predecessor, by the length of the context match that gave the
# chain (find_match: 1, 2 or 3 tokens), on 16 MT-bench first turns with the embedded head (718 steps, offline);
# the estimate starts from them with the weight of PRIOR_TRIALS observations.
PRIOR_RATES = {1: 0.39, 2: 0.63, 3: 0.85}
DEFAULT_RATE = 0.5  # a match length without a prior (a longer one than the lookup searches)
PRIOR_TRIALS = 20.0
DECAY = 0.98  # per observation: the estimate follows the text being generated
MAX_RATE = 0.98  # a chain token's score must stay below its predecessor's


class LookupRate:
    """Running estimate of P(a lookup-chain token is accepted | the token before it was), by match length."""

    def __init__(self, priors: dict[int, float] | None = None, weight: float = PRIOR_TRIALS):
        self.weight = weight
        self.counts = {n: [rate * weight, weight] for n, rate in (PRIOR_RATES if priors is None else priors).items()}

    def rate(self, match: int) -> float:
        successes, trials = self.counts.get(match, (DEFAULT_RATE, 1.0))
        return min(max(successes / trials, 1e-3), MAX_RATE)

    def log_rate(self, match: int) -> float:
        return math.log(self.rate(match))

    def observe(self, chain: torch.Tensor, match: int, verified: int, committed: torch.Tensor) -> None:
        """A step drafted ``chain`` (the row's whole lookup continuation, from a ``match``-token context match)
        with its first ``verified`` tokens in the tree, and the row then committed ``committed`` (its accepted
        tokens and the target's next one). Counts the chain positions whose outcome is known whatever was
        verified: the first token after every correct one, up to one past the verified ones (the target's own next
        token tells that one)."""
        length = min(chain.numel(), committed.numel())
        wrong = (chain[:length] != committed[:length].to(chain.device)).nonzero()
        matched = int(wrong[0]) if wrong.numel() else length
        trials = min(matched + 1, verified + 1, chain.numel(), committed.numel())
        counts = self.counts.setdefault(match, [DEFAULT_RATE * self.weight, self.weight])
        counts[0] = counts[0] * DECAY + min(matched, trials)
        counts[1] = counts[1] * DECAY + trials


def select_batch_trees(roots: torch.Tensor, cand_tokens: torch.Tensor, cand_scores: torch.Tensor,
                       cand_parents: torch.Tensor, budget: int, chains: list[torch.Tensor | None] | None = None,
                       log_rates: list[float] | None = None) -> tuple[list[DraftTree], list[int]]:
    """The B rows' trees from one budget of ``budget`` draft nodes (roots not counted).

    roots (B,); cand_tokens / cand_scores / cand_parents (B, C) each row's candidates as for
    :func:`~eagle.model.tree.select_tree`; chains: each row's lookup chain or None, its ``i``-th token (from 1)
    scored ``i x log_rates[row]`` (< 0; default log 0.5). The ``budget`` best scores over all rows are kept (ties: earlier row, earlier
    candidate); within a row a child scores no higher than its parent and comes later, so every kept node's parent
    is kept, and a chain is kept from its start. Returns the trees and how many chain tokens each row grafted."""
    batch, count = cand_scores.shape
    chains = chains or [None] * batch
    longest = max((c.numel() for c in chains if c is not None), default=0)
    scores = cand_scores.float()
    if longest:
        rates = torch.tensor(log_rates or [math.log(DEFAULT_RATE)] * batch, device=scores.device, dtype=scores.dtype)
        steps = torch.arange(1, longest + 1, device=scores.device, dtype=scores.dtype)
        steps = steps[None] * rates.clamp(max=math.log(MAX_RATE))[:, None]  # (B, longest)
        lengths = torch.tensor([0 if c is None else c.numel() for c in chains], device=scores.device)
        chain_scores = torch.where(torch.arange(longest, device=scores.device)[None] < lengths[:, None],
                                   steps, torch.full_like(steps, -math.inf))
        scores = torch.cat([scores, chain_scores], dim=1)
    flat = scores.flatten()
    budget = min(max(budget, 0), int(torch.isfinite(flat).sum()))
    chosen = torch.sort(flat, descending=True, stable=True).indices[:budget]
    kept = torch.zeros_like(flat, dtype=torch.bool)
    kept[chosen] = True
    kept = kept.view(batch, -1)
    trees, grafted = [], []
    for b in range(batch):
        nodes = kept[b, :count].nonzero()[:, 0]
        tree = tree_of_candidates(roots[b], cand_tokens[b], cand_scores[b], cand_parents[b], nodes)
        taken = int(kept[b, count:].sum())
        if taken:
            tree = graft_chain(tree, chains[b][:taken])
        trees.append(tree)
        grafted.append(taken)
    return trees, grafted


def row_tree_limit(total_token: int, depth: int, top_k: int, lookup_tokens: int, rows: int) -> int:
    """The most nodes one row's tree can hold (root included) when ``rows`` rows share a budget of
    ``rows x (total_token - 1)`` draft nodes (one row: ``total_token`` plus its chain, as for one sequence)."""
    if rows <= 1:
        return total_token + lookup_tokens
    candidates = top_k + depth * top_k * top_k
    return 1 + min(rows * (total_token - 1), candidates + lookup_tokens)
