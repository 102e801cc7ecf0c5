"""The attention backend is the one place that touches transformers' attention internals; each touch it names
(``TRANSFORMERS_TOUCHES``) still works on the pinned transformers."""

from __future__ import annotations

import copy
import dataclasses
import inspect
import sys

import pytest
import torch

from eagle.model.backends import attention
from eagle.model.base.target import Target
from tiny_models import make_target


def test_every_touch_is_named():
    assert set(attention.TRANSFORMERS_TOUCHES) == {"register", "select", "call_kwargs", "delegate", "module_eager",
                                                   "query_temperature", "kernel"}


def test_register_makes_our_functions_and_the_models_own_mask_builders_available():
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import eager_mask, sdpa_mask

    attention.register_our_attention()
    assert AttentionInterface()[attention.OUR_ATTENTION["sdpa"]] is attention.eagle_sdpa
    assert AttentionInterface()[attention.OUR_ATTENTION["eager"]] is attention.eagle_eager
    assert AttentionMaskInterface()[attention.OUR_ATTENTION["sdpa"]] is sdpa_mask
    assert AttentionMaskInterface()[attention.OUR_ATTENTION["eager"]] is eager_mask


@pytest.mark.parametrize("own", ["sdpa", "eager"])
def test_select_names_ours_once_and_other_calls_compute_what_they_did(tmp_path, own):
    """Built, the target names our function in the config the layers read; a call without our pass (a padded batch:
    a real mask) computes the bits of the model's own attention."""
    model = make_target(tmp_path / "base", "llama", seed=1)
    model.config._attn_implementation = own
    ids = torch.tensor([[0, 0, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    target = Target(model, feature_layers=None)
    assert model.model.layers[0].self_attn.config is target.config  # the config the selection writes
    assert target.config._attn_implementation == attention.OUR_ATTENTION[own] == target.forward_plan.attention
    with torch.no_grad():
        after = model(ids, attention_mask=mask).logits
    assert torch.equal(before, after)
    Target(model, feature_layers=None)  # a second target over the same model: ours stands for the model's own
    assert target.config._attn_implementation == attention.OUR_ATTENTION[own]


def test_call_kwargs_carry_our_pass_to_every_layer(tmp_path):
    model = make_target(tmp_path / "base", "llama", seed=1)
    target = Target(model, feature_layers=None)
    assert target.forward_plan.attend is attention.tree_sdpa_attention
    seen = []

    def spy(module, query, key, value, mask, **kwargs):
        seen.append(module.layer_idx)
        return attention.tree_sdpa_attention(module, query, key, value, mask, **kwargs)

    target.forward_plan = dataclasses.replace(target.forward_plan, attend=spy)
    target.prefill(torch.tensor([[1, 2, 3]]), target.new_cache(8), features=False)
    assert seen == list(range(model.config.num_hidden_layers))


def test_an_attention_set_anew_after_the_target_asks_for_a_new_plan(tmp_path):
    model = make_target(tmp_path / "base", "llama", seed=1)
    target = Target(model, feature_layers=None)
    model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="replan"):
        target.prefill(torch.tensor([[1, 2, 3]]), target.new_cache(8), features=False)
    target.replan()
    assert model.config._attn_implementation == attention.OUR_ATTENTION["sdpa"]
    target.prefill(torch.tensor([[1, 2, 3]]), target.new_cache(8), features=False)


def test_kernel_is_what_our_passes_run_with_the_gguf_kernels(tmp_path):
    from eagle.kernels.attention import attention_forward

    model = make_target(tmp_path / "base", "llama", seed=1)
    target = Target(model, feature_layers=None)
    assert not target.forward_plan.kernel_attention  # float layers: tree SDPA
    target.replan(kernel_attention=True)
    plan = target.forward_plan
    assert plan.kernel_attention and plan.attend is attention_forward and plan.native is None  # float layers
    assert model.config._attn_implementation == attention.OUR_ATTENTION["sdpa"]  # other callers: SDPA
    kernel_parameters = inspect.signature(attention_forward).parameters
    for name in ("module", "query", "key", "value", "attention_mask", "scaling", "dropout", "sliding_window"):
        assert name in kernel_parameters, name


def test_delegate_takes_the_arguments_we_pass():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    parameters = inspect.signature(sdpa_attention_forward).parameters
    for name in ("module", "query", "key", "value", "attention_mask", "dropout", "scaling", "is_causal"):
        assert name in parameters, name


def test_our_function_equals_transformers_sdpa_bit_for_bit(tmp_path):
    """Several queries under a mask with grouped heads (our path) vs transformers' own SDPA function."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = make_target(tmp_path / "base", "llama", seed=1)
    module = model.model.layers[0].self_attn
    module.eval()
    groups = module.num_key_value_groups
    assert groups > 1
    generator = torch.Generator().manual_seed(0)
    heads, dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    query = torch.randn(2, heads, 5, dim, generator=generator)
    key, value = (torch.randn(2, heads // groups, 12, dim, generator=generator) for _ in range(2))
    allowed = torch.rand(2, 1, 5, 12, generator=generator) > 0.3
    allowed[..., -1] = True
    mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
    ours, _ = attention.tree_sdpa_attention(module, query, key, value, mask, scaling=module.scaling)
    stock, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=module.scaling)
    assert torch.equal(ours, stock)


def _llama4(tmp_path):
    return make_target(tmp_path / "llama4", "llama4_text", seed=2, layers=4)


def test_query_temperature_attributes_are_those_transformers_reads(tmp_path):
    model = _llama4(tmp_path)
    nope = [layer.self_attn for layer in model.model.layers if not layer.self_attn.use_rope]
    assert nope and all(m.attn_temperature_tuning is True for m in nope)
    assert all(isinstance(m.floor_scale, (int, float)) and isinstance(m.attn_scale, float) for m in nope)
    assert all(isinstance(m.layer_idx, int) for m in nope)
    assert attention.QueryTemperature(model).modules == nope
    forward = inspect.signature(type(nope[0]).forward).parameters
    assert "hidden_states" in forward and "cache" in forward  # what the hook reads


def test_our_temperature_equals_transformers_own_where_slots_are_positions(tmp_path):
    """A prompt from slot 0: our position-based scaling is transformers' cache-length-based one."""
    model = _llama4(tmp_path)
    ids = torch.tensor([[1] + list(range(40, 58))])
    with torch.no_grad():
        theirs = model(ids).logits
    target = Target(model, feature_layers=None)
    assert target.forward_plan.temperature == tuple(attention.QueryTemperature(model).modules)
    ours = target.prefill(ids, target.new_cache(32), features=False, logits_to_keep=0).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_taken_over_temperature_gives_other_callers_their_bits(tmp_path):
    """After the target takes the temperature over (once), the model's own generate (a left-padded batch, positions
    from the cache length) computes the tokens and logits it computed before."""
    model = _llama4(tmp_path)
    reference = copy.deepcopy(model)
    ids = torch.tensor([[0, 0, 0] + list(range(40, 52)), list(range(60, 75))])
    mask = (ids != 0).long()
    Target(model, feature_layers=None)
    assert not any(m.attn_temperature_tuning for m in attention.QueryTemperature(model).modules)
    Target(model, feature_layers=None)  # taken over once: one hook per module
    assert all(len(m._forward_pre_hooks) == 1 for m in attention.QueryTemperature(model).modules)
    settings = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, output_logits=True,
                    return_dict_in_generate=True)
    mine, theirs = model.generate(ids, **settings), reference.generate(ids, **settings)
    assert torch.equal(mine.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(mine.logits, theirs.logits))


def test_module_eager_is_the_family_s_own_eager_function(tmp_path):
    """Our eager entry point calls the modeling module's eager_attention_forward (GPT-OSS's adds its sinks):
    with no temperature it is that function, bit for bit."""
    model = make_target(tmp_path / "gpt_oss", "gpt_oss", seed=2, layers=2)
    module = model.model.layers[0].self_attn
    eager = sys.modules[type(module).__module__].eager_attention_forward
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 5, 16, generator=generator)
    key, value = (torch.randn(1, 2, 9, 16, generator=generator) for _ in range(2))
    mask = torch.zeros(1, 1, 5, 9)
    for ours in (attention.module_eager_attention, attention.eagle_eager):
        got, _ = ours(module, query, key, value, mask, scaling=module.scaling)
        stock, _ = eager(module, query, key, value, mask, scaling=module.scaling)
        assert torch.equal(got, stock)
    assert hasattr(sys.modules[type(_llama4(tmp_path).model.layers[0].self_attn).__module__], "eager_attention_forward")
