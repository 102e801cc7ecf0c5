"""Sampling keeps the base model's distribution, checked against an independent reference: tokens 1 to 5 of EAGLE's
samples (the first from the prefill, the rest from speculation) follow, position by position, the distribution that
Hugging Face's own warpers (``TemperatureLogitsWarper``, ``TopKLogitsWarper``, ``TopPLogitsWarper``) give on a plain
forward pass of the base model (``AutoModelForCausalLM``, no cache, not this project's ``Target``), under a chi-square
test; for EAGLE-3 heads with the full and a reduced vocabulary and for an EAGLE-1 head, all fitted so that drafts are
really accepted. The same test fails on subtly wrong samplers (power checks).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import (AutoModelForCausalLM, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper,
                          TopPLogitsWarper)

from eagle.model.drafting.protocol import StepDrafter
from eagle.model.ea_model import EaModel
from tiny_models import make_head, make_target, train_head_quickly

pytestmark = pytest.mark.e2e  # thousands of sampled generations against an independent reference

RUNS = 300
LENGTH = 5  # tokens 1 to 5: the prefill's and four from speculation
HEADS = {"eagle3-full": (True, None), "eagle3-reduced": (True, 48), "eagle1": (False, None)}


@pytest.fixture(scope="module")
def sampling_setup(tmp_path_factory):
    """A tiny target, a head of each kind fitted to it, and an independent Hugging Face copy of the target."""
    root = tmp_path_factory.mktemp("sampling")
    model = make_target(root / "base", "llama", seed=21, layers=4)
    heads = {}
    for kind, (eagle3, vocab) in HEADS.items():
        make_head(root / kind, model, eagle3=eagle3, draft_vocab_size=vocab, seed=22)
        prompts = train_head_quickly(root / "base", root / kind, eagle3=eagle3, steps=40, num_sequences=16, lr=1e-2)
        heads[kind] = EaModel.from_pretrained(use_eagle3=eagle3, base_model_path=str(root / "base"),
                                              ea_model_path=str(root / kind), total_token=10, depth=3, top_k=4,
                                              dtype=torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    return heads, reference, prompts[0:1]


def hf_warpers(temperature: float, top_p: float = 1.0, top_k: int = 0, order: str = "hf") -> LogitsProcessorList:
    """Hugging Face's warpers in the order ``generate`` applies them (temperature, top-k, top-p), or, with
    ``order="eagle"``, in the EAGLE reference's documented order (temperature, top-p, top-k), which differs from
    Hugging Face's only when top-p and top-k are both on."""
    warpers = {"temperature": TemperatureLogitsWarper(temperature) if temperature != 1.0 else None,
               "top_k": TopKLogitsWarper(top_k) if top_k > 0 else None,
               "top_p": TopPLogitsWarper(top_p) if top_p < 1.0 else None}
    names = ["temperature", "top_k", "top_p"] if order == "hf" else ["temperature", "top_p", "top_k"]
    return LogitsProcessorList([warpers[name] for name in names if warpers[name] is not None])


def sample(model: EaModel, prompt, runs: int, **options) -> tuple[list[tuple[int, ...]], int]:
    """``runs`` samples of LENGTH tokens; returns them and the number of draft tokens accepted in all."""
    samples, accepted = [], 0
    for _ in range(runs):
        steps = list(model.generate_steps(prompt, max_new_tokens=LENGTH, **options))
        samples.append(tuple(torch.cat([s.tokens for s in steps]).tolist()))
        accepted += sum(s.accepted for s in steps)
    return samples, accepted


