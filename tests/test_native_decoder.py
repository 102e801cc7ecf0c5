"""The native decoder (eagle.model.base.native_decoder) computes exactly what transformers' forward computes, for
the Llama-style families it knows, on tiny random models whose linear layers run on the GGUF kernels: prefill and
tree verification, a left-padded batch, sliding-window layers, both numerics; and it stays out of what it does not
know."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from torch import nn

from eagle import kernels
from eagle.kernels.attention import visible_keys
from eagle.kernels.gguf_weights import GGUFWeight
from eagle.kernels.reference import lane_rms_norm
from eagle.model.base import native_decoder
from eagle.model.backends.gguf import GGUFQuantLinear
from eagle.model.base.target import Target
from tiny_models import target_config

pytestmark = pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here")

FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=4),  # every layer a sliding window of 4 positions
    "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),  # full, then sliding layers
}


def quantized_model(family: str, numerics: str = "float32", **overrides):
    """A tiny random ``family`` model whose every linear layer computes over Q8_0 blocks of its weight, its attention
    the position-ordered kernel in a target's passes, as the GGUF backend leaves a model (without a GGUF file)."""
    import gguf
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = target_config(family, layers=3, **{**FAMILIES.get(family, {}), **overrides})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    for name, layer in list(model.named_modules()):
        if type(layer) is nn.Linear:
            blocks = gguf.quants.quantize(layer.weight.detach().numpy(), gguf.GGMLQuantizationType.Q8_0)
            weight = GGUFWeight(name, "Q8_0", tuple(layer.weight.shape), torch.from_numpy(np.ascontiguousarray(blocks)))
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child,
                    GGUFQuantLinear(weight, layer.bias, numerics))
    return model


def _passes(target: Target) -> list:
    """A left-padded prefill of two rows, then a 4-node tree per row; every logits and features tensor."""
    torch.manual_seed(1)
    prompt = torch.randint(6, 128, (2, 9))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False  # row 1: three padding slots on the left
    positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
    cache = target.new_cache(32)
    first = target.prefill(prompt, cache, valid=valid, logits_to_keep=0)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    depth = torch.tensor([0, 1, 1, 2])
    tree_positions = positions[:, -1:] + 1 + depth
    tree_valid = torch.cat([valid, torch.ones(2, 4, dtype=torch.bool)], dim=1)
    second = target.verify(torch.randint(6, 128, (2, 4)), cache, tree_positions, tree.expand(2, 4, 4),
                           valid=tree_valid, key_positions=positions)
    return [first.logits, first.features, second.logits, second.features]


def _decoder_passes(target: Target, native: bool) -> list:
    """:func:`_passes` through the target's native decoder (its native layers or its modules), checking that it
    ran."""
    decoder = target.forward_plan.native
    calls = []
    real_native = native_decoder.NativeDecoder._native_layers
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(decoder, "arguments", decoder.arguments if native else None)
        patch.setattr(native_decoder.NativeDecoder, "_native_layers",
                      lambda self, *a: calls.append(real_native(self, *a)) or calls[-1])
        passes = _passes(target)
    assert len(calls) == 2 and all((call is not None) == native for call in calls)
    return passes


def _lane_norms(patch, model) -> None:
    """Every decoder layer's RMSNorm computed as the native layers compute it (lane_rms_norm)."""
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            patch.setattr(norm, "forward", lambda x, norm=norm: lane_rms_norm(x, norm.weight,
                                                                                    norm.variance_epsilon))


