"""The engine's log-probabilities (eagle/model/engine/logprobs.py): the target's, at the position that produced each
token, after the request's temperature; equal between EAGLE and plain decoding (bit for bit on the GGUF kernels,
within float tolerance on the float32 path); a prompt's logprobs equal to a plain forward's; computed only for the
rows that ask."""

from __future__ import annotations

import pytest
import torch

from chat_helpers import chat_template_ids
from eagle.cli import ModelOptions, load_default_model, load_model
from eagle.model.engine import loop
from eagle.model.engine.logprobs import MAX_TOP_LOGPROBS

pytestmark = pytest.mark.e2e  # the embedded SmolLM2 pair

PROMPTS = ["Write a short poem about autumn leaves.", "What is the difference between a list and a tuple in Python?"]


@pytest.fixture(scope="module")
def kernels_model():
    return load_default_model()


@pytest.fixture(scope="module")
def float_model():
    return load_model(ModelOptions(gguf_kernels=False, draft_dtype=torch.float32, pack_cpu_weights=False))


def generate(model, ids, use_eagle: bool, top: int | None = 5, temperature: float = 0.0, seed: int | None = None,
             max_new_tokens: int = 32):
    """(tokens, accepted drafts, logprobs of each token (n,), top ids (n, k), top logprobs (n, k)) of one row."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    batch = model.continuous_batch(temperature=temperature, use_eagle=use_eagle, generator=generator)
    batch.add(ids, max_new_tokens=max_new_tokens, logprobs=top)
    tokens, accepted, parts = [], 0, []
    for step in batch:
        for part in step.values():
            tokens += part.tokens.tolist()
            accepted += part.accepted
            parts.append(part.logprobs)
    if top is None:
        assert parts and all(part is None for part in parts)
        return tokens, accepted, None, None, None
    assert sum(len(part) for part in parts) == len(tokens)
    chosen, top_ids, top_values = (torch.cat([getattr(p, name) for p in parts])
                                   for name in ("chosen", "top_ids", "top_logprobs"))
    assert torch.cat([p.token_ids for p in parts]).tolist() == tokens
    return tokens, accepted, chosen, top_ids, top_values


def forward_logprobs(model, sequence: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) of a plain forward pass of the base model over ``sequence``: (len - 1, V), row i the
    distribution of token i + 1."""
    with torch.no_grad():
        logits = model.base_model(torch.tensor([sequence])).logits[0, :-1].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def test_greedy_eagle_logprobs_equal_plain_decoding_bit_for_bit_on_the_kernels(kernels_model):
    for message in PROMPTS:
        ids = chat_template_ids(kernels_model, message)[0]
        tokens, accepted, chosen, top_ids, top_values = generate(kernels_model, ids, use_eagle=True)
        plain = generate(kernels_model, ids, use_eagle=False)
        assert accepted > 0  # drafted tokens are among those compared
        assert tokens == plain[0]
        assert torch.equal(chosen, plain[2]) and torch.equal(top_ids, plain[3]) and torch.equal(top_values, plain[4])
        assert top_ids.shape == (len(tokens), 5)
        assert torch.equal(top_ids[:, 0], torch.tensor(tokens))  # greedy: each token is the likeliest
        assert torch.equal(top_values[:, 0], chosen)
        assert bool((top_values[:, :-1] >= top_values[:, 1:]).all())
        # a prompt's logprobs over the final sequence: the same numbers again (one prefill on the kernels)
        echo = kernels_model.engine.prompt_logprobs(torch.cat([ids, torch.tensor(tokens)]), 5)
        assert torch.equal(echo.chosen[len(ids) - 1:], chosen) and torch.equal(echo.top_ids[len(ids) - 1:], top_ids)


