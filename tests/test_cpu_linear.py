"""Packed CPU linear layers: same results as nn.Linear, never stale, invisible to training, state_dict and copies."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from eagle.model import EaModel
from eagle.model.backends import linear as linear_backends
from eagle.model.backends import onednn as cpu_linear
from eagle.model.backends.onednn import PackedLinear, pack_linear_layers, unpack_linear_layers
from tiny_models import make_tiny_pair

pytestmark = pytest.mark.skipif(not cpu_linear.packing_available(), reason="this torch build cannot pack weights")


def _net(bias: bool = True) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40, bias=bias), nn.ReLU(), nn.Linear(40, 8, bias=False))


@pytest.mark.parametrize("shape", [(1, 24), (9, 24), (2, 5, 24), (0, 24), (130, 24)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_layers_compute_what_nn_linear_computes(shape, bias):
    net = _net(bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        expected = net(x)
        assert pack_linear_layers(net) == 2
        assert all(type(layer) is PackedLinear for layer in (net[0], net[2]))
        torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(net(x.transpose(-1, -2).contiguous().transpose(-1, -2)), expected,
                                   rtol=1e-5, atol=1e-5)  # a non-contiguous input
    assert unpack_linear_layers(net) == 2
    assert type(net[0]) is nn.Linear and not hasattr(net[0], "_packed")


def test_a_weight_changed_after_packing_is_used_not_the_stale_copy():
    net = _net()
    pack_linear_layers(net)
    x = torch.randn(3, 24)
    with torch.no_grad():
        net(x)
        net[0].weight.mul_(2)  # in place
        expected = torch.relu(x @ net[0].weight.T + net[0].bias) @ net[2].weight.T
        torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)
        fresh = _net()
        fresh[2].weight.copy_(torch.randn(8, 40))
        net.load_state_dict(fresh.state_dict())  # what loading a checkpoint does
        assert set(net.state_dict()) == {"0.weight", "0.bias", "2.weight"}
        torch.testing.assert_close(net(x), fresh(x), rtol=1e-5, atol=1e-5)
        net[2].weight = nn.Parameter(torch.zeros(8, 40))  # replaced outright
        assert torch.count_nonzero(net(x)) == 0
        net[2].weight.data.fill_(1.0)  # .data has its own version counter: invisible until packed again
        assert pack_linear_layers(net) == 2
        torch.testing.assert_close(net(x), torch.relu(net[0](x)).sum(-1, keepdim=True).expand(3, 8))


def test_training_other_dtypes_and_copies_take_the_ordinary_path():
    net, reference = _net(), _net()
    pack_linear_layers(net)
    x = torch.randn(4, 24)
    net(x).square().sum().backward()
    reference(x).square().sum().backward()
    torch.testing.assert_close(net[0].weight.grad, reference[0].weight.grad)

    double = copy.deepcopy(net).double()
    assert double(x.double()).dtype == torch.float64
    with torch.no_grad():
        torch.testing.assert_close(double(x.double()).float(), reference(x), rtol=1e-5, atol=1e-5)
        clone = copy.deepcopy(net)
        assert type(clone[0]) is PackedLinear
        torch.testing.assert_close(clone(x), reference(x), rtol=1e-5, atol=1e-5)
        restored = pickle.loads(pickle.dumps(net))
        torch.testing.assert_close(restored(x), reference(x), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_linear.native_bfloat16(), reason="this CPU does not compute in bfloat16 natively")
def test_bfloat16_layers_are_packed_where_the_cpu_computes_in_bfloat16():
    net = _net().bfloat16()
    x = torch.randn(5, 24).bfloat16()
    with torch.no_grad():
        expected = net(x).float()
        assert pack_linear_layers(net) == 2
        assert net[0]._packed_call(x) and not net[0]._packed_call(x.float())
        torch.testing.assert_close(net(x).float(), expected, rtol=2e-2, atol=2e-2)


def test_bfloat16_layers_stay_unpacked_where_bfloat16_is_emulated(monkeypatch):
    monkeypatch.setattr(cpu_linear, "native_bfloat16", lambda: False)
    net = _net()
    net[0].bfloat16()
    assert pack_linear_layers(net) == 1  # the float32 layer only
    assert type(net[0]) is nn.Linear and type(net[2]) is PackedLinear


def test_a_build_without_onednn_leaves_the_layers_alone(monkeypatch):
    monkeypatch.setattr(cpu_linear, "packing_available", lambda: False)
    net = _net()
    assert pack_linear_layers(net) == 0
    assert type(net[0]) is nn.Linear


def test_from_pretrained_packs_a_float32_cpu_model_and_stays_lossless(tmp_path):
    base, head = make_tiny_pair(tmp_path, "llama", eagle3=True)
    packed = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=8, depth=3,
                                     top_k=4)
    plain = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=8, depth=3,
                                    top_k=4, pack_cpu_weights=False)
    layers = [m for m in packed.base_model.modules() if isinstance(m, nn.Linear)]
    assert layers and all(type(m) is PackedLinear for m in layers)
    assert all(type(m) is PackedLinear for m in packed.ea_layer.modules() if isinstance(m, nn.Linear))
    assert not any(type(m) is PackedLinear for m in plain.modules())
    assert set(packed.state_dict()) == set(plain.state_dict())
    for prompt in ([1, 44, 45, 46, 47], [1, 30, 31, 60, 61, 62]):
        input_ids = torch.tensor([prompt])
        ea = packed.eagenerate(input_ids, max_new_tokens=24)
        assert torch.equal(ea, packed.naivegenerate(input_ids, max_new_tokens=24))
        assert torch.equal(ea, plain.naivegenerate(input_ids, max_new_tokens=24))
    assert packed.set_cpu_weight_packing(False) == len(layers) + sum(
        isinstance(m, nn.Linear) for m in packed.ea_layer.modules())
    assert not any(type(m) is PackedLinear for m in packed.modules())
    with pytest.raises(ValueError, match="pack_cpu_weights must be True, False or 'auto'"):
        EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), pack_cpu_weights="yes")


def test_auto_packing_skips_models_too_big_to_double(tmp_path, monkeypatch):
    base, head = make_tiny_pair(tmp_path, "qwen2", eagle3=True)
    monkeypatch.setattr(cpu_linear, "AUTO_PACK_LIMIT_BYTES", 1024)
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head))
    assert not any(type(m) is PackedLinear for m in model.modules())
    forced = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), pack_cpu_weights=True)
    assert any(type(m) is PackedLinear for m in forced.base_model.modules())


def test_a_copy_that_never_ran_can_be_unpacked():
    net = _net()
    pack_linear_layers(net)
    clone = copy.deepcopy(net)
    assert unpack_linear_layers(clone) == 2 and type(clone[0]) is nn.Linear


def test_the_row_limit_rule_follows_the_cpu_and_an_explicit_limit(monkeypatch):
    monkeypatch.setattr(cpu_linear, "PACKED_MAX_ROWS", None)
    for capability, limit in (("AVX512", None), ("AVX512_BF16", None), ("AMX", None), ("AVX2", 64), ("DEFAULT", 64)):
        cpu_linear._cpu_row_limit.cache_clear()
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability)
        assert cpu_linear.packed_max_rows() == limit
    cpu_linear._cpu_row_limit.cache_clear()
    monkeypatch.setattr(cpu_linear, "PACKED_MAX_ROWS", 16)
    assert cpu_linear.packed_max_rows() == 16
    monkeypatch.undo()
    cpu_linear._cpu_row_limit.cache_clear()


@pytest.mark.parametrize("limit", [None, 64, 8])
def test_long_calls_are_exact_under_every_row_limit(monkeypatch, limit):
    """A batch's trees (hundreds of rows) and a long prefill give nn.Linear's results whether they take the packed
    copy (no limit) or F.linear (a limit below their rows)."""
    monkeypatch.setattr(cpu_linear, "PACKED_MAX_ROWS", limit)
    net = _net()
    x = torch.randn(3, 100, 24)  # 300 rows
    with torch.no_grad():
        expected = net(x)
        pack_linear_layers(net)
        used = []
        original = torch.ops.mkldnn._linear_pointwise
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: used.append(1) or original(*a),
                            raising=False)
        torch.testing.assert_close(net(x), expected, rtol=1e-5, atol=1e-5)
    assert bool(used) == (cpu_linear.packed_max_rows() is None or cpu_linear.packed_max_rows() >= 300)


@pytest.mark.parametrize("flat", [False, True])
def test_under_real_rows_only_a_packed_layer_computes_the_real_rows_alone(flat, monkeypatch):
    net = _net()
    pack_linear_layers(net)
    real = torch.zeros(2, 12, dtype=torch.bool)
    real[0, :5] = real[1, :3] = True  # 16 padding rows
    x = torch.randn(2, 12, 24)
    if flat:
        x = x.reshape(24, 24)
    seen = []
    compute = PackedLinear._linear
    monkeypatch.setattr(PackedLinear, "_linear", lambda self, rows: seen.append(rows[..., 0].numel()) or compute(self, rows))
    with torch.no_grad():
        expected = net(x)
        seen.clear()
        with linear_backends.real_rows_only(real):
            got = net(x)
            other = net[0](torch.randn(4, 24))  # not one row per token of the call: computed as it is
    assert seen == [8, 8, 4]  # the 8 real rows in each layer, the 4 rows of the other call
    assert other.shape == (4, 40)
    mask = real.reshape(-1)
    got, expected = got.reshape(24, 8), expected.reshape(24, 8)
    torch.testing.assert_close(got[mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert torch.count_nonzero(got[~mask]) == 0
    few = torch.ones(2, 12, dtype=torch.bool)
    few[1, -linear_backends.MIN_PADDING_ROWS + 1:] = False
    for real in (torch.ones(2, 12, dtype=torch.bool), few):  # no padding; too few padding rows to be worth skipping
        with linear_backends.real_rows_only(real), torch.no_grad():
            seen.clear()
            net(x)  # every row, in one call per layer
        assert seen == [24, 24]


def test_layers_reading_the_same_input_gather_its_real_rows_once(monkeypatch):
    first, second = _net(), _net(bias=False)
    pack_linear_layers(first)
    pack_linear_layers(second)
    real = torch.zeros(2, 12, dtype=torch.bool)
    real[:, :2] = True
    x = torch.randn(2, 12, 24)
    gathered = []
    index_select = torch.Tensor.index_select
    monkeypatch.setattr(torch.Tensor, "index_select", lambda t, *a: gathered.append(t.shape) or index_select(t, *a))
    with torch.no_grad(), linear_backends.real_rows_only(real):
        a, b = first[0](x), second[0](x)  # the same input: gathered once
        x.mul_(2)  # changed in place: gathered again
        c = first[0](x)
    assert sum(shape[-1] == 24 for shape in gathered) == 2  # gathers of the input (the others: the outputs)
    with torch.no_grad():
        torch.testing.assert_close(a[real], first[0](x / 2)[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(b[real], second[0](x / 2)[real], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c[real], first[0](x)[real], rtol=1e-5, atol=1e-5)


def test_real_rows_only_leaves_plain_linear_layers_alone():
    net = _net()
    x = torch.randn(2, 5, 24)
    with torch.no_grad():
        expected = net(x)
        with linear_backends.real_rows_only(torch.tensor([[True] * 5, [True] + [False] * 4])):
            got = net(x)
    assert torch.equal(got, expected)
