"""The mixture-of-experts families (Qwen2-MoE with its shared expert, Qwen3-MoE) on the kernels: a tiny random model
of each, written to a GGUF file (Q8_0 matrices, the experts as llama.cpp's stacked ``ffn_*_exps`` tensors) and
loaded back as a user's file is, has its router, every expert and the shared expert on the kernels, takes the
native decoder with its layers in ``eagle::spec_layers`` (routing included: the bits of the layers run through their
modules with the op's RMSNorm summation order), gives the
same logits bit for bit whether its tokens come one at a time or as a tree, decodes greedily what transformers'
float32 model of the same file decodes, and gives two threads what each gets alone.

The plain-versus-tree, greedy and two-thread checks are test_native_families' own, run here over these models
(pytest gives them this module's ``family_models``). Mixtral is refused: transformers loads no Mixtral GGUF."""

from __future__ import annotations

import copy

import pytest
import torch

from eagle import kernels
from eagle.kernels.linear import QuantLinear
from eagle.kernels.reference import lane_rms_norm
from eagle.model.backends import gguf
from eagle.model.backends.gguf_experts import KernelExperts, KernelRouter, expert_slice
from eagle.model.base import native_decoder
from eagle.model.base.target import Target
from test_native_families import (PROMPTS, _greedy, _native_calls,  # noqa: F401 (tests collected here too)
                                  test_greedy_equals_transformers_float32_model,
                                  test_plain_and_tree_logits_are_bit_equal,
                                  test_two_threads_give_what_each_gives_alone)
from test_native_decoder import _decoder_passes
from tiny_models import target_config, write_gguf_target

pytestmark = pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here")

# family: (model type, GGUF architecture, config overrides). A GGUF file carries no expert width, so the tiny
# models keep transformers' defaults for it (Qwen2-MoE 1408 and a 5632-wide shared expert; Qwen3-MoE 768).
FAMILIES = {
    "qwen2_moe": ("qwen2_moe", "qwen2moe", dict(use_sliding_window=False)),
    "qwen3_moe": ("qwen3_moe", "qwen3moe", dict(head_dim=16, moe_intermediate_size=768)),
}
EXPERTS, TOP_K = 4, 2


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_models(request, tmp_path_factory):
    """(family, reference, target): transformers' float32 model of the family's GGUF file, and a target over a
    copy of it whose layers, router and experts compute on the file's blocks."""
    from transformers import AutoModelForCausalLM

    model_type, architecture, overrides = FAMILIES[request.param]
    torch.manual_seed(0)
    config = target_config(model_type, layers=2, num_experts=EXPERTS, num_experts_per_tok=TOP_K, **overrides)
    random = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory = tmp_path_factory.mktemp(request.param)
    path = write_gguf_target(random, directory / "model.gguf", architecture)
    reference = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file="model.gguf", dtype=torch.float32,
                                                     attn_implementation="sdpa").eval()
    assert reference.config.num_experts == EXPERTS and reference.config.num_experts_per_tok == TOP_K
    model = copy.deepcopy(reference)
    assert gguf.convert_gguf_model(model, str(path)) > 0
    return request.param, reference, Target(model, feature_layers=None)


def test_router_and_every_expert_compute_on_the_kernels(family_models):
    family, reference, target = family_models
    for layer, theirs in zip(target.model.model.layers, reference.model.layers):
        mlp = layer.mlp
        assert isinstance(mlp.experts, KernelExperts) and isinstance(mlp.gate, KernelRouter)
        assert len(mlp.experts.gate_up) == EXPERTS and len(mlp.experts.down) == EXPERTS
        for expert in range(EXPERTS):
            assert torch.equal(mlp.experts.gate_up[expert].dequantized_weight(), theirs.mlp.experts.gate_up_proj[expert])
            assert torch.equal(mlp.experts.down[expert].dequantized_weight(), theirs.mlp.experts.down_proj[expert])
        assert torch.equal(mlp.gate.linear.dequantized_weight(), theirs.mlp.gate.weight)
        linears = native_decoder.mlp_linears(mlp)
        assert all(isinstance(m, QuantLinear) and m.uses_kernels for m in linears)
        assert len(linears) == 1 + 2 * EXPERTS + (4 if family == "qwen2_moe" else 0)