def position_p_values(reference, prompt, samples: list[tuple[int, ...]], warpers) -> list[float]:
    """For each position i, Pearson's tests of the tokens sampled there against their expected counts: the sum, over
    the samples, of the reference's warped next-token distribution after that sample's own prefix (one batched
    plain forward pass per position; a sample that ended at a stop token before position i is left out there).
    Under the null the counts are sums of independent categorical draws, for which this statistic is at most
    chi-square distributed (the test is conservative). Two p-values per position: cells by token id, and by rank."""
    p_values = []
    for i in range(LENGTH):
        reached = [s for s in samples if len(s) > i]  # a sample that stopped (stop token) has no token i
        prefixes = torch.tensor([s[:i] for s in reached], dtype=torch.long).reshape(len(reached), i)
        ids = torch.cat([prompt.expand(len(reached), -1), prefixes], dim=1)
        with torch.no_grad():
            logits = reference(ids).logits[:, -1].float()
        probs = torch.softmax(warpers(ids, logits), dim=-1)
        tokens = torch.tensor([s[i] for s in reached])
        # cells by token id ...
        observed = torch.bincount(tokens, minlength=probs.shape[1]).double()
        p_values.append(chi_square_p_value(observed, probs.sum(0).double()))
        # ... and by the token's rank in its own conditional distribution (a bias towards or away from the likeliest
        # tokens, whichever they are after each prefix, adds up here instead of spreading over many ids)
        sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
        ranks = (order == tokens[:, None]).float().argmax(dim=-1)
        observed = torch.bincount(ranks, minlength=probs.shape[1]).double()
        p_values.append(chi_square_p_value(observed, sorted_probs.sum(0).double()))
    return p_values


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of Pearson's test; cells expected fewer than 5 times are pooled into one (dropped if that pool is
    expected fewer than 5 times, when it must also hold few samples)."""
    big = expected >= 5
    obs, exp = observed[big].tolist(), expected[big].tolist()
    rest_obs, rest_exp = float(observed[~big].sum()), float(expected[~big].sum())
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        assert rest_obs <= max(5, 3 * rest_exp), "many samples fell in cells the target almost never produces"
    if len(exp) < 2:
        return 1.0
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


CASES = {  # id: (head kind, sampling options, warper settings and order)
    "temperature": ("eagle3-full", dict(temperature=0.7), dict(temperature=0.7)),
    "top-k": ("eagle3-full", dict(temperature=0.9, top_k=3), dict(temperature=0.9, top_k=3)),
    "top-p": ("eagle3-full", dict(temperature=0.9, top_p=0.7), dict(temperature=0.9, top_p=0.7)),
    "top-p-and-top-k": ("eagle3-full", dict(temperature=0.9, top_p=0.8, top_k=4),
                        dict(temperature=0.9, top_p=0.8, top_k=4, order="eagle")),
    "reduced-vocabulary": ("eagle3-reduced", dict(temperature=0.6), dict(temperature=0.6)),
    "eagle1": ("eagle1", dict(temperature=0.8, top_p=0.9), dict(temperature=0.8, top_p=0.9)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_speculative_sampling_matches_hugging_face_warpers(sampling_setup, case):
    heads, reference, prompt = sampling_setup
    kind, options, warper_settings = CASES[case]
    torch.manual_seed(1234)
    samples, accepted = sample(heads[kind], prompt, RUNS, **options)
    # speculation really happened: drafts accepted in a good share of the samples
    assert accepted > 0.15 * RUNS, accepted
    p_values = position_p_values(reference, prompt, samples, hf_warpers(**warper_settings))
    assert min(p_values) > 1e-3, p_values


def test_lookup_branch_keeps_the_distribution(sampling_setup, monkeypatch):
    """Nodes grafted from a lookup "match" (here, always there and often right: the target's own greedy
    continuation) are verified like the head's, so sampling stays exact."""
    import eagle.model.drafting.lookup as drafter_module

    heads, reference, prompt = sampling_setup
    model = heads["eagle3-full"]
    real_graft = drafter_module.graft_chain
    grafted = []

    def greedy_chain(history, max_tokens):
        ids = torch.cat([prompt[0, :1], history])[None]
        with torch.no_grad():
            return reference.generate(ids, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:]

    monkeypatch.setattr(drafter_module, "find_match",
                        lambda history, max_tokens: (greedy_chain(history, max_tokens), 3))
    monkeypatch.setattr(drafter_module, "graft_chain",
                        lambda tree, chain: grafted.append(chain.numel()) or real_graft(tree, chain))
    model.set_tree(10, 3, 4, 4)
    try:
        torch.manual_seed(4321)
        samples, accepted = sample(model, prompt, RUNS, temperature=0.8)
    finally:
        model.set_tree(10, 3, 4, 0)
    assert grafted and accepted > 0.15 * RUNS
    assert min(position_p_values(reference, prompt, samples, hf_warpers(0.8))) > 1e-3


