"""Verification: which path of a draft tree the target accepts, and the token it adds after it.

Greedy: the longest root-to-leaf prefix whose every token is the target's argmax after its parent.
Sampling: recursive rejection with point-mass proposals (EAGLE_SPEC section 6.3): at each node the children are
tried in order of draft score, child x accepted with probability residual(x), where the residual is the target
distribution at that node with already rejected siblings removed and renormalised; the bonus token is drawn
from the residual (or from the full target distribution after a leaf). This emits exactly the target's
(processed) distribution. Randomness comes from torch, so ``torch.manual_seed`` or a generator reproduces a run.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from eagle.model.drafting.tree import DraftTree, children_by_token


def prepare_logits_processor(temperature: float = 0.0, repetition_penalty: float = 0.0, top_p: float = 0.0,
                             top_k: int = 0) -> LogitsProcessorList:
    """Reference semantics: empty (greedy) unless temperature > 1e-5; top-p on when 1e-8 <= top_p < 1, top-k on
    when top_k > 0 (0 means off); top-p is applied before top-k."""
    processors = LogitsProcessorList()
    if temperature > 1e-5:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if repetition_penalty > 1.0:
            raise ValueError("repetition_penalty is not supported: it would make sampling depend on the draft tree.")
        if 1e-8 <= top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
        if top_k > 0:
            processors.append(TopKLogitsWarper(int(top_k)))
    return processors


class Sampler:
    """Turns target logits into the processed distribution and draws from it."""

    def __init__(self, temperature: float, top_p: float = 0.0, top_k: int = 0, generator: torch.Generator | None = None):
        self.processors = prepare_logits_processor(temperature, top_p=top_p, top_k=top_k)
        self.generator = generator

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (n, V) -> probabilities (n, V), float32."""
        return torch.softmax(self.processors(None, logits.float()), dim=-1)

    def draw(self, probs: torch.Tensor) -> torch.Tensor:
        """probs (V,) -> a token id (0-d)."""
        return torch.multinomial(probs, 1, generator=self.generator)[0]

    def uniform(self, device) -> float:
        return float(torch.rand((), generator=self.generator, device=self.generator.device if self.generator else device))


def greedy_path(tree: DraftTree, next_token) -> tuple[list[int], object]:
    """Walk down from the root while the node has a child carrying ``next_token(node)`` (the token the target
    puts after that node). Returns the node ids walked, root first, and ``next_token`` of the last one."""
    children = children_by_token(tree)
    node, path = 0, [0]
    while True:
        predicted = next_token(node)
        child = children.get(node, {}).get(int(predicted))
        if child is None:
            return path, predicted
        node = child
        path.append(node)


def verify_greedy(tree: DraftTree, logits) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: target logits after each node, indexable by node id (a (N+1, V) tensor, or
    :class:`~eagle.model.base.target.LazyLogits`, which projects only the rows read here). Returns the accepted node ids
    (acc+1,), root first, and the bonus token: the target's argmax after the last accepted node.

    Walks down from the root: a child is accepted when its token is the target's argmax after its parent. Only the
    rows of the accepted path are read (accepted + 1 of them)."""
    return verify_greedy_batch([tree], [logits])[0]


def verify_greedy_batch(trees: list[DraftTree], logits: list, fetch=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`verify_greedy` for B trees walked in lockstep: at each depth the rows still walking read their
    current node's logits together (``fetch([(row, node), ...])``, when given, projects the unread ones in one
    call; see :meth:`~eagle.model.base.target.LazyLogits.fetch`). logits: one indexable per tree."""
    children = [children_by_token(tree) for tree in trees]
    nodes = [0] * len(trees)
    paths: list[list[int]] = [[0] for _ in trees]
    results: list = [None] * len(trees)
    walking = list(range(len(trees)))
    while walking:
        if fetch is not None:
            fetch([(row, nodes[row]) for row in walking])
        predicted = torch.stack([logits[row][nodes[row]] for row in walking]).argmax(-1)
        still = []
        for token, row, value in zip(predicted, walking, predicted.tolist()):
            child = children[row].get(nodes[row], {}).get(value)
            if child is None:
                device = trees[row].tokens.device
                results[row] = (torch.tensor(paths[row], device=device), token.to(device))
            else:
                nodes[row] = child
                paths[row].append(child)
                still.append(row)
        walking = still
    return results


def verify_sampling(tree: DraftTree, logits, sampler: Sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """Lossless recursive rejection over the tree. Returns (accepted node ids root first, bonus token).
    ``logits`` as in :func:`verify_greedy`: only the rows of the visited nodes are read."""
    parents = tree.parents.tolist()
    order = torch.argsort(tree.scores, descending=True, stable=True).tolist()
    children: dict[int, list[int]] = {}
    for node in order:  # siblings by descending draft score
        if parents[node] >= 0:
            children.setdefault(parents[node], []).append(node)
    path, bonus_probs = recursive_rejection(children, tree.tokens.tolist(), lambda node: logits[node], sampler)
    return torch.tensor(path, device=tree.tokens.device), sampler.draw(bonus_probs)


def recursive_rejection(children: dict[int, list[int]], tokens: list[int], logits_at, sampler: Sampler):
    """The sampling walk itself, over any tree given as ``children`` (node -> child nodes in the order they are
    tried), ``tokens`` (node -> token id) and ``logits_at(node)`` (the target's logits (V,) after that node),
    from root node 0.

    Returns the accepted node ids, root first, and the probabilities (V,) the bonus token is drawn from: the
    residual where a child was rejected, the full target distribution after a leaf."""
    node, path = 0, [0]
    while True:
        probs = sampler.probs(logits_at(node)[None])[0]
        kids = children.get(node)
        if not kids:
            return path, probs
        residual = probs
        accepted = None
        for child in kids:
            token = tokens[child]
            if sampler.uniform(residual.device) < float(residual[token]):
                accepted = child
                break
            residual = residual.clone()
            residual[token] = 0.0
            total = residual.sum()
            if float(total) <= 0.0:  # nothing left but numerical dust; the target's own distribution decides
                residual = probs
                break
            residual = residual / total
        if accepted is None:
            return path, residual
        node = accepted
        path.append(node)
