"""Building blocks of the EAGLE-1 and EAGLE-3 draft heads: norm, MLP, attention, RoPE and the two heads' decoder
layers.

Names follow the official checkpoints (``self_attn.q_proj``, ``mlp.gate_proj``, ``input_layernorm``...), so a
state dict published by the reference loads into these modules unchanged.

The attention takes an explicit boolean mask and an explicit past ``(key, value)`` pair and returns the new
pair: no hidden state on the module. The same projections serve inference (tree drafting) and training
(training-time test), through :meth:`DraftAttention.project`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

KVPair = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """``w * x / sqrt(mean(x^2) + eps)``, normalised in float32 and cast back before the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x32.to(dtype)


def bias_flags(config) -> tuple[bool, bool, bool]:
    """(q/k/v projections, o projection, MLP) biases of a head's layers: ``qkv_bias`` (EAGLE-1 Qwen2 heads;
    also set from a checkpoint's tensors), ``o_proj_bias`` and ``mlp_bias`` (see
    :mod:`eagle.model.heads.layouts`); none by default."""
    return (bool(getattr(config, "qkv_bias", False)), bool(getattr(config, "o_proj_bias", False)),
            bool(getattr(config, "mlp_bias", False)))


class DraftMLP(nn.Module):
    """SwiGLU MLP: ``down(act(gate(x)) * up(x))``, without biases unless ``bias``."""

    def __init__(self, config, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DraftAttention(nn.Module):
    """Multi-head attention with GQA and RoPE.

    ``input_size`` is ``H`` for EAGLE-1 and ``2H`` for EAGLE-3 (embedding and feature side by side).
    """

    def __init__(self, config, input_size: int, qkv_bias: bool = False, o_bias: bool = False):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or config.num_attention_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(input_size, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(input_size, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=o_bias)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Queries, keys and values with RoPE applied.

        x: (B, T, input_size); cos/sin: (B, T, head_dim).
        Returns q (B, nH, T, hd), k (B, nKV, T, hd), v (B, nKV, T, hd).
        """
        bsz, length, _ = x.shape
        q = self.q_proj(x).view(bsz, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_value: KVPair | None = None,
    ) -> tuple[torch.Tensor, KVPair]:
        """x: (B, T, input_size); attention_mask: bool (B or 1, 1, T, past + T), True = may attend, or None for
        plain causal attention without a past. Returns the output (B, T, H) and the (key, value) pair over
        past + new positions."""
        q, k, v = self.project(x, cos, sin)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attention_mask,
            is_causal=attention_mask is None and q.shape[2] > 1,
            enable_gqa=self.num_kv_heads != self.num_heads,
        )
        bsz, _, length, _ = out.shape
        out = out.transpose(1, 2).reshape(bsz, length, self.num_heads * self.head_dim)
        return self.o_proj(out), (k, v)


class Eagle3DecoderLayer(nn.Module):
    """``h = r + attn(cat(input_layernorm(e), hidden_norm(h)))``; ``h = h + mlp(post_attention_layernorm(h))``,
    where the residual ``r`` is ``h`` itself, or ``hidden_norm(h)`` for a head trained with
    ``norm_before_residual`` (speculators / vLLM ``_norm_before_residual``). The attention's q/k/v projections take
    the 2H concatenation (embedding first)."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        qkv_bias, o_bias, mlp_bias = bias_flags(config)
        self.norm_before_residual = bool(getattr(config, "norm_before_residual", False))
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, input_size=2 * hidden, qkv_bias=qkv_bias, o_bias=o_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config, bias=mlp_bias)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) x 2 -> (B, T, 2H)."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def residual(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the attention output is added to: ``hidden``, or its ``hidden_norm`` (``norm_before_residual``)."""
        return self.hidden_norm(hidden) if self.norm_before_residual else hidden

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual add after attention, then the MLP block."""
        hidden = residual + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, embeds, hidden, cos, sin, attention_mask, past_key_value=None):
        attn_out, present = self.self_attn(self.attention_input(embeds, hidden), cos, sin, attention_mask, past_key_value)
        return self.finish(self.residual(hidden), attn_out), present


class Eagle1DecoderLayer(nn.Module):
    """A LLaMA decoder layer; layer 0 has no ``input_layernorm`` (its input is the raw fc output). An EAGLE-3 head
    of several layers stacks layers of this kind (index >= 1) after its first (vLLM, speculators)."""

    def __init__(self, config, index: int):
        super().__init__()
        hidden = config.hidden_size
        qkv_bias, o_bias, mlp_bias = bias_flags(config)
        if index > 0:
            self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, input_size=hidden, qkv_bias=qkv_bias, o_bias=o_bias)
        self.post_attention_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config, bias=mlp_bias)
        self.index = index

    def forward(self, hidden, cos, sin, attention_mask, past_key_value=None):
        normed = self.input_layernorm(hidden) if self.index > 0 else hidden
        attn_out, present = self.self_attn(normed, cos, sin, attention_mask, past_key_value)
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), present


class DraftRotary(nn.Module):
    """RoPE for the head, from its own config (``rope_theta``, ``rope_scaling``, ``head_dim``)."""

    def __init__(self, config):
        super().__init__()
        self.rotary = LlamaRotaryEmbedding(config)

    def forward(self, like: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """position_ids: (B, T) -> cos, sin: (B, T, head_dim) in ``like``'s dtype."""
        return self.rotary(like, position_ids)


def causal_mask_with_past(length: int, past: int, device) -> torch.Tensor:
    """Bool mask (1, 1, length, past + length): every query sees the whole past and the new tokens up to itself."""
    keys = torch.arange(past + length, device=device)
    queries = torch.arange(length, device=device)[:, None] + past
    return (keys[None, :] <= queries)[None, None]