# ------------------------------------------------------------------------------------------------ power checks
class OracleDrafter(StepDrafter):
    """Drafts the target's own likeliest tokens (from the reference model): the root's three likeliest children, each
    with its two likeliest. Siblings then carry much of the target's probability, so rejections of likely tokens,
    residual renormalisation and bonus draws after rejections all happen often: where a subtly wrong verifier shows."""

    needs_features = False

    def __init__(self, reference, first_token: torch.Tensor, temperature: float):
        self.reference, self.first, self.temperature = reference, first_token, temperature
        self.history = None

    def reset(self, batch_size: int = 1) -> None:
        self.history = None

    def select_rows(self, index: torch.Tensor) -> None:
        pass

    def add_rows(self, features, next_tokens, valid=None) -> None:
        raise AssertionError("one row only")

    def max_nodes(self, batch_size: int) -> int:
        return 10

    def observe(self, features, next_tokens: torch.Tensor, valid=None) -> None:
        assert next_tokens.shape[0] == 1 and valid is None, "one row only"
        new = next_tokens[0]
        self.history = new if self.history is None else torch.cat([self.history, new])

    def propose(self):
        return [self._tree()]

    def _top(self, sequences: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            logp = torch.log_softmax(self.reference(sequences).logits[:, -1].float() / self.temperature, dim=-1)
        return logp.topk(k, dim=-1)

    def _tree(self):
        from eagle.model.drafting.tree import tree_from_parents

        sequence = torch.cat([self.first, self.history])
        scores1, level1 = self._top(sequence[None], 3)
        children = torch.cat([sequence.expand(3, -1), level1[0][:, None]], dim=1)
        scores2, level2 = self._top(children, 2)
        tokens = torch.cat([sequence[-1:], level1[0], level2.flatten()])
        parents = torch.tensor([-1, 0, 0, 0, 1, 1, 2, 2, 3, 3])
        scores = torch.cat([torch.zeros(1), scores1[0], (scores1[0][:, None] + scores2).flatten()])
        return tree_from_parents(tokens, parents, scores)


def wrong_verifier(bug: str):
    """``accept_sampling`` written out again, with one subtle bug: ``unnormalised`` leaves the residual unnormalised
    after a rejected sibling; ``bonus_from_target`` draws the bonus token after rejections from the full target
    distribution instead of the residual; ``bonus_from_draft`` takes the draft's best rejected token as the bonus;
    ``none`` has no bug."""
    def verify(tree, logits, sampler):
        parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
        order = torch.argsort(tree.scores, descending=True, stable=True).tolist()
        children: dict[int, list[int]] = {}
        for node in order:
            if parents[node] >= 0:
                children.setdefault(parents[node], []).append(node)
        node, path = 0, [0]
        while True:
            probs = sampler.probs(logits[node][None])[0]
            kids = children.get(node)
            if not kids:
                return torch.tensor(path), sampler.draw(probs)
            residual = probs
            for child in kids:
                if sampler.uniform(residual.device) < float(residual[tokens[child]]):
                    node = child
                    path.append(node)
                    break
                residual = residual.clone()
                residual[tokens[child]] = 0.0
                if bug != "unnormalised":
                    residual = residual / residual.sum()
            else:
                if bug == "bonus_from_target":
                    return torch.tensor(path), sampler.draw(probs)
                if bug == "bonus_from_draft":
                    return torch.tensor(path), torch.tensor(tokens[kids[0]])
                return torch.tensor(path), sampler.draw(residual)

    return verify


def oracle_samples(sampling_setup, monkeypatch, verifier=None):
    import eagle.model.engine.acceptance as acceptance_module
    from eagle.model.engine.engine import Engine

    heads, reference, prompt = sampling_setup
    real = Engine.drafter
    monkeypatch.setattr(Engine, "drafter", lambda self, kind: OracleDrafter(reference, prompt[0, :1], POWER_TEMPERATURE)
                        if self.drafter_spec(kind).startswith("eagle") else real(self, kind))  # the head's drafter
    if verifier is not None:
        monkeypatch.setattr(acceptance_module, "accept_sampling", verifier)
    torch.manual_seed(1234)
    samples, accepted = sample(heads["eagle3-full"], prompt, RUNS, temperature=POWER_TEMPERATURE)
    return position_p_values(reference, prompt, samples, hf_warpers(POWER_TEMPERATURE)), accepted


POWER_TEMPERATURE = 1.0


def test_sampling_with_drafts_of_the_targets_likeliest_tokens(sampling_setup, monkeypatch):
    """The real verifier, with drafts where every sibling is likely (many accepted, many rejected)."""
    p_values, accepted = oracle_samples(sampling_setup, monkeypatch)
    assert accepted > RUNS and min(p_values) > 1e-3, (accepted, p_values)


@pytest.mark.parametrize("bug", ["none", "unnormalised", "bonus_from_target", "bonus_from_draft"])
def test_the_same_test_fails_a_subtly_wrong_sampler(sampling_setup, monkeypatch, bug):
    """Power: the written-out verifier passes without a bug and fails with each bug."""
    p_values, _ = oracle_samples(sampling_setup, monkeypatch, wrong_verifier(bug))
    assert (min(p_values) > 1e-3) == (bug == "none"), p_values


def test_sampling_is_reproducible_with_torch_seed(sampling_setup):
    heads, _, prompt = sampling_setup
    eagle = heads["eagle3-full"]
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