def test_greedy_eagle_logprobs_equal_plain_decoding_on_the_float32_path(float_model):
    ids = chat_template_ids(float_model, PROMPTS[0])[0]
    tokens, accepted, chosen, top_ids, top_values = generate(float_model, ids, use_eagle=True)
    plain = generate(float_model, ids, use_eagle=False)
    assert accepted > 0 and tokens == plain[0]
    torch.testing.assert_close(chosen, plain[2], atol=1e-4, rtol=0)
    torch.testing.assert_close(top_values, plain[4], atol=1e-4, rtol=0)
    reference = forward_logprobs(float_model, ids.tolist() + tokens)[len(ids) - 1:]
    torch.testing.assert_close(chosen, reference.gather(1, torch.tensor(tokens)[:, None])[:, 0], atol=1e-4, rtol=0)


@pytest.mark.parametrize("numerics", ["default", "float32"])
@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampled_tokens_logprobs_are_the_target_s_after_temperature(request, numerics, temperature):
    kernels_model = request.getfixturevalue("kernels_model" if numerics == "default" else "kernels_float32_model")
    ids = chat_template_ids(kernels_model, PROMPTS[1])[0]
    tokens, accepted, chosen, top_ids, top_values = generate(kernels_model, ids, use_eagle=True,
                                                             temperature=temperature, seed=3, top=3)
    assert accepted > 0
    if numerics == "float32":  # against transformers' own forward over the final sequence
        reference = forward_logprobs(kernels_model, ids.tolist() + tokens, temperature)[len(ids) - 1:]
        expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        torch.testing.assert_close(chosen, expected, atol=2e-4, rtol=0)
        torch.testing.assert_close(top_values, reference.topk(3, dim=-1).values, atol=2e-4, rtol=0)
    # the same logprobs as the target's own prefill over the final sequence, at that temperature, bit for bit
    echo = kernels_model.engine.prompt_logprobs(torch.cat([ids, torch.tensor(tokens)]), 3, temperature)
    assert torch.equal(echo.chosen[len(ids) - 1:], chosen)


def test_prompt_logprobs_equal_a_plain_forward(float_model):
    ids = chat_template_ids(float_model, PROMPTS[1])[0]
    got = float_model.engine.prompt_logprobs(ids, 4)
    reference = forward_logprobs(float_model, ids.tolist())
    assert len(got) == len(ids) - 1 and got.token_ids.tolist() == ids[1:].tolist()
    torch.testing.assert_close(got.chosen, reference.gather(1, ids[1:, None])[:, 0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.top_logprobs, reference.topk(4, dim=-1).values, atol=1e-5, rtol=0)
    assert len(float_model.engine.prompt_logprobs(ids[:1], 2)) == 0  # a one-token prompt: nothing to score


def test_logprobs_cost_nothing_unless_a_row_asks(kernels_model, monkeypatch):
    calls = []
    real = loop.token_logprobs
    monkeypatch.setattr(loop, "token_logprobs", lambda *args: calls.append(1) or real(*args))
    ids = [chat_template_ids(kernels_model, message)[0] for message in PROMPTS]
    generate(kernels_model, ids[0], use_eagle=True, top=None, max_new_tokens=8)
    assert calls == []
    batch = kernels_model.continuous_batch(use_eagle=True)
    wanting, silent = batch.add(ids[0], max_new_tokens=8, logprobs=0)[0], batch.add(ids[1], max_new_tokens=8)[0]
    seen = {wanting: 0, silent: 0}
    for step in batch:
        for row, part in step.items():
            assert (part.logprobs is None) == (row == silent)
            if part.logprobs is not None:
                assert part.logprobs.top_ids.shape == (part.tokens.shape[0], 0)
            seen[row] += part.tokens.shape[0]
    assert seen[wanting] == seen[silent] == 8 and calls


def test_bad_logprob_counts_are_refused(kernels_model):
    ids = chat_template_ids(kernels_model, PROMPTS[0])[0]
    for bad in (-1, MAX_TOP_LOGPROBS + 1, 2.0, True):
        with pytest.raises(ValueError, match="logprobs"):
            kernels_model.continuous_batch().add(ids, logprobs=bad)
        with pytest.raises(ValueError, match="logprobs"):
            kernels_model.engine.prompt_logprobs(ids, bad)
