"""The attention backend is the one place that touches transformers' attention internals; each touch it names
(``TRANSFORMERS_TOUCHES``) still works on the pinned transformers."""

from __future__ import annotations

import inspect

import torch

from eagle.model.backends import attention
from tiny_models import make_target


def test_every_touch_is_named():
    assert set(attention.TRANSFORMERS_TOUCHES) == {"register", "switch", "delegate", "query_temperature",
                                                   "module_eager", "kernel"}


def test_kernel_registers_the_position_ordered_kernel_and_the_switch_names_it(tmp_path):
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    from eagle.kernels.attention import attention_forward

    model = make_target(tmp_path / "base", "llama", seed=1)
    config = model.config.get_text_config()
    attention.use_kernel_attention(config)
    try:
        assert AttentionInterface()[attention.KERNEL_ATTENTION] is attention_forward
        assert AttentionMaskInterface()[attention.KERNEL_ATTENTION] is sdpa_mask
        with attention.our_attention(config):
            assert model.model.layers[0].self_attn.config._attn_implementation == attention.KERNEL_ATTENTION
        assert config._attn_implementation == "sdpa"
    finally:
        attention.use_kernel_attention(config, enabled=False)
    with attention.our_attention(config):
        assert config._attn_implementation == attention.TREE_SDPA


def test_register_makes_our_function_and_sdpa_s_mask_builder_available(tmp_path):
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    model = make_target(tmp_path / "base", "llama", seed=1)
    attention.prepare_attention(model.config)
    assert AttentionInterface()[attention.TREE_SDPA] is attention.tree_sdpa_attention
    assert AttentionMaskInterface()[attention.TREE_SDPA] is sdpa_mask


def test_switch_names_our_function_during_our_passes_and_restores_sdpa(tmp_path):
    model = make_target(tmp_path / "base", "llama", seed=1)
    config = model.config.get_text_config()
    layer_config = model.model.layers[0].self_attn.config
    assert layer_config is config  # what the layers read is the config the switch writes
    assert config._attn_implementation == "sdpa"
    with attention.our_attention(config):
        assert layer_config._attn_implementation == attention.TREE_SDPA
    assert config._attn_implementation == "sdpa"
    eager = make_target(tmp_path / "eager", "llama", seed=1)
    eager.config._attn_implementation = "eager"
    with attention.our_attention(eager.config):  # eager attention honours 4-D masks itself: left alone
        assert eager.config._attn_implementation == "eager"


def test_switch_is_restored_when_the_pass_fails(tmp_path):
    model = make_target(tmp_path / "base", "llama", seed=1)
    config = model.config.get_text_config()
    try:
        with attention.our_attention(config):
            raise RuntimeError("a forward pass failed")
    except RuntimeError:
        pass
    assert config._attn_implementation == "sdpa"


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
    assert attention.QueryTemperature(model).modules == nope


def test_our_temperature_equals_transformers_own_where_slots_are_positions(tmp_path):
    """A prompt from slot 0: our position-based scaling is transformers' cache-length-based one."""
    from eagle.model.base.target import Target

    model = _llama4(tmp_path)
    ids = torch.tensor([[1] + list(range(40, 58))])
    target = Target(model, feature_layers=None)
    ours = target.prefill(ids, target.new_cache(32), features=False, logits_to_keep=0).logits
    with torch.no_grad():
        theirs = model(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    assert all(m.attn_temperature_tuning for m in target.temperature.modules)  # restored after the pass


def test_query_temperature_switch_is_restored_when_the_pass_fails(tmp_path):
    model = _llama4(tmp_path)
    temperature = attention.QueryTemperature(model)
    try:
        with attention.our_attention(model.config, temperature, torch.zeros(1, 3, dtype=torch.long)):
            assert not any(m.attn_temperature_tuning for m in temperature.modules)
            raise RuntimeError("a forward pass failed")
    except RuntimeError:
        pass
    assert all(m.attn_temperature_tuning for m in temperature.modules)
    assert model.config._attn_implementation == "sdpa" and attention._TEMPERATURE.get() is None


def test_module_eager_is_the_family_s_own_eager_function(tmp_path):
    """Our eager entry point calls the modeling module's eager_attention_forward (GPT-OSS's adds its sinks):
    with no temperature active it is that function, bit for bit."""
    import sys

    model = make_target(tmp_path / "gpt_oss", "gpt_oss", seed=2, layers=2)
    module = model.model.layers[0].self_attn
    eager = sys.modules[type(module).__module__].eager_attention_forward
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 5, 16, generator=generator)
    key, value = (torch.randn(1, 2, 9, 16, generator=generator) for _ in range(2))
    mask = torch.zeros(1, 1, 5, 9)
    ours, _ = attention.tree_eager_attention(module, query, key, value, mask, scaling=module.scaling)
    stock, _ = eager(module, query, key, value, mask, scaling=module.scaling)
    assert torch.equal(ours, stock)
    assert hasattr(sys.modules[type(_llama4(tmp_path).model.layers[0].self_attn).__module__], "eager_attention_forward")
