"""Greedy EAGLE replayed against recorded answers: what a tree setting would accept, without the target.

Greedy verification accepts the longest tree path whose tokens are the target's own greedy continuation, so once
that continuation is known the target is no longer needed to say what a tree would have accepted. :func:`record`
runs plain decoding once per prompt and one target forward over prompt + answer (the features the head reads);
:func:`replay` then runs the real drafter (head, tree selection, lookup branch) step by step and accepts what
matches the recorded answer. The simulator (``python -m eagle.evaluation.simulate``) and the tree tuner
(:mod:`eagle.model.tuning.autotune`) are built on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle.model.drafting.registry import drafter_for_head
from eagle.model.drafting.settings import TreeSettings
from eagle.model.engine.acceptance import greedy_path


@dataclass
class Recording:
    """A prompt and the target's greedy answer: tokens (S + n,) and the head's input features (1, S + n, F)."""

    prompt_length: int
    tokens: torch.Tensor
    features: torch.Tensor


@dataclass
class Replay:
    """Per draft/verify step: the draft tokens accepted and the tree size verified (root included)."""

    accept_lengths: list[int]
    tree_sizes: list[int]

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) + 1 if self.accept_lengths else 0.0

    @property
    def mean_tree_size(self) -> float:
        return sum(self.tree_sizes) / len(self.tree_sizes) if self.tree_sizes else 0.0


@torch.no_grad()
def record(model, input_ids: torch.Tensor, max_new_tokens: int) -> Recording:
    """Greedy answer to ``input_ids`` (1, S) by plain decoding, and the features of every position."""
    tokens = model.naivegenerate(input_ids, max_new_tokens=max_new_tokens)[0]
    target = model.engine.target
    cache = target.new_cache(tokens.shape[0])
    out = target.prefill(tokens[None], cache)
    return Recording(input_ids.shape[1], tokens, out.features)


@torch.no_grad()
def replay(head, recording: Recording, settings: TreeSettings) -> Replay:
    """Run the EAGLE drafter with ``settings`` over ``recording``, accepting what greedy verification would."""
    tokens, features, total = recording.tokens, recording.features, recording.tokens.shape[0]
    drafter = drafter_for_head(head, settings)
    drafter.reset()
    root = recording.prompt_length  # position of the tree's root: the last committed token
    new_features, next_tokens = features[:, :root], tokens[1 : root + 1][None]
    result = Replay([], [])
    while root < total - 1:
        tree = drafter.draft(new_features, next_tokens)
        answer = tokens[root + 1 :].tolist()  # what the target puts after a node at depth d is answer[d]
        depths = tree.depths.tolist()
        path, _ = greedy_path(tree, lambda node: answer[depths[node]] if depths[node] < len(answer) else -1)
        accepted = len(path) - 1
        result.accept_lengths.append(accepted)
        result.tree_sizes.append(tree.size)
        new_features = features[:, root : root + accepted + 1]
        next_tokens = tokens[root + 1 : root + accepted + 2][None]
        root += accepted + 1
    return result
