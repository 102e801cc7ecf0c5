"""Every op of a decoder layer outside the linear layers and attention (which the GGUF kernels make row-invariant)
gives a token's row the same bits whatever else is in the call: RMSNorm (Llama's and Gemma's, over the hidden size
and over a head), the gated activations, softmax, and the rotary embedding of a position alone or among a tree's.
Speculative decoding is then exact by construction: a tree node's logits are the bits plain decoding computes for
the same token."""

from __future__ import annotations

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

ROWS = (1, 2, 3, 7, 8, 13, 16, 64, 300)
SIZES = (64, 256, 576, 640, 1536)  # head sizes (q/k norms) and the hidden / MLP sizes of SmolLM2 and Gemma 3


def rows_alone_equal(op, x: torch.Tensor) -> bool:
    """Whether op(x)'s rows equal op of a prefix of x (1..300 rows) and of each row alone, bit for bit."""
    full = op(x)
    for n in ROWS:
        part = op(x[:n])
        if not (torch.equal(part[0], full[0]) and torch.equal(part[n - 1], full[n - 1])):
            return False
    return all(torch.equal(op(x[i : i + 1])[0], full[i]) for i in (0, 5, x.shape[0] - 1))


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    previous = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(previous)


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("norm_class", [LlamaRMSNorm, Gemma3RMSNorm])
def test_rms_norm_rows_are_invariant(norm_class, size, threads):
    torch.manual_seed(size)
    norm = norm_class(size)
    norm.weight.data.normal_()
    with torch.no_grad():
        assert rows_alone_equal(norm, torch.randn(300, size))


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_gated_activation_and_softmax_rows_are_invariant(activation, threads):
    torch.manual_seed(1)
    function = ACT2FN[activation]
    for size in SIZES:
        gate, up = torch.randn(300, size), torch.randn(300, size)
        both = torch.cat([gate, up], dim=1)
        assert rows_alone_equal(lambda x: function(x[:, :size]) * x[:, size:], both)
        assert rows_alone_equal(lambda x: torch.softmax(x, dim=-1), gate)
        assert rows_alone_equal(lambda x: x + 0.5 * x.flip(-1), gate)  # a residual add


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
def test_rotary_embedding_of_a_position_is_the_same_alone_and_in_a_tree(family, threads):
    """cos / sin of position p computed alone (plain decoding) and among a tree's positions (p repeated at several
    depths, out of order) have the same bits, and so do the rotated queries."""
    from transformers import AutoConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = AutoConfig.for_model(family, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                  head_dim=64, max_position_embeddings=4096)
    rotary = {"llama": LlamaRotaryEmbedding, "qwen3": Qwen3RotaryEmbedding,
              "gemma3_text": Gemma3RotaryEmbedding}[family](config)
    hidden = torch.zeros(1, 1, 576)
    tree = torch.tensor([[517, 518, 518, 519, 518, 520, 519, 521, 522, 519, 520, 523]])
    query = torch.randn(1, 9, tree.shape[1], 64)
    kwargs = {"layer_type": "sliding_attention"} if family == "gemma3_text" else {}
    cos_tree, sin_tree = rotary(hidden, tree, **kwargs)
    rotated, _ = apply_rotary_pos_emb(query, query, cos_tree, sin_tree)
    for index, position in enumerate(tree[0].tolist()):
        cos, sin = rotary(hidden, torch.tensor([[position]]), **kwargs)
        assert torch.equal(cos[0, 0], cos_tree[0, index]) and torch.equal(sin[0, 0], sin_tree[0, index])
        alone, _ = apply_rotary_pos_emb(query[:, :, index : index + 1], query[:, :, index : index + 1], cos, sin)
        assert torch.equal(alone[:, :, 0], rotated[:, :, index])


def test_the_checker_sees_a_row_dependent_op():
    """An op whose rows depend on the other rows (a mean over the batch) is caught."""
    assert not rows_alone_equal(lambda x: x - x.mean(0, keepdim=True), torch.randn(300, 64))
