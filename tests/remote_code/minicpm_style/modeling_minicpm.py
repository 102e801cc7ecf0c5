"""A tiny MiniCPM-style causal LM for tests, written the way transformers 4 remote code is: its forward takes the
cache as ``past_key_values`` (a ``Cache``: ``update`` / ``get_seq_length``), takes no ``logits_to_keep`` and
returns every position's logits; a 4-D ``attention_mask`` is used as an additive mask, a 2-D one as padding.
It carries MiniCPM's muP scalings (embedding x12, scaled residual branches, logits divided by hidden / 256)."""

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_minicpm import MiniCPMConfig


class MiniCPMRMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate(x, cos, sin):
    """RoPE on (B, heads, T, d) with cos/sin (B, 1, T, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class MiniCPMAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.rope_theta = config.rope_theta

    def forward(self, hidden, attention_mask, position_ids, past_key_value=None):
        bsz, length, _ = hidden.shape
        q = self.q_proj(hidden).view(bsz, length, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden).view(bsz, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden).view(bsz, length, self.kv_heads, self.head_dim).transpose(1, 2)
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, self.head_dim, 2, device=hidden.device).float()
                                              / self.head_dim))
        freqs = position_ids[:, :, None].float() * inv_freq[None, None]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        q, k = rotate(q, emb.cos(), emb.sin()), rotate(k, emb.cos(), emb.sin())
        if past_key_value is not None:
            k, v = past_key_value.update(k, v, self.layer_idx)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim) + attention_mask
        out = F.softmax(scores.float(), dim=-1).to(q.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(bsz, length, -1))


class MiniCPMMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MiniCPMDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = MiniCPMAttention(config, layer_idx)
        self.mlp = MiniCPMMLP(config)
        self.input_layernorm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.branch_scale = config.scale_depth / math.sqrt(config.num_hidden_layers)

    def forward(self, hidden, attention_mask, position_ids, past_key_value=None):
        attn = self.self_attn(self.input_layernorm(hidden), attention_mask, position_ids, past_key_value)
        hidden = hidden + attn * self.branch_scale
        return hidden + self.mlp(self.post_attention_layernorm(hidden)) * self.branch_scale


class MiniCPMPreTrainedModel(PreTrainedModel):
    config_class = MiniCPMConfig
    base_model_prefix = "model"
    _no_split_modules = ["MiniCPMDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)


def causal_mask(attention_mask, batch, length, past, dtype, device):
    """Additive (B, 1, T, past + T) causal mask, hiding the padding a 2-D mask marks."""
    keys = torch.arange(past + length, device=device)
    allowed = (keys[None, :] <= torch.arange(length, device=device)[:, None] + past)[None].expand(batch, -1, -1)
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, :].bool()
    return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[:, None]


class MiniCPMModel(MiniCPMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(MiniCPMDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = MiniCPMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        hidden = self.embed_tokens(input_ids) * self.config.scale_emb if inputs_embeds is None else inputs_embeds
        batch, length = hidden.shape[:2]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past, past + length, device=hidden.device)[None].expand(batch, -1)
        if attention_mask is None or attention_mask.dim() == 2:
            attention_mask = causal_mask(attention_mask, batch, length, past, hidden.dtype, hidden.device)
        states = ()
        for layer in self.layers:
            states += (hidden,)
            hidden = layer(hidden, attention_mask, position_ids, past_key_values if use_cache else None)
        hidden = self.norm(hidden)
        states += (hidden,)
        return BaseModelOutputWithPast(last_hidden_state=hidden, past_key_values=past_key_values if use_cache else None,
                                       hidden_states=states if output_hidden_states else None)


class MiniCPMForCausalLM(MiniCPMPreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.model = MiniCPMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                             output_hidden_states=output_hidden_states)
        scale = self.config.hidden_size / self.config.dim_model_base
        logits = self.lm_head(outputs.last_hidden_state / scale)
        return CausalLMOutputWithPast(logits=logits, past_key_values=outputs.past_key_values,
                                      hidden_states=outputs.hidden_states)
