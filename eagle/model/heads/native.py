"""The quantized EAGLE-3 head's decoder layer in one native call (``eagle::eagle3_layer``, ``eagle/csrc/decoder.cpp``).

A draft pass over a token or two is a few dozen small tensor operations in Python (norms, projections, rotary,
attention, MLP) whose dispatch costs more than their arithmetic; the native layer runs them in one call over the
kernels' Q8_0 or Q4_0 layers (``draft_dtype``). It computes the layer
:class:`~eagle.model.heads.draft_layers.Eagle3DecoderLayer` describes, with the kernels' rounding (their row norm,
int8 activations, position-ordered attention): the head's proposals may differ in the last bits from the module
path's, the output never does, since the target verifies every token.

:func:`head_layer_plan` decides once, at quantization, whether the head's layer can run natively (a head of one
decoder layer whose projections are all kernel layers without biases); else the module path runs as before. It
reads the layer with the target's readers (:mod:`eagle.model.base.layer_spec`: activation, norm factors and
epsilon, attention scale), and the op runs the target's layer body (``eagle/csrc/decoder.cpp``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


@dataclass
class HeadLayerPlan:
    """What ``eagle::eagle3_layer`` reads of a head's decoder layer."""

    weights: list[torch.Tensor]  # packed q, k, v, o, gate, up, down
    types: list[str]
    norms: list[torch.Tensor]  # input_layernorm, hidden_norm, post_attention_layernorm
    dims: list[int]  # q heads, kv heads, head size, MLP size
    eps: float
    scale: float
    numerics: str
    norm_before_residual: bool

    def __call__(self, embeds, hidden, cos, sin, attention_mask, past):
        """The layer over (B, T, H) ``embeds`` and ``hidden`` after ``past`` ((B, kv, P, D) keys and values, or
        None); ``attention_mask``: bool (B or 1, 1, T, P + T), or None for causal attention. Returns the output
        (B, T, H) and the (keys, values) over P + T slots."""
        from eagle.kernels.attention import visible_keys
        from eagle.model.heads.draft_layers import causal_mask_with_past

        batch, length, _ = hidden.shape
        if past is None:
            empty = hidden.new_empty(batch, self.dims[1], 0, self.dims[2])
            past = (empty, empty)
        if attention_mask is None:
            attention_mask = causal_mask_with_past(length, past[0].shape[2], hidden.device)
        lists = visible_keys(attention_mask, True)
        if cos.shape[0] != batch:
            cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
        out, keys, values = torch.ops.eagle.eagle3_layer(
            embeds.contiguous(), hidden.contiguous(), self.weights, self.types, self.norms, self.dims, self.eps,
            self.scale, cos.contiguous(), sin.contiguous(), past[0].contiguous(), past[1].contiguous(), lists.offsets,
            lists.indices, self.numerics, self.norm_before_residual)
        return out, (keys, values)


def head_layer_plan(head) -> HeadLayerPlan | None:
    """The native plan of ``head``'s decoder layer, or None (logged) where the module path must run."""
    problem = _plan_problem(head)
    if problem is not None:
        logger.info("The draft head's decoder layer runs through its modules: %s.", problem)
        return None
    from eagle.model.base.layer_spec import attention_scale, norm_eps, norm_factor

    layer = head.midlayer
    attention, mlp = layer.self_attn, layer.mlp
    linears, norms = _parts(layer)
    return HeadLayerPlan(
        [m.weight.packed for m in linears], [m.type_name for m in linears], [norm_factor(n) for n in norms],
        [attention.num_heads, attention.num_kv_heads, attention.head_dim, mlp.gate_proj.out_features],
        norm_eps(norms[0]), attention_scale(attention), linears[0].numerics, layer.norm_before_residual)


def _parts(layer) -> tuple[tuple, tuple]:
    """The layer's projections (q, k, v, o, gate, up, down) and norms (input, hidden, post-attention), in the order
    ``eagle::eagle3_layer`` takes them."""
    attention, mlp = layer.self_attn, layer.mlp
    return ((attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj,
             mlp.down_proj), (layer.input_layernorm, layer.hidden_norm, layer.post_attention_layernorm))


def _plan_problem(head) -> str | None:
    from eagle import kernels
    from eagle.kernels.linear import QuantLinear
    from eagle.model.base.layer_spec import NORM_OFFSETS, activation_name, norm_eps

    if not kernels.available() or not hasattr(torch.ops.eagle, "eagle3_layer"):
        return "the compiled extension has no eagle::eagle3_layer"
    if getattr(head, "eagle_version", None) != 3 or not hasattr(head, "midlayer"):
        return "it is not an EAGLE-3 head"
    if len(getattr(head, "layers", ())):
        return "the head has more than one decoder layer"
    layer = head.midlayer
    attention, mlp = layer.self_attn, layer.mlp
    linears, norms = _parts(layer)
    if not all(isinstance(m, QuantLinear) and m.uses_kernels for m in linears):
        return "its projections are not all on the kernels"
    if any(m.bias is not None for m in linears):
        return "a projection has a bias"
    if len({m.numerics for m in linears}) != 1:
        return "its projections mix numerics"
    if activation_name(mlp.act_fn) != "silu":
        return f"its MLP activation is {type(mlp.act_fn).__name__}, not SiLU"
    if any(type(n).__name__ not in NORM_OFFSETS for n in norms):
        return "its norms are not an RMSNorm the native layer knows"
    if len({norm_eps(n) for n in norms}) != 1 or any(n.weight.dtype != torch.float32 for n in norms):
        return "its norms differ in epsilon or are not float32"
    if (attention.num_heads * attention.head_dim, attention.num_kv_heads * attention.head_dim) != (
            attention.q_proj.out_features, attention.k_proj.out_features):
        return "its projections are not whole heads"
    return None
