"""The families beyond Llama and Gemma 3 that load straight into the kernels (Qwen2 with its q/k/v biases, Qwen3 with
its q/k norms, the mixture-of-experts Qwen2-MoE with its shared expert and Qwen3-MoE): a tiny random model of each,
written to a GGUF file, built on the meta device and filled from the file
(:func:`eagle.model.base.loading.build_gguf_model`) is the model the float32-then-convert path builds (transformers'
float32 model, then :func:`eagle.model.backends.gguf.convert_gguf_model`): the same modules, the same packed blocks,
the same float parameters and buffers, logits equal bit for bit, in both numerics."""

from __future__ import annotations

import pytest
import torch

from eagle import kernels
from eagle.model.backends import gguf
from eagle.model.backends.gguf_experts import KernelExperts, KernelRouter
from eagle.model.base.loading import build_gguf_model, direct_gguf_load_possible
from test_gguf_direct_load import _assert_same_model
from tiny_models import target_config, write_gguf_target

pytestmark = pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here")

# family: (model type, GGUF architecture, config overrides)
FAMILIES = {
    "qwen2": ("qwen2", "qwen2", dict(use_sliding_window=False)),
    "qwen3": ("qwen3", "qwen3", dict(head_dim=128)),
    "qwen2_moe": ("qwen2_moe", "qwen2moe", dict(use_sliding_window=False, num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", "qwen3moe", dict(head_dim=16, moe_intermediate_size=768, num_experts=4,
                                                 num_experts_per_tok=2)),
}
PROMPT = [[1, 17, 40, 99, 23, 8, 61, 77, 30, 12]]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_file(request, tmp_path_factory):
    """(family, directory, GGUF path): a tiny random model of the family written as a Q8_0 GGUF file."""
    from transformers import AutoModelForCausalLM

    model_type, architecture, overrides = FAMILIES[request.param]
    torch.manual_seed(0)
    config = target_config(model_type, layers=2, **overrides)
    random = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory = tmp_path_factory.mktemp(request.param)
    return request.param, directory, write_gguf_target(random, directory / "model.gguf", architecture)


@pytest.mark.parametrize("numerics", ["float32", "int8"])
def test_the_direct_load_builds_what_the_float32_path_builds(family_file, numerics):
    from transformers import AutoConfig, AutoModelForCausalLM

    family, directory, path = family_file
    today = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    converted = gguf.convert_gguf_model(today, str(path), numerics)
    config = AutoConfig.from_pretrained(str(directory), gguf_file=path.name)
    direct, count = build_gguf_model(str(path), config, numerics, attn_implementation="sdpa")
    assert count == converted > 0 and gguf.kernel_modules(direct) == gguf.kernel_modules(today)
    _assert_same_model(direct, today)
    if family.endswith("_moe"):
        assert {type(m) for m in direct.modules()} >= {KernelExperts, KernelRouter}
    with torch.no_grad():
        ids = torch.tensor(PROMPT)
        assert torch.equal(direct(ids).logits, today(ids).logits)


def test_each_family_is_loaded_directly(family_file):
    _, _, path = family_file
    assert gguf.loads_tensor_by_tensor(gguf.gguf_architecture(str(path)))
    assert direct_gguf_load_possible(str(path), {})
