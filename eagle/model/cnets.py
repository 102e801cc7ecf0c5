"""EAGLE-3 draft head: one decoder layer over (embedding, fused target features), with its own LM head over a
draft vocabulary of ``draft_vocab_size`` tokens mapped to target ids through ``d2t``."""

from __future__ import annotations

import torch
from torch import nn

from .draft_head import DraftHead, load_embedding_from_checkpoint
from .draft_layers import DraftAttention, DraftMLP, RMSNorm


class Eagle3DecoderLayer(nn.Module):
    """``h = h + attn(cat(input_layernorm(e), hidden_norm(h)))``; ``h = h + mlp(post_attention_layernorm(h))``.
    The attention's q/k/v projections take the 2H concatenation (embedding first)."""

    def __init__(self, config):
        super().__init__()
        hidden = config.hidden_size
        self.hidden_norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, input_size=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """(B, T, H) x 2 -> (B, T, 2H)."""
        return torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)

    def finish(self, residual: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual add after attention, then the MLP block."""
        hidden = residual + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward(self, embeds, hidden, cos, sin, attention_mask, past_key_value=None):
        attn_out, present = self.self_attn(self.attention_input(embeds, hidden), cos, sin, attention_mask, past_key_value)
        return self.finish(hidden, attn_out), present


class Model(DraftHead):
    """EAGLE-3 head. State-dict keys: ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d`` and
    optionally ``embed_tokens`` (see EAGLE_SPEC section 3.3)."""

    eagle_version = 3

    def __init__(self, config, load_emb=False, path=None, bias=True, total_tokens=63, depth=5, top_k=8, threshold=1.0):
        super().__init__(config, total_tokens=total_tokens, depth=depth, top_k=top_k, threshold=threshold)
        if getattr(config, "draft_vocab_size", None) is None:
            raise ValueError("An EAGLE-3 head config needs `draft_vocab_size` (use vocab_size for a full-vocabulary head).")
        hidden = config.hidden_size
        self.target_hidden_size = getattr(config, "target_hidden_size", None) or hidden
        self.vocab_size = config.vocab_size
        self.draft_vocab_size = config.draft_vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(3 * self.target_hidden_size, hidden, bias=False)
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, config.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool))
        if load_emb and path is not None:
            with torch.no_grad():
                self.embed_tokens.weight.copy_(load_embedding_from_checkpoint(path, config.vocab_size, hidden))

    @property
    def feature_size(self) -> int:
        return 3 * self.target_hidden_size

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def layers_forward(self, hidden, embeds, cos, sin, attention_mask, past_key_values):
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = self.fc(hidden)  # fused target features (B, T, 3Ht) -> (B, T, H); draft states pass as they are
        past = past_key_values[0] if past_key_values else None
        hidden, present = self.midlayer(embeds, hidden, cos, sin, attention_mask, past)
        return hidden, [present]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(hidden))

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.reduced_vocab:
            return ids
        return ids + self.d2t[ids]
