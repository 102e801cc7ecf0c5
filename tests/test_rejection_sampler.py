"""The verifier's sampling, alone, against the target distribution across random drafts: the check of vLLM's rejection
sampler test (tests/v1/sample/test_rejection_sampler.py: the empirical distribution of the emitted tokens against the
target's, over many random draft distributions, as close as the same number of direct draws from the target), in
this project's terms: ``accept_sampling`` on a random draft tree whose tokens are the likeliest of random draft
distributions, with random target distributions at every node.
"""

from __future__ import annotations

import pytest
import torch

from eagle.model.drafting.tree import tree_from_parents
from eagle.model.engine.acceptance import Sampler, accept_sampling
from test_sampling import chi_square_p_value

VOCAB = 8
CASES = 12
DRAWS = 1500


def random_case(generator: torch.Generator, related: bool = False):
    """A tree: the root, the 3 likeliest tokens of a random draft distribution as its children, the 2 likeliest of
    another for each child; random (sharp or flat) target logits after every node. ``related``: each draft
    distribution is the target's after that node plus noise (as a trained head's: its proposals are likely)."""
    sharpness = torch.rand(1 + 3 + 6, 1, generator=generator) * 3
    logits = torch.randn(1 + 3 + 6, VOCAB, generator=generator) * sharpness

    def draft_top(node, k):
        noise = torch.randn(VOCAB, generator=generator) * 2
        logp = torch.log_softmax(noise + (logits[node] if related else 0), dim=-1)
        return logp.topk(k)

    scores1, level1 = draft_top(0, 3)
    tokens, parents, scores = [0], [-1], [0.0]
    for i in range(3):
        tokens.append(int(level1[i]))
        parents.append(0)
        scores.append(float(scores1[i]))
    for i in range(3):
        scores2, level2 = draft_top(1 + i, 2)
        for j in range(2):
            tokens.append(int(level2[j]))
            parents.append(1 + i)
            scores.append(float(scores1[i] + scores2[j]))
    tree = tree_from_parents(torch.tensor(tokens), torch.tensor(parents), torch.tensor(scores))
    return tree, logits


def emitted(tree, logits, sampler) -> tuple[int, int | None, int | None]:
    """(first token, the node it was accepted at or None if it is the bonus, second token if the first was an
    accepted draft)."""
    path, bonus = accept_sampling(tree, logits, sampler)
    tokens = tree.tokens[path[1:]].tolist() + [int(bonus)]
    return tokens[0], (int(path[1]) if path.numel() > 1 else None), (tokens[1] if path.numel() > 1 else None)


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def test_emitted_tokens_follow_the_target_across_random_drafts():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    sampler = Sampler(temperature=1.0)
    ours, direct, p_values = [], [], []
    for case in range(CASES):
        tree, logits = random_case(generator, related=case % 2 == 1)
        probs = torch.softmax(logits, dim=-1)
        first = torch.zeros(VOCAB)
        second: dict[int, torch.Tensor] = {}
        for _ in range(DRAWS):
            token, node, after = emitted(tree, logits, sampler)
            first[token] += 1
            if node is not None:
                second.setdefault(node, torch.zeros(VOCAB))[after] += 1
        ours.append(total_variation(first, probs[0]))
        p_values.append(chi_square_p_value(first.double(), probs[0].double() * DRAWS))
        direct.append(total_variation(torch.bincount(torch.multinomial(probs[0], DRAWS, replacement=True),
                                                     minlength=VOCAB).float(), probs[0]))
        # after an accepted draft, the next token follows the target's distribution after that draft
        for node, counts in second.items():
            if counts.sum() >= 200:
                assert total_variation(counts, probs[node]) < 6 * (VOCAB / counts.sum()) ** 0.5 / 2, node
    # as close to the target as direct draws are, case by case and on average
    assert min(p_values) > 1e-4, p_values
    assert max(ours) < 0.08, ours
    assert sum(ours) / CASES < 1.5 * sum(direct) / CASES, (ours, direct)


@pytest.mark.parametrize("temperature,top_p,top_k", [(0.5, 0.0, 0), (1.0, 0.8, 0), (1.0, 0.0, 3)])
def test_emitted_tokens_follow_the_processed_target(temperature, top_p, top_k):
    """With temperature, top-p or top-k the emitted first token follows the processed target distribution."""
    generator = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    sampler = Sampler(temperature=temperature, top_p=top_p, top_k=top_k)
    tree, logits = random_case(generator, related=True)
    probs = sampler.probs(logits[:1])[0]
    first = torch.zeros(VOCAB)
    for _ in range(DRAWS):
        first[emitted(tree, logits, sampler)[0]] += 1
    assert float(first[probs == 0].sum()) == 0  # nothing outside the processed support
    assert total_variation(first, probs) < 0.06
