"""Acceptance (the step's "evaluate" phase, after the verification forward pass): which path of a draft tree the
target accepts, and the token it adds after it (greedy rows walked in lockstep, sampled rows by lossless recursive
rejection); then each row's new tokens and the drafter's next inputs (:class:`~eagle.model.engine.handoffs.
StepResult`).

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

from eagle.model.base.logits import NodeLogits, TreeLogits
from eagle.model.drafting.tree import DraftTree, TreeBatch, children_by_token
from eagle.model.engine.greedy import GREEDY_TEMPERATURE
from eagle.model.engine.handoffs import Accepted, DraftInput, StepResult


def prepare_logits_processor(temperature: float = 0.0, repetition_penalty: float = 0.0, top_p: float = 0.0,
                             top_k: int = 0) -> LogitsProcessorList:
    """Reference semantics: empty (greedy) unless temperature > :data:`GREEDY_TEMPERATURE`; top-p on when 1e-8 <= top_p < 1, top-k on
    when top_k > 0 (0 means off); top-p is applied before top-k."""
    processors = LogitsProcessorList()
    if temperature > GREEDY_TEMPERATURE:
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
        self.temperature = float(temperature)
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


def accept_greedy(tree: DraftTree, logits) -> Accepted:
    """logits: target logits after each node, indexable by node id (a (N+1, V) tensor, or a row of
    :class:`~eagle.model.base.logits.LazyLogits`, which projects only the rows read here). Returns the accepted
    node ids (acc+1,), root first, and the bonus token: the target's argmax after the last accepted node.

    Walks down from the root: a child is accepted when its token is the target's argmax after its parent. Only the
    rows of the accepted path are read (accepted + 1 of them)."""
    return accept_greedy_batch([tree], NodeLogits([logits]))[0]


def accept_greedy_batch(trees: list[DraftTree], logits: TreeLogits) -> list[Accepted]:
    """:func:`accept_greedy` for B trees walked in lockstep: at each depth the rows still walking read their
    current node's logits together (``logits.fetch([(row, node), ...])`` first, which projects the unread ones in
    one call where they are lazy)."""
    children = [children_by_token(tree) for tree in trees]
    nodes = [0] * len(trees)
    paths: list[list[int]] = [[0] for _ in trees]
    results: list = [None] * len(trees)
    walking = list(range(len(trees)))
    rows = [logits.row(row) for row in walking]
    while walking:
        logits.fetch([(row, nodes[row]) for row in walking])
        predicted = torch.stack([rows[row][nodes[row]] for row in walking]).argmax(-1)
        still = []
        for token, row, value in zip(predicted, walking, predicted.tolist()):
            child = children[row].get(nodes[row], {}).get(value)
            if child is None:
                device = trees[row].tokens.device
                results[row] = Accepted(torch.tensor(paths[row], device=device), token.to(device))
            else:
                nodes[row] = child
                paths[row].append(child)
                still.append(row)
        walking = still
    return results


def accept_sampling(tree: DraftTree, logits, sampler: Sampler) -> Accepted:
    """Lossless recursive rejection over the tree. Returns (accepted node ids root first, bonus token).
    ``logits`` as in :func:`accept_greedy`: only the rows of the visited nodes are read."""
    parents = tree.parents.tolist()
    order = torch.argsort(tree.scores, descending=True, stable=True).tolist()
    children: dict[int, list[int]] = {}
    for node in order:  # siblings by descending draft score
        if parents[node] >= 0:
            children.setdefault(parents[node], []).append(node)
    path, bonus_probs = recursive_rejection(children, tree.tokens.tolist(), lambda node: logits[node], sampler)
    return Accepted(torch.tensor(path, device=tree.tokens.device), sampler.draw(bonus_probs))


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


def evaluate(tree: DraftTree, logits, sampler: Sampler | None) -> Accepted:
    """Accepted node ids (acc+1,) root first, and the target's next token after them."""
    if tree.size == 1:
        return Accepted(torch.zeros(1, dtype=torch.long, device=tree.tokens.device), choose_token(logits[0], sampler))
    if sampler is None:
        return accept_greedy(tree, logits)
    return accept_sampling(tree, logits, sampler)


def evaluate_batch(trees: list[DraftTree], logits: TreeLogits, sampler: Sampler | None) -> list[Accepted]:
    """:func:`evaluate` for every row. Greedy rows are walked in lockstep, so that the LM head projects what they
    read next together."""
    if sampler is None:
        return accept_greedy_batch(trees, logits)
    return [evaluate(tree, logits.row(b), sampler) for b, tree in enumerate(trees)]


def step_result(trees: TreeBatch, accepted: list[Accepted], tree_features: torch.Tensor | None) -> StepResult:
    """After evaluation: each row's new tokens (accepted drafts then the next token), and the drafter's next
    inputs: features (B, M, F) of the accepted nodes (``tree_features`` (B, N, F) at every node, or None), the
    token after each (B, M), and which are real (B, M) bool, or None when every row accepted the same number (a
    batch of one)."""
    new = [torch.cat([tree.tokens[path[1:]], bonus.reshape(1)]) for tree, (path, bonus) in zip(trees.trees, accepted)]
    paths = [path for path, _ in accepted]
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
    return StepResult(new, DraftInput(features, next_tokens, valid))


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
