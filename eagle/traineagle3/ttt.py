"""Training-time test (TTT): the EAGLE-3 head is unrolled for ``length`` steps on ground-truth tokens, each
step feeding on the hidden states the head produced at the previous step, exactly as chained drafting does
at inference.

Notation (one sequence of S tokens ``x_0 .. x_{S-1}``):

- step 0, position t: target feature ``f_t`` (fused by ``fc``) and the embedding of token ``x_{t+1}``; the
  head predicts token ``x_{t+2}``, trained towards the target's distribution for it (target logits at t+1);
- step k, position t: the head's own output of step k-1 at t and the embedding of ``x_{t+1+k}``; it predicts
  ``x_{t+2+k}``. RoPE position ``t + k`` (the predicted chain really sits there).

Attention at step k, query at position t: the step-0 keys/values of positions ``0..t`` (the real context,
causal) plus the keys/values of steps ``1..k`` at the same position t (the query's own draft chain). This is
what a chained draft token sees at inference.

The loss of step k at position t counts only if the *predicted* token ``x_{t+2+k}`` is an assistant token
(the loss mask is shifted with the targets, fixing the reference's off-by-one) and the target's top token is
in the draft vocabulary; it is averaged over those positions. Step k is weighted ``decay ** k``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float32, or the given dtype when it is wider (float64 in tests)."""
    return torch.promote_types(dtype, torch.float32)


def ttt_attention(
    query: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor], scale: float | None = None
) -> torch.Tensor:
    """The training-time-test attention of one step.

    query: (B, nH, T, hd), RoPE applied. keys/values: lists of (B, nKV, T, hd), one entry per step so far
    (index 0 = the context step; the last entry is the current step's own key/value). nH must be a multiple of
    nKV (grouped-query attention).

    Query t attends to ``keys[0][..., :t+1, :]`` (causal) and to ``keys[j][..., t, :]`` for j >= 1; one softmax
    over all of them, computed in float32 (or the inputs' dtype if wider). Returns (B, nH, T, hd) in the query's dtype.
    """
    bsz, num_heads, length, head_dim = query.shape
    num_kv = keys[0].shape[1]
    groups = num_heads // num_kv
    scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    compute = _wide(query.dtype)
    q = query.to(compute).reshape(bsz, num_kv, groups, length, head_dim)  # (B, nKV, g, T, hd)
    k0 = keys[0].to(compute)[:, :, None]  # (B, nKV, 1, T, hd)
    v0 = values[0].to(compute)[:, :, None]
    context_scores = (q @ k0.transpose(-1, -2)) * scale  # (B, nKV, g, T, T)
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    context_scores = context_scores.masked_fill(~causal, float("-inf"))
    chain_scores = [(q * key.to(compute)[:, :, None]).sum(-1, keepdim=True) * scale for key in keys[1:]]  # (B,nKV,g,T,1)
    weights = torch.softmax(torch.cat([context_scores, *chain_scores], dim=-1), dim=-1)
    out = weights[..., :length] @ v0  # (B, nKV, g, T, hd)
    for j, value in enumerate(values[1:]):
        out = out + weights[..., length + j : length + j + 1] * value.to(compute)[:, :, None]
    return out.reshape(bsz, num_heads, length, head_dim).to(query.dtype)


