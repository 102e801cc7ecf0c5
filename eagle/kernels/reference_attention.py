"""Slow, obviously-correct attention in float64: the math of :func:`eagle.kernels.attention.tree_attention`.

``softmax(scale * q k^T [soft-capped] over the visible keys, with an optional sink logit per head) @ v``, computed
with full matrices, grouped key/value heads repeated for their query heads, and float64 throughout. A query with no
visible key gets zeros. It is the oracle the tests compare the kernel with, and what runs where the compiled kernel
cannot (no extension, another device or dtype, autograd).
"""

from __future__ import annotations

import torch


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, visible: torch.Tensor,
                        scale: float, sinks: torch.Tensor | None = None,
                        softcap: float | None = None) -> torch.Tensor:
    """Attention of every query over its visible keys, in float64.

    Args:
        query: (B, Hq, T, D).
        key: (B, Hkv, S, D), Hkv dividing Hq (query head h reads key/value head h // (Hq // Hkv)).
        value: (B, Hkv, S, Dv).
        visible: bool (B or 1, T, S): ``visible[b, t, j]`` says whether query t of row b sees key slot j.
        scale: multiplies every score ``q . k``.
        sinks: optional (Hq,) logits that join each head's softmax denominator only (GPT-OSS).
        softcap: optional cap: scores become ``softcap * tanh(score / softcap)`` (Gemma 2), before masking.

    Returns:
        (B, T, Hq, Dv) float64.
    """
    batch, q_heads, queries, _ = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    keys = key.double().repeat_interleave(group, dim=1)  # (B, Hq, S, D)
    values = value.double().repeat_interleave(group, dim=1)  # (B, Hq, S, Dv)
    scores = query.double() @ keys.transpose(-1, -2) * scale  # (B, Hq, T, S)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seen = visible.to(device=query.device, dtype=torch.bool)[:, None].expand(batch, q_heads, queries, slots)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.double().to(query.device).view(1, q_heads, 1, 1).expand(batch, q_heads, queries, 1)
        scores = torch.cat([scores, sink], dim=-1)
    top = scores.amax(dim=-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # rows that see nothing
    weights = torch.exp(scores - top)
    denominator = weights.sum(dim=-1, keepdim=True)
    weights = weights / torch.where(denominator > 0, denominator, torch.ones_like(denominator))
    out = weights[..., :slots] @ values  # (B, Hq, T, Dv)
    return out.transpose(1, 2).contiguous()