@pytest.mark.parametrize("numerics", ["float32", "int8"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_native_decoder_gives_the_bits_of_transformers_forward(family, numerics):
    """Through the modules: transformers' bits. The native layers: the bits of the same forward with the norms'
    documented summation order (every other step as transformers rounds it), and transformers' values to float32
    rounding."""
    model = quantized_model(family, numerics)
    target = Target(model, feature_layers=[0, 2, -1])
    assert target.forward_plan.native is not None and target.forward_plan.native.arguments is not None
    modules = _decoder_passes(target, native=False)
    native = _decoder_passes(target, native=True)
    target.forward_plan = dataclasses.replace(target.forward_plan, native=None)  # transformers' forward
    theirs = _passes(target)
    with pytest.MonkeyPatch.context() as patch:
        _lane_norms(patch, model)
        theirs_lane_norms = _passes(target)
    for mine, reference in zip(modules, theirs):
        assert torch.equal(mine, reference)
    for mine, reference, lane in zip(native, theirs, theirs_lane_norms):
        assert torch.equal(mine, lane)
        torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-3)
    if family != "llama":  # the windows are shorter than the prompt: the sliding layers must see fewer keys
        assert not torch.equal(theirs[0], _passes(Target(_without_window(model), feature_layers=[0, 2, -1]))[0])


def test_lane_rms_norm_is_an_rms_norm():
    torch.manual_seed(3)
    x, weight = torch.randn(5, 200, dtype=torch.float64), torch.randn(200, dtype=torch.float64)
    exact = weight * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(lane_rms_norm(x.float(), weight.float(), 1e-6), exact.float())


def _without_window(model):
    config = model.config.get_text_config()
    config.sliding_window = None
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    return model


def test_logits_of_chosen_positions_are_those_of_every_position():
    model = quantized_model("llama")
    ids = torch.randint(6, 128, (1, 7))
    mask = torch.zeros(1, 1, 7, 7).masked_fill_(~torch.ones(7, 7, dtype=torch.bool).tril_(), float("-inf"))
    run = native_decoder.native_decoder(model, kernel_attention=True)
    every = run(input_ids=ids, attention_mask=mask, position_ids=torch.arange(7)[None], cache=None,
                output_hidden_states=True, logits_to_keep=0)
    chosen = run(input_ids=ids, attention_mask=mask, position_ids=torch.arange(7)[None], cache=None,
                 output_hidden_states=False, logits_to_keep=torch.tensor([0, 4]))
    last = run(input_ids=ids, attention_mask=mask, position_ids=torch.arange(7)[None], cache=None,
               output_hidden_states=False, logits_to_keep=1)
    assert len(every.hidden_states) == 3 + 1 and chosen.hidden_states is None
    assert torch.equal(chosen.logits[0], every.logits[0, [0, 4]]) and torch.equal(last.logits[0, 0], every.logits[0, 6])


def test_what_the_native_decoder_does_not_know_keeps_transformers_forward():
    gemma = quantized_model("gemma")
    assert "GemmaForCausalLM is not one of" in native_decoder.native_problem(gemma, kernel_attention=True)
    assert native_decoder.native_decoder(gemma, kernel_attention=True) is None

    float_layer = quantized_model("llama")
    float_layer.model.layers[1].mlp.up_proj = nn.Linear(64, 128, bias=False)
    assert native_decoder.native_problem(float_layer, True) == "not every linear layer computes on the GGUF kernels"

    other_attention = quantized_model("llama")
    assert (native_decoder.native_problem(other_attention, kernel_attention=False)
            == "its attention does not run the position-ordered kernel")

    switched = Target(quantized_model("llama"), feature_layers=None)
    assert switched.forward_plan.native is not None and switched.forward_plan.kernel_attention
    switched.replan(kernel_attention=False)  # switched back after the target was built
    assert switched.forward_plan.native is None and not switched.forward_plan.kernel_attention


def test_a_native_decoder_does_not_keep_its_model_alive():
    import gc
    import weakref

    model = quantized_model("llama")
    decoder = native_decoder.native_decoder(model, kernel_attention=True)
    assert decoder is not None
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


def test_the_native_layers_give_the_same_bits_at_any_thread_count():
    target = Target(quantized_model("qwen2"), feature_layers=[0, 2, -1])
    assert target.forward_plan.native.arguments is not None
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = _decoder_passes(target, native=True)
        torch.set_num_threads(3)
        shared = _decoder_passes(target, native=True)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(alone, shared))


def _native_arguments(model, cache_slots: int = 8, queries: int = 2):
    plan = native_decoder.native_decoder(model, kernel_attention=True).arguments
    batch, hidden = 1, model.config.hidden_size
    kv_heads, head_dim = plan.dims[1:3]
    layers = len(model.model.layers)
    lists = visible_keys(torch.ones(1, 1, queries, queries, dtype=torch.bool).tril_(), True)
    return dict(
        hidden=torch.randn(batch, queries, hidden), weights=plan.weights, types=plan.types, biases=plan.biases,
        norms=plan.norms, dims=plan.dims, eps=plan.eps, scale=plan.scale,
        cos=torch.ones(batch, queries, head_dim), sin=torch.zeros(batch, queries, head_dim),
        keys=[torch.zeros(batch, kv_heads, cache_slots, head_dim) for _ in range(layers)],
        values=[torch.zeros(batch, kv_heads, cache_slots, head_dim) for _ in range(layers)], start=0,
        offsets=[lists.offsets], indices=[lists.indices], layer_masks=[0] * layers, numerics=plan.numerics,
        keep_states=False)


@pytest.mark.parametrize("change, message", [
    (dict(weights=[]), "per layer 7 weights"),
    (dict(start=7), "exceed the cache's capacity of 8"),
    (dict(layer_masks=[0, 1, 0]), "names mask list 1 of 1"),
    (dict(dims=[4, 2, 16]), "dims must be (q_heads, kv_heads, head_dim, intermediate)"),
    (dict(cos=torch.ones(1, 3, 16)), "cos must be a contiguous tensor of shape [1, 2, 16]"),
    (dict(hidden=torch.randn(1, 2, 64, dtype=torch.float64)), "hidden must be a float32 CPU tensor"),
    ("short keys", "a layer's cached keys must be a contiguous tensor of shape"),
    ("wrong weight", "the packed weight is N="),
])
def test_the_native_layers_refuse_what_does_not_fit(change, message):
    arguments = _native_arguments(quantized_model("llama"))
    if change == "short keys":
        arguments["keys"][1] = arguments["keys"][1][:, :, :4].contiguous()
    elif change == "wrong weight":
        arguments["weights"] = list(arguments["weights"])
        arguments["weights"][0], arguments["weights"][1] = arguments["weights"][1], arguments["weights"][0]
    else:
        arguments.update(change)
    with pytest.raises((ValueError, TypeError, RuntimeError)) as error:
        torch.ops.eagle.decoder_layers(**arguments)
    assert message in str(error.value)


def test_a_forward_past_the_cache_capacity_is_refused_before_anything_is_written():
    target = Target(quantized_model("llama"), feature_layers=[0, 2, -1])
    assert target.forward_plan.native is not None
    cache = target.new_cache(4)
    with pytest.raises(ValueError, match="KV cache overflow: 0 cached \\+ 5 new positions exceed its capacity of 4"):
        target.prefill(torch.randint(6, 128, (1, 5)), cache)
    assert cache.length == 0