def test_each_moe_family_takes_the_native_decoder(family_models):
    family, reference, target = family_models
    decoder = target.forward_plan.native
    assert decoder is not None and decoder.spec.native
    moe = decoder.spec.moe
    assert (moe.experts, moe.top_k, moe.routing) == (EXPERTS, TOP_K, "softmax")
    assert moe.norm_topk_prob == reference.config.norm_topk_prob == (family == "qwen3_moe")  # transformers' default
    assert moe.shared_expert == (family == "qwen2_moe") and decoder.spec.qk_norm == (family == "qwen3_moe")
    assert decoder.arguments is not None and decoder.arguments.moe == [
        EXPERTS, TOP_K, int(moe.norm_topk_prob), int(moe.shared_expert),
        target.model.model.layers[0].mlp.experts.gate_up[0].out_features // 2]
    with pytest.MonkeyPatch.context() as patch:
        calls = _native_calls(patch)
        _greedy(target, PROMPTS[0], 2)
    assert len(calls) == 3 and all(call is not None for call in calls)  # every pass in eagle::spec_layers


def _lane_norms(patch, model) -> None:
    """Every norm inside the decoder layers computed as the native layers compute it (lane_rms_norm)."""
    for layer in model.model.layers:
        attention = layer.self_attn
        for norm in (layer.input_layernorm, layer.post_attention_layernorm, getattr(attention, "q_norm", None),
                     getattr(attention, "k_norm", None)):
            if norm is not None:
                patch.setattr(norm, "forward", lambda x, norm=norm: lane_rms_norm(x, norm.weight,
                                                                                        norm.variance_epsilon))


def test_the_native_layers_route_as_the_modules_do(family_models):
    """eagle::spec_layers with the experts (router, top-k, each expert over its rows, the shared expert) gives the
    bits of the layers run through their modules with the op's RMSNorm summation order, over a left-padded
    prefill and a tree."""
    _, _, target = family_models
    native = _decoder_passes(target, native=True)
    with pytest.MonkeyPatch.context() as patch:
        _lane_norms(patch, target.model)
        modules = _decoder_passes(target, native=False)
    logits = [(mine, reference) for mine, reference in zip(native, modules) if reference is not None]
    assert len(logits) == 2  # the prefill's and the tree's (this target keeps no features)
    for mine, reference in logits:
        assert torch.equal(mine, reference)


def test_rows_are_routed_to_different_experts(family_models):
    """The prompts exercise the routing: their rows choose more than top-k distinct experts in each layer."""
    _, reference, _ = family_models
    chosen = [set() for _ in reference.model.layers]
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out, seen=seen: seen.update(out[2].flatten().tolist()))
             for layer, seen in zip(reference.model.layers, chosen)]
    with torch.no_grad():
        reference(torch.tensor([PROMPTS[0]]))
    for hook in hooks:
        hook.remove()
    assert all(len(seen) > TOP_K for seen in chosen), chosen


def test_an_experts_slice_is_its_matrix_of_the_stacked_tensor(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = target_config("qwen3_moe", layers=1, num_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=16)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path = write_gguf_target(model, tmp_path / "model.gguf", "qwen3moe")
    from eagle.kernels.gguf_weights import read_gguf_weights

    down = read_gguf_weights(str(path))["blk.0.ffn_down_exps.weight"]
    stacked = down.dequantize()
    for expert in range(EXPERTS):
        assert torch.equal(expert_slice(down, expert).dequantize(), stacked[expert])
    with pytest.raises(ValueError, match="expert index below its first size"):
        expert_slice(down, EXPERTS)


def test_float_experts_and_unknown_routing_are_refused_by_name():
    """Experts left float32 (a model not loaded from GGUF) keep transformers' forward; a router the spec does not
    know is named."""
    from transformers import AutoModelForCausalLM

    config = target_config("qwen3_moe", layers=2, num_experts=EXPERTS, num_experts_per_tok=TOP_K, head_dim=16)
    model = AutoModelForCausalLM.from_config(config)
    assert native_decoder.layer_spec(model).native
    assert "not every linear layer computes on the GGUF kernels" in native_decoder.native_problem(model, True)
    for layer in model.model.layers:
        layer.mlp.gate = torch.nn.Linear(64, EXPERTS)
    assert "its router Linear is not a softmax top-k router it knows" in native_decoder.layer_spec(model).problems


@pytest.mark.parametrize("change, message", [
    (dict(moe=[EXPERTS, EXPERTS + 1, 0, 0, 8]), "moe must be empty or (experts, top_k <= experts"),
    (dict(expert_weights=[]), "expert weights and types (the router, gate-up and down per expert"),
])
def test_the_native_layers_refuse_expert_lists_that_do_not_fit(family_models, change, message):
    import dataclasses

    from test_native_decoder import _passes

    _, _, target = family_models
    decoder = target.forward_plan.native
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoder, "arguments", dataclasses.replace(decoder.arguments, **change))
        with pytest.raises((ValueError, RuntimeError)) as error:
            _passes(target)
    assert message in str(error.value)
