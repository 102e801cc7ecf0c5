"""What the reference's generation methods return, built from the loop's steps: the ids (B, S + T) at the end
(``eagenerate``), or after each step (``ea_generate``), with the reference's ``log=True`` counts."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from eagle.model.engine.request import GenerationRequest
from eagle.model.engine.steps import BatchStep


def collect(steps: Iterable[BatchStep], request: GenerationRequest, log: bool):
    """The ids (B, S + T) after ``steps``; with ``log``, ``(ids, new_tokens, idx)``: each row's new tokens and the
    reference's ``idx``, the 0-based index of its last draft/verify cycle (plain ints for one sequence, lists of B
    ints for a batch)."""
    new: list[list[int]] = [[] for _ in range(request.batch_size)]
    cycles = [-1] * request.batch_size  # the prefill's step is not a draft/verify cycle
    for step in steps:
        for row, tokens in enumerate(step.tokens):
            if tokens.numel():
                new[row] += tokens.tolist()
                cycles[row] += 1
    ids = request.output_ids(new)
    if not log:
        return ids
    counts, idx = [len(tokens) for tokens in new], [max(c - 1, 0) for c in cycles]
    return (ids, counts[0], idx[0]) if request.batch_size == 1 else (ids, counts, idx)


def stream(steps: Iterable[BatchStep], request: GenerationRequest) -> Iterator[torch.Tensor]:
    """The ids (B, S + T so far) after each step (rows behind the longest filled with the pad token)."""
    new: list[list[int]] = [[] for _ in range(request.batch_size)]
    for step in steps:
        for row, tokens in enumerate(step.tokens):
            new[row] += tokens.tolist()
        yield request.output_ids(new)