@torch.no_grad()
def target_distribution(target_logits: torch.Tensor, head: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The training targets from the target's logits (B, S, V): the target distribution restricted to the draft
    vocabulary and renormalised, (B, S, Vd) float32, and whether the target's top token is in the draft
    vocabulary, (B, S) bool. Draft index d is the d-th smallest target id with ``t2d`` set (``d + d2t[d]``)."""
    if not head.reduced_vocab:
        top_in_vocab = torch.ones(target_logits.shape[:-1], dtype=torch.bool, device=target_logits.device)
        return torch.softmax(target_logits.to(_wide(target_logits.dtype)), dim=-1), top_in_vocab
    t2d = head.t2d.bool()
    top_in_vocab = t2d[target_logits.argmax(-1)]
    return torch.softmax(target_logits[..., t2d].to(_wide(target_logits.dtype)), dim=-1), top_in_vocab


@dataclass
class TTTOutput:
    """Per-step results. ``losses[k]`` is the mean loss of step k over its counted positions (a scalar tensor
    with gradient), ``loss`` the weighted sum. ``correct[k]`` / ``counted[k]``: top-1 agreement with the target
    over the positions whose predicted token is an assistant token (a target top token outside the draft
    vocabulary counts as a miss) - float tensors, summed over the batch, for exact averaging later."""

    loss: torch.Tensor
    losses: list[torch.Tensor]
    correct: list[torch.Tensor]
    counted: list[torch.Tensor]


class Eagle3TTTModel(nn.Module):
    """Wraps an EAGLE-3 head (``eagle.model.heads.draft_head.Eagle3DraftHead``) with the training-time-test forward. Only the head's
    trainable parameters get gradients; the target runs outside (see ``main.py``)."""

    def __init__(self, head: nn.Module, length: int = 7, decay: float = 0.8):
        super().__init__()
        if length < 1:
            raise ValueError(f"The training-time-test length must be at least 1, got {length}.")
        self.head = head
        self.length = length
        self.decay = decay

    def step_weights(self) -> list[float]:
        return [self.decay**k for k in range(self.length)]

    def forward(
        self, features: torch.Tensor, input_ids: torch.Tensor, target_probs: torch.Tensor, target_in_draft: torch.Tensor,
        loss_mask: torch.Tensor,
    ) -> TTTOutput:
        """features (B, S, 3Ht): target hidden states of the feature layers at every position; input_ids (B, S);
        target_probs (B, S, Vd) and target_in_draft (B, S): see :func:`target_distribution` (position t is about
        token t+1); loss_mask (B, S): 1 for assistant tokens. Sequences are right-padded (padding has
        loss_mask 0; causal attention never lets a real position see it)."""
        head = self.head
        layer = head.midlayer
        attention = layer.self_attn
        bsz, seq_len = input_ids.shape
        dtype = head.fc.weight.dtype
        loss_mask = loss_mask.bool()
        in_draft_vocab = target_in_draft.bool()

        hidden = head.fc(features.to(dtype))  # (B, S, H)
        positions = torch.arange(seq_len, device=input_ids.device)[None].expand(bsz, -1)
        keys, values = [], []
        losses, correct, counted = [], [], []
        total = hidden.new_zeros((), dtype=torch.float32)
        for k in range(self.length):
            valid = seq_len - 1 - k  # positions t with a token x_{t+1+k} to consume
            if valid <= 0:
                break
            step_ids = F.pad(input_ids[:, 1 + k :], (0, 1 + k))  # x_{t+1+k}, zero-padded at the end
            embeds = head.embed_tokens(step_ids).to(dtype)
            cos, sin = head.rotary_emb(hidden, positions + k)
            q, key, value = attention.project(layer.attention_input(embeds, hidden), cos, sin)
            keys.append(key)
            values.append(value)
            attn = ttt_attention(q, keys, values)
            attn = attention.o_proj(attn.transpose(1, 2).reshape(bsz, seq_len, -1))
            hidden = layer.finish(hidden, attn)

            with torch.no_grad():
                predicted_mask = F.pad(loss_mask[:, 2 + k :], (0, 1))  # is x_{t+2+k} an assistant token? (B, valid)
                counted_mask = predicted_mask & in_draft_vocab[:, 1 + k :]
                rows = counted_mask.nonzero(as_tuple=True)
                probs = target_probs[:, 1 + k :][rows]  # target distributions for x_{t+2+k}, (N, Vd)
            # Logits only where the loss counts (the LM head is the largest matrix of the head).
            logits = head.compute_logits(hidden[:, :valid][rows])
            logits = logits.to(_wide(logits.dtype))  # (N, Vd), at least float32
            per_position = -(probs * torch.log_softmax(logits, dim=-1)).sum(-1)  # (N,)
            step_loss = per_position.sum() / max(1, per_position.numel())
            losses.append(step_loss)
            total = total + (self.decay**k) * step_loss
            with torch.no_grad():
                correct.append((logits.argmax(-1) == probs.argmax(-1)).sum().float())
                counted.append(predicted_mask.sum().float())
        return TTTOutput(total, losses, correct, counted)
