"""Sampling keeps the base model's distribution: the first tokens EAGLE emits (the first from the prefill, the next
from speculation) follow the exact joint distribution, enumerated from the target, under a chi-square test."""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle.model.ea_model import EaModel
from eagle.model.verify import prepare_logits_processor
from tiny_models import make_head, make_target, train_head_quickly

RUNS = 800
NEW_TOKENS = 3


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    model = make_target(root / "base", "llama", seed=21, layers=4)
    make_head(root / "head", model, eagle3=True, seed=22)
    prompts = train_head_quickly(root / "base", root / "head", eagle3=True, steps=120)
    eagle = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(root / "head"),
                                    total_token=10, depth=3, top_k=4)
    reference = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    return eagle, reference, prompts[0:1]


def exact_distribution(reference, prompt, processors, length):
    """{token tuple: probability} of the first `length` tokens of ancestral sampling, by enumeration over the
    support (tokens with probability > 1e-6 after the processors)."""
    dist = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, p in dist.items():
            ids = torch.cat([prompt[0], torch.tensor(prefix, dtype=torch.long)])[None]
            with torch.no_grad():
                logits = reference(ids).logits[0, -1:].float()
            probs = torch.softmax(processors(None, logits), dim=-1)[0]
            for token in (probs > 1e-6).nonzero().flatten().tolist():
                nxt[prefix + (token,)] = p * float(probs[token])
        dist = nxt
    return dist


def chi_square_p_value(observed: dict, expected: dict, runs: int) -> float:
    """p-value of Pearson's test; cells expected fewer than 5 times are pooled into one."""
    big = [cell for cell, p in expected.items() if p * runs >= 5]
    obs = [observed.get(cell, 0) for cell in big]
    exp = [expected[cell] * runs for cell in big]
    rest_exp = runs - sum(exp)
    rest_obs = runs - sum(obs)
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        assert rest_obs <= max(5, 3 * rest_exp), "many samples fell in cells the target almost never produces"
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.mark.parametrize(
    "temperature,top_p,top_k,length,lookup_tokens",
    [(0.6, 0.0, 0, 2, 0), (0.8, 0.0, 3, NEW_TOKENS, 0), (0.8, 0.6, 0, 2, 0), (0.8, 0.0, 0, 2, 4)],
    ids=["temperature", "top-k", "top-p", "lookup-branch"],
)
def test_speculative_sampling_matches_target_distribution(sampling_pair, temperature, top_p, top_k, length,
                                                          lookup_tokens, monkeypatch):
    eagle, reference, prompt = sampling_pair
    grafted = []
    if lookup_tokens:
        # A lookup "match" that is always there and often right: the target's own greedy continuation of the
        # context, so grafted nodes (merged into the head's where they coincide) are verified and accepted often.
        import eagle.model.drafter as drafter_module

        real_graft = drafter_module.graft_chain

        def greedy_chain(history, max_tokens):
            ids = torch.cat([prompt[0, :1], history])[None]
            with torch.no_grad():
                return reference.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:]

        monkeypatch.setattr(drafter_module, "find_continuation", greedy_chain)
        monkeypatch.setattr(drafter_module, "graft_chain",
                            lambda tree, chain: grafted.append(chain.numel()) or real_graft(tree, chain))
    eagle.set_tree(10, 3, 4, lookup_tokens)
    processors = prepare_logits_processor(temperature, top_p=top_p, top_k=top_k)
    expected = exact_distribution(reference, prompt, processors, length)
    torch.manual_seed(1234)
    observed: dict = {}
    accepted_drafts = 0
    for _ in range(RUNS):
        steps = list(eagle.generate_steps(prompt, temperature=temperature, top_p=top_p, top_k=top_k,
                                          max_new_tokens=length))
        tokens = tuple(torch.cat([s.tokens for s in steps]).tolist())
        accepted_drafts += sum(s.accepted for s in steps)
        observed[tokens] = observed.get(tokens, 0) + 1
    # speculation really happened: drafts were accepted in a good share of the runs
    assert accepted_drafts > RUNS * 0.15, accepted_drafts
    assert bool(grafted) == bool(lookup_tokens)
    p_value = chi_square_p_value(observed, expected, RUNS)
    assert p_value > 1e-3, (p_value, sorted(observed.items(), key=lambda kv: -kv[1])[:8])


def test_sampling_is_reproducible_with_torch_seed(sampling_pair):
    eagle, _, prompt = sampling_pair
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(eagle.eagenerate(prompt, temperature=1.0, max_new_tokens=20).tolist())
    assert runs[0] == runs[1]
    generator = torch.Generator().manual_seed(3)
    first = list(itertools.chain.from_iterable(
        s.tokens.tolist() for s in eagle.generate_steps(prompt, temperature=1.0, max_new_tokens=10, generator=generator)))
    generator.manual_seed(3)
    second = list(itertools.chain.from_iterable(
        s.tokens.tolist() for s in eagle.generate_steps(prompt, temperature=1.0, max_new_tokens=10, generator=generator)))
    assert first == second


def test_biased_verifier_would_be_caught(sampling_pair, monkeypatch):
    """The chi-square test has teeth: a verifier that accepts every first draft fails it."""
    import eagle.model.generation as generation

    eagle, reference, prompt = sampling_pair
    monkeypatch.setattr(generation, "verify_sampling",
                        lambda tree, logits, sampler: (tree.retrieve_indices[0][:2], sampler.draw(sampler.probs(logits[0][None])[0])))
    processors = prepare_logits_processor(1.0)
    expected = exact_distribution(reference, prompt, processors, 2)
    torch.manual_seed(99)
    observed: dict = {}
    for _ in range(400):
        tokens = tuple(eagle.eagenerate(prompt, temperature=1.0, max_new_tokens=2)[0, prompt.shape[1]:].tolist())
        observed[tokens] = observed.get(tokens, 0) + 1
    assert chi_square_p_value(observed, expected, 400) < 1e-3
