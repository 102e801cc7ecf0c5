"""EAGLE-3 heads written as each publisher writes them, and what the publisher's serving code computes with them.

:func:`publish` saves a random head for a tiny target in a publisher's layout (config.json and tensor names as
that publisher's tooling writes them). :func:`publisher_forward` is a plain re-statement of the computation the
publisher's engine runs (vLLM's ``llama_eagle3.py``; speculators' ``Eagle3DecoderLayer``), read from the published
tensors under their published names, so that a head loaded by this project can be compared with it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tiny_models import head_config_dict

LAYOUTS = ("EAGLE", "SpecForge", "ModelOpt", "ModelOpt, null draft vocabulary", "speculators", "EAGLE-1")


@dataclass
class Semantics:
    """What the publisher's engine computes for a published head (see :func:`publisher_forward`)."""

    layers: int = 1
    aux: bool = True  # fc over three fused target layers (else the target's final hidden state)
    norm_before_residual: bool = False
    norm_before_fc: bool = False
    lm_head_from_target: bool = False


def _random_head_state(config: dict, semantics: Semantics, fc_bias: bool, seed: int) -> dict:
    """A random head's tensors in this project's names (``midlayer.``, ``layers.<i>.``)."""
    from eagle.model.configs import EConfig
    from eagle.model.heads.draft_head import Eagle3DraftHead

    internal = {**config, "num_hidden_layers": semantics.layers, "fc_bias": fc_bias,
                "norm_before_residual": semantics.norm_before_residual, "norm_before_fc": semantics.norm_before_fc,
                "eagle_config": {"use_aux_hidden_state": semantics.aux},
                "lm_head_from_target": semantics.lm_head_from_target}
    torch.manual_seed(seed)
    head = Eagle3DraftHead(EConfig(**internal))
    with torch.no_grad():
        for name, param in head.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            elif name.endswith("weight") and param.dim() == 2:
                param.normal_(std=0.2)
            elif name.endswith("bias"):
                param.normal_(std=0.5)
    vocab, draft = config["vocab_size"], config["draft_vocab_size"]
    if draft < vocab:
        used = torch.randperm(vocab)[:draft].sort().values
        head.d2t.copy_(used - torch.arange(draft))
        head.t2d.zero_()
        head.t2d[used] = True
    state = {k: v.clone() for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}
    if draft == vocab:
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    if not semantics.aux:
        state.pop("midlayer.hidden_norm.weight")  # ModelOpt exports no hidden_norm without aux hidden states
    return state


def _layer_names(state: dict, old_modelopt: bool) -> dict:
    """This project's names -> ``layers.<i>.`` (vLLM, speculators, newer ModelOpt) or ``midlayer.<i>.`` (older
    ModelOpt exports of several layers)."""
    def rename(key):
        if key.startswith("midlayer."):
            return ("midlayer.0." if old_modelopt else "layers.0.") + key[len("midlayer."):]
        if key.startswith("layers.") and old_modelopt:
            return "midlayer." + key[len("layers."):]
        return key
    return {rename(k): v for k, v in state.items()}


def publish(directory: Path, target, layout: str, *, seed: int = 4, draft_vocab: int | None = 48,
            semantics: Semantics | None = None, fc_bias: bool = False, old_modelopt_names: bool = False,
            speculators_fields: dict | None = None) -> dict:
    """Save a random EAGLE-3 head for ``target`` in ``layout`` (one of :data:`LAYOUTS` but EAGLE-1) to
    ``directory``; return the published tensors (under their published names)."""
    semantics = semantics or Semantics()
    base = head_config_dict(target.config, eagle3=True, draft_vocab_size=draft_vocab)
    base["draft_vocab_size"] = draft_vocab or base["vocab_size"]
    state = _random_head_state(base, semantics, fc_bias, seed)
    text_layers = target.config.get_text_config().num_hidden_layers
    aux_ids = [1, text_layers // 2, text_layers - 2]  # output-of-layer ids (SGLang, ModelOpt)
    config = {**base, "num_hidden_layers": semantics.layers}
    if layout == "EAGLE":
        pass
    elif layout == "SpecForge":
        config.update(architectures=["LlamaForCausalLMEagle3"], bias=fc_bias,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True})
    elif layout.startswith("ModelOpt"):
        # modelopt/torch/export/plugins/hf_spec_export.py: no t2d; eagle_config from the training config
        state = {k: v for k, v in _layer_names(state, old_modelopt_names).items() if k != "t2d"}
        config.update(architectures=["LlamaForCausalLMEagle3"], eagle_config={
            "eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": semantics.aux,
            "use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "use_mtp_layernorm": False,
            "next_layer_regular": True, "parallel_draft_step": 1, "parallel_draft_heads_num_layers": None})
        if layout == "ModelOpt, null draft vocabulary":
            config["draft_vocab_size"] = None
    elif layout == "speculators":
        state = _layer_names(state, False)
        layer = {k: v for k, v in config.items() if k not in ("draft_vocab_size", "architectures")}
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer, "draft_vocab_size": config["draft_vocab_size"],
                  "norm_before_residual": semantics.norm_before_residual, "norm_before_fc": semantics.norm_before_fc,
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "verifier": {"name_or_path": "tiny-target"}},
                  **(speculators_fields or {})}
    else:
        raise ValueError(layout)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))
    return state


