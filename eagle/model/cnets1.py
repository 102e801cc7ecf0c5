"""EAGLE-1/EAGLE-2 draft head: ``fc`` over (embedding, target final hidden state), a few LLaMA decoder layers,
and the target's own LM head for logits."""

from __future__ import annotations

import torch
from torch import nn

from .draft_head import DraftHead, load_embedding_from_checkpoint
from .draft_layers import DraftAttention, DraftMLP, RMSNorm


class Eagle1DecoderLayer(nn.Module):
    """A LLaMA decoder layer; layer 0 has no ``input_layernorm`` (its input is the raw fc output)."""

    def __init__(self, config, index: int):
        super().__init__()
        hidden = config.hidden_size
        if index > 0:
            self.input_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.self_attn = DraftAttention(config, input_size=hidden, qkv_bias=bool(getattr(config, "qkv_bias", False)))
        self.post_attention_layernorm = RMSNorm(hidden, eps=config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.index = index

    def forward(self, hidden, cos, sin, attention_mask, past_key_value=None):
        normed = self.input_layernorm(hidden) if self.index > 0 else hidden
        attn_out, present = self.self_attn(normed, cos, sin, attention_mask, past_key_value)
        hidden = hidden + attn_out
        return hidden + self.mlp(self.post_attention_layernorm(hidden)), present


class Model(DraftHead):
    """EAGLE-1 head. State-dict keys: ``embed_tokens``, ``fc`` (bias unless ``"bias": false``), ``layers.i.*``."""

    eagle_version = 1

    def __init__(self, config, load_emb=False, path=None, bias=True, total_tokens=63, depth=5, top_k=8, threshold=1.0):
        super().__init__(config, total_tokens=total_tokens, depth=depth, top_k=top_k, threshold=threshold)
        hidden = config.hidden_size
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden, config.pad_token_id)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        self.layers = nn.ModuleList(Eagle1DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self._target_lm_head: list[nn.Module] = []  # a list so the target head is not registered as a submodule
        if load_emb and path is not None:
            with torch.no_grad():
                self.embed_tokens.weight.copy_(load_embedding_from_checkpoint(path, config.vocab_size, hidden))

    @property
    def feature_size(self) -> int:
        return self.config.hidden_size

    def attach_target_lm_head(self, lm_head: nn.Module) -> None:
        """EAGLE-1 drafts with the target's LM head; ``EaModel`` attaches it after loading."""
        self._target_lm_head[:] = [lm_head]

    def layers_forward(self, hidden, embeds, cos, sin, attention_mask, past_key_values):
        hidden = self.fc(torch.cat([embeds, hidden], dim=-1))
        presents = []
        for i, layer in enumerate(self.layers):
            hidden, present = layer(hidden, cos, sin, attention_mask, past_key_values[i] if past_key_values else None)
            presents.append(present)
        return hidden, presents

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if not self._target_lm_head:
            raise RuntimeError("This EAGLE-1 head has no target LM head attached (call attach_target_lm_head).")
        head = self._target_lm_head[0]
        return head(hidden.to(head.weight.dtype))
