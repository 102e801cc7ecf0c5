"""draft_dtype="q8_0": the draft head's linear layers over Q8_0 blocks of its weights with int8 activations on the
kernels (eagle.model.heads.quantized). The head proposes as the float head does (to Q8_0 rounding), the output
never changes, and where it cannot run the choice is refused (explicit) or left alone (auto)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eagle import kernels
from eagle.kernels.linear import QuantLinear
from eagle.model.ea_model import EaModel
from eagle.model.heads import quantized
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
    assert quantized.draft_dtype_name(model.ea_layer) == "q8_0"
    assert quantized.draft_dtype_name(float_model.ea_layer) == "float32"
    assert not any(isinstance(m, QuantLinear) for m in model.base_model.modules())  # the target is left alone
    torch.manual_seed(0)
    ids = torch.randint(3, 120, (1, 12))
    plain = model.naivegenerate(ids, max_new_tokens=24)
    assert torch.equal(model.eagenerate(ids, max_new_tokens=24), plain)
    assert torch.equal(float_model.eagenerate(ids, max_new_tokens=24), plain)


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


def test_q8_0_is_refused_where_it_cannot_run(tiny_pair, eagle1_pair, monkeypatch):
    if kernels.available():
        with pytest.raises(ValueError, match="draft_dtype='q8_0' is not possible here: an EAGLE-1 head shares"):
            _load(eagle1_pair, use_eagle3=False, draft_dtype="q8_0")
    monkeypatch.setattr(kernels, "available", lambda: False)
    monkeypatch.setattr(kernels, "unavailable_reason", lambda: "no compiler")
    with pytest.raises(ValueError, match="not possible here: eagle's native kernels are unavailable \\(no compiler\\)"):
        _load(tiny_pair, draft_dtype="q8_0")


def test_auto_leaves_the_head_of_a_model_off_the_kernels_as_before(tiny_pair):
    model = _load(tiny_pair)
    assert not any(isinstance(m, QuantLinear) for m in model.ea_layer.modules())
    assert quantized.draft_dtype_name(model.ea_layer) in ("float32", "bfloat16")
