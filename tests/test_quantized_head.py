"""draft_dtype="q8_0" (and "q4_0"): the draft head's linear layers over Q8_0 (Q4_0) blocks of its weights with int8 activations on the
kernels (eagle.model.heads.quantized). The head proposes as the float head does (to Q8_0 rounding), the output
never changes, and where it cannot run the choice is refused (explicit) or left alone (auto)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle import kernels
from eagle.kernels.linear import QuantLinear
from eagle.kernels.reference import lane_rms_norm
from eagle.model.ea_model import EaModel
from eagle.model.heads import quantized
from eagle.model.heads.draft_layers import RMSNorm
from eagle.model.heads.quantized import KernelRMSNorm
from tiny_models import make_tiny_pair

needs_kernels = pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here")


@pytest.fixture(scope="module")
def eagle1_pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("pair1"), "llama", eagle3=False)


def _load(pair, **kwargs):
    base_dir, head_dir = pair
    return EaModel.from_pretrained(base_model_path=str(base_dir), ea_model_path=str(head_dir), total_token=6, depth=2,
                                   top_k=3, dtype=torch.float32, **kwargs)


@needs_kernels
def test_q8_0_puts_every_linear_layer_of_the_head_on_the_kernels_and_keeps_the_output(tiny_pair):
    float_model, model = _load(tiny_pair, draft_dtype="float32"), _load(tiny_pair, draft_dtype="q8_0")
    layers = [m for m in model.ea_layer.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == sum(isinstance(m, nn.Linear) for m in float_model.ea_layer.modules()) > 0
    assert all(layer.type_name == "Q8_0" and layer.numerics == "int8" for layer in layers)
    assert not any(isinstance(m, nn.Linear) for m in model.ea_layer.modules())
    # its norms run on the kernels' row norm too, with the same weights and epsilon
    norms = [(name, m) for name, m in float_model.ea_layer.named_modules() if isinstance(m, RMSNorm)]
    assert norms and not any(type(m) is RMSNorm for m in model.ea_layer.modules())
    for name, norm in norms:
        replaced = model.ea_layer.get_submodule(name)
        assert isinstance(replaced, KernelRMSNorm) and torch.equal(replaced.weight, norm.weight)
        assert replaced.variance_epsilon == norm.variance_epsilon
    assert quantized.draft_dtype_name(model.ea_layer) == "q8_0"
    assert quantized.draft_dtype_name(float_model.ea_layer) == "float32"
    assert not any(isinstance(m, QuantLinear) for m in model.base_model.modules())  # the target is left alone
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (1, 12))
    plain = model.naivegenerate(ids, max_new_tokens=24)
    assert torch.equal(model.eagenerate(ids, max_new_tokens=24), plain)
    assert torch.equal(float_model.eagenerate(ids, max_new_tokens=24), plain)


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 576), (3, 7, 64), (2, 5, 1728), (4, 17)])
def test_the_kernels_rms_norm_is_the_lane_order_norm_row_by_row(shape):
    torch.manual_seed(shape[-1])
    x, weight = torch.randn(shape) * 3, torch.rand(shape[-1]) + 0.5
    plain = RMSNorm(shape[-1], eps=1e-5).requires_grad_(False)
    plain.weight.copy_(weight)
    norm = KernelRMSNorm.from_norm(plain)
    got = norm(x)
    assert got.shape == x.shape and torch.equal(got, lane_rms_norm(x, weight, 1e-5))
    rows = x.reshape(-1, shape[-1])
    assert torch.equal(norm(rows[-1:])[0], got.reshape(-1, shape[-1])[-1])  # a row alone: the same bits
    torch.testing.assert_close(got, RMSNorm(shape[-1], eps=1e-5).requires_grad_(False).to(x).forward(x) * weight)
    # other dtypes take the float32 formula; bad shapes are clear errors
    assert norm(x.to(torch.bfloat16)).dtype == torch.float32
    with pytest.raises(ValueError, match="float32 CPU vector of"):
        kernels.ops().rms_norm(x, weight[:-1], 1e-5)
    with pytest.raises(ValueError, match="must be a float32 CPU tensor"):
        kernels.ops().rms_norm(x.double(), weight, 1e-5)


@needs_kernels
def test_the_quantized_head_computes_what_the_float_head_computes_to_q8_0_rounding(tiny_pair):
    float_head, head = _load(tiny_pair, draft_dtype="float32").ea_layer, _load(tiny_pair, draft_dtype="q8_0").ea_layer
    torch.manual_seed(1)
    features = torch.randn(1, 9, float_head.feature_size)
    ids = torch.randint(3, 120, (1, 9))
    with torch.inference_mode():
        expected = float_head.compute_logits(float_head(features, ids))
        got = head.compute_logits(head(features, ids))
    cosine = torch.nn.functional.cosine_similarity(got.flatten(), expected.flatten(), dim=0)
    assert cosine > 0.999
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.8


@needs_kernels
def test_layers_the_head_borrows_or_cannot_quantize_stay_as_they_are():
    head = nn.Module()
    head.own = nn.Linear(64, 32)
    head.odd = nn.Linear(48, 16)  # 48 inputs: not whole Q8_0 blocks
    shared = nn.Module()
    shared.lm_head = head.borrowed = nn.Linear(64, 100)
    assert quantized.quantize_head(head, shared=shared) == 1
    assert isinstance(head.own, QuantLinear) and type(head.odd) is nn.Linear and head.borrowed is shared.lm_head
    x = torch.randn(3, 64)
    torch.testing.assert_close(head.own(x), nn.functional.linear(x, head.own.dequantized_weight(), head.own.bias),
                               rtol=0.05, atol=0.05)


@pytest.mark.parametrize("name", ["q8_0", "q4_0"])
def test_a_quantized_head_is_refused_where_it_cannot_run(tiny_pair, eagle1_pair, monkeypatch, name):
    if kernels.available():
        with pytest.raises(ValueError, match=f"draft_dtype='{name}' is not possible here: an EAGLE-1 head shares"):
            _load(eagle1_pair, use_eagle3=False, draft_dtype=name)
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "no compiler")
    with pytest.raises(ValueError, match="not possible here: eagle's native kernels are unavailable \\(no compiler\\)"):
        _load(tiny_pair, draft_dtype=name)


def test_auto_leaves_the_head_of_a_model_off_the_kernels_as_before(tiny_pair):
    model = _load(tiny_pair)
    assert not any(isinstance(m, QuantLinear) for m in model.ea_layer.modules())
    assert quantized.draft_dtype_name(model.ea_layer) in ("float32", "bfloat16")


@needs_kernels
def test_the_native_head_layer_computes_what_the_head_modules_compute(tiny_pair):
    """The quantized head's decoder layer in one native call (eagle::eagle3_layer) against its modules: the same
    keys and values, outputs to float rounding (attention sums in its own order), in a causal pass after a past and
    in a tree-masked pass of two rows."""
    head = _load(tiny_pair, draft_dtype="q8_0").ea_layer
    plan = head.native_layer
    assert plan is not None and plan.numerics == "int8"
    torch.manual_seed(2)
    features = torch.randn(2, 7, head.feature_size)
    ids = torch.randint(3, 120, (2, 7))
    mask = torch.rand(2, 1, 3, 10) > 0.4
    mask[..., 7:] = torch.eye(3, dtype=torch.bool)  # every node sees itself
    results = {}
    with torch.inference_mode():
        for name, layer in (("native", plan), ("modules", None)):
            head.native_layer = layer
            hidden, past = head(features, ids, use_cache=True)
            tree_hidden, tree_past = head(hidden[:, -3:], ids[:, :3], attention_mask=mask,
                                          position_ids=torch.tensor([[7, 8, 8], [7, 7, 8]]), past_key_values=past,
                                          use_cache=True)
            results[name] = (hidden, past, tree_hidden, tree_past)
    head.native_layer = plan
    native, modules = results["native"], results["modules"]
    for got, want in ((native[0], modules[0]), (native[2], modules[2])):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # keys and values come from the layer's input alone: the same bits; after a pass, the same past with new slots
    assert all(torch.equal(a, b) for a, b in zip(native[1][0], modules[1][0]))
    for (k1, v1), (k2, v2) in ((native[1][0], modules[1][0]), (native[3][0], modules[3][0])):
        assert k1.shape == k2.shape == v1.shape == v2.shape
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-4)
    assert native[3][0][0].shape[2] == 10 and torch.equal(native[3][0][0][:, :, :7], native[1][0][0])
    with pytest.raises(ValueError, match="past keys must be"):
        torch.ops.eagle.eagle3_layer(
            features[..., :head.config.hidden_size].contiguous(), features[..., :head.config.hidden_size].contiguous(),
            plan.weights, plan.types, plan.norms, plan.dims, plan.eps, plan.scale, torch.zeros(2, 7, plan.dims[2]),
            torch.zeros(2, 7, plan.dims[2]), torch.zeros(3), torch.zeros(3), torch.zeros(1, dtype=torch.long),
            torch.zeros(0, dtype=torch.int32), plan.numerics, False)


@needs_kernels
def test_q4_0_puts_the_head_on_q4_0_blocks_and_keeps_the_output(tiny_pair):
    """draft_dtype="q4_0": every linear layer of the head over Q4_0 blocks (about half of Q8_0's bytes), the head
    named "q4_0", and greedy EAGLE output still plain decoding's token for token."""
    q8, model = _load(tiny_pair, draft_dtype="q8_0"), _load(tiny_pair, draft_dtype="q4_0")
    layers = [m for m in model.ea_layer.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == sum(isinstance(m, QuantLinear) for m in q8.ea_layer.modules()) > 0
    assert all(layer.type_name == "Q4_0" and layer.numerics == "int8" for layer in layers)
    assert quantized.draft_dtype_name(model.ea_layer) == "q4_0"
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (1, 12))
    assert torch.equal(model.eagenerate(ids, max_new_tokens=24), model.naivegenerate(ids, max_new_tokens=24))


def test_q4_0_blocks_are_gguf_py_s_byte_for_byte_and_other_types_are_refused():
    import gguf

    torch.manual_seed(1)
    weight = torch.randn(40, 64, dtype=torch.float16)
    expected = gguf.quants.quantize(weight.to(torch.float32).numpy(), gguf.GGMLQuantizationType.Q4_0)
    blocks = quantized.quantize_blocks(weight, "Q4_0", chunk_values=64 * 7)
    assert torch.equal(blocks, torch.from_numpy(expected))
    # and the blocks hold the weight: each value within one step (its block's scale) of what they dequantize to
    back = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), gguf.GGMLQuantizationType.Q4_0)).reshape(40, 64)
    steps = weight.float().reshape(40, 2, 32).abs().amax(-1, keepdim=True) / 8
    assert ((back.reshape(40, 2, 32) - weight.float().reshape(40, 2, 32)).abs() <= steps * 1.001 + 1e-6).all()
    with pytest.raises(ValueError, match="quantizes to"):
        quantized.quantize_blocks(weight, "Q4_K")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_q8_0_blocks_are_gguf_py_s_byte_for_byte(dtype):
    """quantize_blocks to Q8_0, chunk by chunk from the weight's own dtype, gives gguf-py's Q8_0 blocks of its float32
    values: zero blocks, halves that round away from zero, a chunk boundary inside the matrix."""
    import gguf

    torch.manual_seed(0)
    weight = torch.randn(70, 96) * 0.05
    weight[3, :32] = 0
    weight[9, 32:64] = torch.tensor([127.0, 63.5, -63.5, 0.5, -0.5, 1.5] + [0.0] * 26)
    weight = weight.to(dtype)
    expected = gguf.quants.quantize(weight.to(torch.float32).numpy(), gguf.GGMLQuantizationType.Q8_0)
    blocks = quantized.quantize_blocks(weight, "Q8_0", chunk_values=96 * 16)
    assert blocks.dtype == torch.uint8 and torch.equal(blocks, torch.from_numpy(expected))
    with pytest.raises(ValueError, match="multiple of 32"):
        quantized.quantize_blocks(torch.zeros(4, 40), "Q8_0")


