"""The KV cache's bytes per slot that a target knows from its config (Target.slot_bytes, which the memory checks read)
are the bytes its model writes, and building the target runs no forward pass for them."""

from __future__ import annotations

import pytest
import torch

from eagle import kernels
from eagle.model.base.target import CONFIG_SIZED_CACHES, Target, config_slot_bytes
from tiny_models import target_config

# each model type of CONFIG_SIZED_CACHES: the tiny_models family and overrides of its tiny model (Qwen3 with a head
# size other than hidden_size / heads, as a Qwen3 GGUF gets; Gemma 3 with sliding-window layers)
TINY = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "mixtral": ("mixtral", {}),
    "phi3": ("phi3", {}),
    "gemma": ("gemma", {}),
    "gemma3_text": ("gemma3_text", dict(head_dim=16, sliding_window=4, layers=6)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=64, use_sliding_window=False)),
    "qwen3_moe": ("qwen3_moe", {}),
    "llama4_text": ("llama4_text", {}),
    "gpt_oss": ("gpt_oss", {}),
    "olmoe": ("olmoe", {}),
    "granitemoe": ("granitemoe", {}),
    "smollm3": ("smollm3", dict(use_sliding_window=False)),
}


def _tiny(model_type: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    family, overrides = TINY[model_type]
    overrides = dict(overrides)
    torch.manual_seed(0)
    config = target_config(family, layers=overrides.pop("layers", 2), **overrides)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def _built_without_a_forward(model, monkeypatch) -> Target:
    """A target of ``model``, built while any forward pass of a target would fail the test."""
    with monkeypatch.context() as patch:
        patch.setattr(Target, "_run", lambda *args, **kwargs: pytest.fail("building the target ran a forward pass"))
        return Target(model, feature_layers=None)


def test_every_config_sized_family_is_checked_here():
    assert sorted(TINY) == sorted(CONFIG_SIZED_CACHES)


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_the_config_gives_the_bytes_the_model_writes(model_type, monkeypatch):
    model = _tiny(model_type)
    assert model.config.get_text_config().model_type == model_type
    target = _built_without_a_forward(model, monkeypatch)
    assert target.slot_bytes() == target.measured_slot_bytes() > 0


def test_a_bfloat16_model_is_sized_in_its_dtype(monkeypatch):
    model = _tiny("llama", torch.bfloat16)
    target = _built_without_a_forward(model, monkeypatch)
    assert target.slot_bytes() == target.measured_slot_bytes() == config_slot_bytes(_tiny("llama"), torch.float32) // 2


@pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here")
@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_a_model_on_the_kernels_is_sized_like_its_float_model(model_type, monkeypatch):
    """On the GGUF kernels, with the native decoder writing the cache: the same bytes as transformers' layers."""
    from test_native_decoder import quantized_model

    family, overrides = TINY[model_type]
    overrides = {key: value for key, value in overrides.items() if key != "layers"}
    model = quantized_model(family, **overrides)
    target = _built_without_a_forward(model, monkeypatch)
    assert target.forward_plan.native is not None
    assert target.slot_bytes() == target.measured_slot_bytes()


def test_families_whose_cache_the_config_does_not_say_are_measured(monkeypatch):
    """An MLA model caches its compressed latent; a family never checked here, or a model with a quantizer, is
    measured rather than guessed."""
    from transformers import AutoModelForCausalLM

    config = target_config("glm4_moe_lite", layers=2)
    mla = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert config_slot_bytes(mla, torch.float32) is None
    assert Target(mla, feature_layers=None).slot_bytes() == 2 * (config.kv_lora_rank + config.qk_rope_head_dim) * 4
    unchecked = _tiny("llama")
    unchecked.config.model_type = "llama_variant"
    assert config_slot_bytes(unchecked, torch.float32) is None
    quantized = _tiny("llama")
    quantized.hf_quantizer = object()
    assert config_slot_bytes(quantized, torch.float32) is None