# ------------------------------------------------------------------------------------------- the reference
def _rms(x, weight, eps):
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _linear(x, state, name):
    return F.linear(x, state[f"{name}.weight"], state.get(f"{name}.bias"))


def _rope(x, positions, theta):
    """Rotate-half RoPE of (T, heads, d) at positions (T,)."""
    dim = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
    angles = positions[:, None].float() * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos()[:, None], torch.cat([angles, angles], -1).sin()[:, None]
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def _attention(x, state, prefix, cfg):
    """Causal multi-head attention of (T, in) with GQA, as a LLaMA layer computes it."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    length = x.shape[0]
    positions = torch.arange(length)
    q = _rope(_linear(x, state, f"{prefix}q_proj").view(length, heads, dim), positions, cfg["rope_theta"])
    k = _rope(_linear(x, state, f"{prefix}k_proj").view(length, kv_heads, dim), positions, cfg["rope_theta"])
    v = _linear(x, state, f"{prefix}v_proj").view(length, kv_heads, dim)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    scores = scores.masked_fill(~torch.ones(length, length, dtype=torch.bool).tril(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, heads * dim)
    return _linear(out, state, f"{prefix}o_proj")


def _mlp(x, state, prefix):
    return _linear(F.silu(_linear(x, state, f"{prefix}gate_proj")) * _linear(x, state, f"{prefix}up_proj"), state,
                   f"{prefix}down_proj")


def publisher_forward(state: dict, cfg: dict, semantics: Semantics, features, tokens, embedding, target_lm_head=None):
    """One sequence through a published head as vLLM's ``llama_eagle3.py`` runs it: ``input_norm`` then ``fc`` over
    the fused features (no ``fc`` without aux hidden states), layer 0 over (``input_layernorm(embedding)``,
    ``hidden_norm(h)``) with the residual ``h`` or, with ``norm_before_residual``, ``hidden_norm(h)``; layers
    ``1..`` as LLaMA decoder layers; logits of ``norm`` through ``lm_head`` (or the target's). ``features``
    (T, F), ``tokens`` (T,), ``cfg`` the LLaMA fields; tensors read from either ``midlayer.`` or ``layers.0.``
    names. Returns (pre-norm hidden (T, H), logits (T, V))."""
    state = dict(state)
    for key in list(state):
        numbered = re.match(r"midlayer\.(\d+)\.(.*)", key)
        if numbered:
            state[f"layers.{numbered.group(1)}.{numbered.group(2)}"] = state[key]
        elif key.startswith("midlayer."):
            state["layers.0." + key[len("midlayer."):]] = state[key]
    eps, hidden = cfg["rms_norm_eps"], features
    if semantics.norm_before_fc:
        hidden = _rms(hidden, state["input_norm.weight"], eps)
    if semantics.aux:
        hidden = _linear(hidden, state, "fc")
    embeds = _rms(embedding[tokens], state["layers.0.input_layernorm.weight"], eps)
    normed = _rms(hidden, state.get("layers.0.hidden_norm.weight", torch.ones(hidden.shape[-1])), eps)
    residual = normed if semantics.norm_before_residual else hidden
    hidden = residual + _attention(torch.cat([embeds, normed], -1), state, "layers.0.self_attn.", cfg)
    hidden = hidden + _mlp(_rms(hidden, state["layers.0.post_attention_layernorm.weight"], eps), state,
                           "layers.0.mlp.")
    for i in range(1, semantics.layers):
        hidden = hidden + _attention(_rms(hidden, state[f"layers.{i}.input_layernorm.weight"], eps), state,
                                     f"layers.{i}.self_attn.", cfg)
        hidden = hidden + _mlp(_rms(hidden, state[f"layers.{i}.post_attention_layernorm.weight"], eps), state,
                               f"layers.{i}.mlp.")
    normed = _rms(hidden, state["norm.weight"], eps)
    logits = target_lm_head(normed) if semantics.lm_head_from_target else _linear(normed, state, "lm_head")
    return hidden, logits