@needs_kernels
def test_a_float16_head_is_quantized_from_its_checkpoint_as_from_its_float32_copy(tiny_pair, tmp_path):
    """A float16 checkpoint quantized at load (its linear weights never made float32 whole) gives the blocks of the
    float32 head quantized afterwards, and what it leaves float is float32."""
    import shutil

    from safetensors.torch import load_file, save_file

    base_dir, head_dir = tiny_pair
    half_dir = tmp_path / "head16"
    shutil.copytree(head_dir, half_dir)
    state = load_file(str(half_dir / "model.safetensors"))
    save_file({k: v.half() if v.is_floating_point() else v for k, v in state.items()},
              str(half_dir / "model.safetensors"))
    model = _load((base_dir, half_dir), draft_dtype="q8_0")
    expected = _load((base_dir, half_dir), draft_dtype="float32")
    assert quantized.quantize_head(expected.ea_layer, shared=expected.base_model) > 0
    mine, theirs = dict(model.ea_layer.named_modules()), dict(expected.ea_layer.named_modules())
    assert mine.keys() == theirs.keys()
    for name, module in mine.items():
        assert type(module) is type(theirs[name]), name
        if isinstance(module, QuantLinear):
            assert torch.equal(module.weight.packed, theirs[name].weight.packed), name
    floats = [p for p in model.ea_layer.parameters() if p.is_floating_point()]
    assert floats and all(p.dtype == torch.float32 for p in floats)
