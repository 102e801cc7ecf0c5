"""What a decoder layer computes, read once from a model's config and modules: the description the native layers
(``eagle::spec_layers``, ``eagle/csrc/decoder.cpp``) run, for the target's layers and the draft head's alike.

:func:`layer_spec` reads a causal LM of a family in :data:`FAMILIES` into a frozen :class:`LayerSpec`: where the
norms sit (before each block, or Gemma's sandwich: before and after attention and MLP), what a norm multiplies by
(its weight, or Gemma's ``1 + w``), per-head q/k norms (Qwen3, Gemma 3), the MLP's activation (SiLU, tanh-GELU),
q/k/v biases (Qwen2), which rotary table each layer reads (the model's own rotary module computes it: default,
llama3 or YaRN scaling alike; Gemma 3's local and global bases per layer type; none for SmolLM3's NoPE layers), the
layer types that choose each layer's mask (sliding windows), the attention scale (Gemma's
``query_pre_attn_scalar``), the final logit soft-capping, the embedding scale, whether the LM head is tied, and a
mixture-of-experts MLP's routing (:class:`MoeSpec`: Qwen2-MoE, Qwen3-MoE).
Whatever it cannot express lands in :attr:`LayerSpec.problems`, one sentence per feature, and the model keeps
transformers' per-layer forward.

The small readers (:func:`activation_name`, :func:`norm_factor`, :func:`norm_eps`, :func:`attention_scale`) are
what the draft head's native plan (``eagle/model/heads/native.py``) reads of its layer too.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

#: The causal-LM classes whose layers a :class:`LayerSpec` describes, each with what sets it apart.
FAMILIES = {
    "LlamaForCausalLM": "pre-norm RMSNorm, rotary q/k, gated SiLU MLP",
    "MistralForCausalLM": "Llama's layer, sliding-window layers",
    "Qwen2ForCausalLM": "Llama's layer with q/k/v biases, sliding-window layers",
    "Qwen3ForCausalLM": "Llama's layer with per-head q/k RMSNorms",
    "SmolLM3ForCausalLM": "Llama's layer, layers without rotary (NoPE)",
    "Gemma3ForCausalLM": "sandwich norms of (1 + w), q/k norms, tanh-GELU, local and global rotary bases, "
                         "sliding-window layers, query_pre_attn_scalar, a scaled embedding",
    "Qwen2MoeForCausalLM": "Qwen2's attention, a softmax top-k mixture-of-experts MLP with a sigmoid-gated shared "
                           "expert",
    "Qwen3MoeForCausalLM": "Qwen3's attention, a softmax top-k mixture-of-experts MLP",
}

#: Classes known not to fit, with the feature that keeps them out.
REFUSED_FAMILIES = {
    "MixtralForCausalLM": "a mixture-of-experts MLP",  # transformers loads no Mixtral GGUF
    "GptOssForCausalLM": "a mixture-of-experts MLP",
    "Gemma2ForCausalLM": "attention logit soft-capping",
    "Phi3ForCausalLM": "fused q/k/v and gate/up projections",
}

#: RMSNorm classes the native layers compute, with what their weight is added to (Gemma's norms multiply by 1 + w).
NORM_OFFSETS = {"LlamaRMSNorm": 0.0, "MistralRMSNorm": 0.0, "Qwen2RMSNorm": 0.0, "Qwen3RMSNorm": 0.0,
                "SmolLM3RMSNorm": 0.0, "Gemma3RMSNorm": 1.0, "Qwen2MoeRMSNorm": 0.0, "Qwen3MoeRMSNorm": 0.0,
                "RMSNorm": 0.0, "KernelRMSNorm": 0.0}

#: Routers whose routing a :class:`MoeSpec` describes: softmax over the experts in float32, top-k, optionally
#: renormalised (transformers' Qwen2-MoE / Qwen3-MoE routers, and the kernel router that replaces them).
SOFTMAX_ROUTERS = ("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "KernelRouter")

#: A layer's rotary table when the model has one (the key its rotary module is called without a layer type).
SHARED_TABLE = ""


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP: ``experts`` gated MLPs, each row routed to ``top_k`` of them by a softmax over
    the router's logits (renormalised to sum 1 where ``norm_topk_prob``), their outputs weighted and summed in
    ascending expert order; with ``shared_expert``, plus sigmoid(x w_gate) times a shared gated MLP (Qwen2-MoE)."""

    experts: int
    top_k: int
    routing: str  # "softmax"
    norm_topk_prob: bool
    shared_expert: bool


@dataclass(frozen=True)
class LayerSpec:
    """One model's decoder layer as the native layers compute it (see the module docstring)."""

    family: str
    sandwich: bool  # norms after attention and MLP too (Gemma 3)
    norm_offset: float  # 1.0: a norm multiplies by 1 + w (Gemma)
    qk_norm: bool  # per-head RMSNorms of q and k before the rotary
    activation: str | None  # "silu" / "gelu_tanh"; None: another (a problem)
    qkv_bias: bool
    rotary: tuple  # per layer: SHARED_TABLE, a layer type (its own table), or None (no rotary)
    layer_types: tuple  # per layer: the mask it reads ("full_attention", "sliding_attention")
    attention_scale: float | None
    final_softcap: float | None  # logits = cap * tanh(logits / cap)
    embedding_scale: float | None  # applied by the model's embedding module
    tied_head: bool
    problems: tuple = ()
    moe: MoeSpec | None = None  # the layers' MLP is a mixture of experts

    @property
    def native(self) -> bool:
        return not self.problems


def activation_name(act_fn) -> str | None:
    """``"silu"`` or ``"gelu_tanh"`` for the activation modules the native layers compute as transformers does,
    else None."""
    name = type(act_fn).__name__
    if name in ("SiLU", "SiLUActivation"):
        return "silu"
    act = getattr(act_fn, "act", None)
    if name in ("GELUTanh", "PytorchGELUTanh") and isinstance(act, functools.partial) and (
            act.func is torch.nn.functional.gelu and act.keywords == {"approximate": "tanh"}):
        return "gelu_tanh"
    return None


def norm_eps(norm) -> float:
    """An RMSNorm module's epsilon (``variance_epsilon`` or ``eps``)."""
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", None)))


def norm_factor(norm) -> torch.Tensor:
    """What ``norm`` multiplies the normalised row by, in float32, as transformers computes it (Gemma: ``1 + w``)."""
    weight = norm.weight.detach()
    offset = NORM_OFFSETS[type(norm).__name__]
    return (offset + weight.float()) if offset else weight


def attention_scale(attention) -> float:
    """The attention's query scale: its ``scaling``, else 1 / sqrt(head size) (SDPA's default)."""
    scale = getattr(attention, "scaling", None)
    return float(scale) if scale is not None else attention.head_dim ** -0.5


def _norms(layer, sandwich: bool) -> list:
    names = ["input_layernorm", "post_attention_layernorm"]
    if sandwich:
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    norms = [getattr(layer, name) for name in names]
    if hasattr(layer.self_attn, "q_norm"):
        norms += [layer.self_attn.q_norm, layer.self_attn.k_norm]
    return norms


def _rotary_keys(model, config, layers) -> tuple:
    """Per layer, which rotary table it reads: the layer type where the rotary module takes one, the shared table,
    or None where the layer has no rotary."""
    rotary = model.model.rotary_emb
    by_type = "layer_type" in inspect.signature(rotary.forward).parameters
    types = list(getattr(config, "layer_types", None) or ["full_attention"] * len(layers))
    return tuple(None if not getattr(layer.self_attn, "use_rope", True) else
                 (types[index] if by_type else SHARED_TABLE) for index, layer in enumerate(layers))


def _config_problems(config) -> list[str]:
    problems = []
    if getattr(config, "attn_logit_softcapping", None) is not None:
        problems.append("attention logit soft-capping")
    if getattr(config, "use_bidirectional_attention", False):
        problems.append("bidirectional attention")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        problems.append("tensor-parallel MLP slices (pretraining_tp)")
    for field in ("logit_scale", "logits_scaling", "output_multiplier", "residual_multiplier"):
        if getattr(config, field, None) not in (None, 1, 1.0):
            problems.append(f"{field} {getattr(config, field)}")
    return problems


def mlp_activation(layer):
    """The activation module of ``layer``'s MLP (a mixture of experts': its experts')."""
    mlp = layer.mlp
    return mlp.act_fn if hasattr(mlp, "act_fn") else mlp.experts.act_fn


def moe_spec(layers) -> tuple[MoeSpec | None, list[str]]:
    """The :class:`MoeSpec` of ``layers``' MLPs (None where they are plain gated MLPs), and what it cannot
    express."""
    routed = [hasattr(layer.mlp, "experts") for layer in layers]
    if not any(routed):
        return None, []
    if not all(routed):
        return None, ["its layers mix mixture-of-experts and dense MLPs"]
    router = layers[0].mlp.gate
    if type(router).__name__ not in SOFTMAX_ROUTERS:
        return None, [f"its router {type(router).__name__} is not a softmax top-k router it knows"]
    shared = hasattr(layers[0].mlp, "shared_expert")
    problems = ["its shared expert has no sigmoid gate"] if shared and not hasattr(
        layers[0].mlp, "shared_expert_gate") else []
    spec = MoeSpec(experts=int(router.num_experts), top_k=int(router.top_k), routing="softmax",
                   norm_topk_prob=bool(router.norm_topk_prob), shared_expert=shared)
    return spec, problems


def _module_problems(layers, sandwich: bool, activation: str | None) -> list[str]:
    problems = []
    if activation is None:
        problems.append(f"its MLP activation {type(mlp_activation(layers[0])).__name__} is not SiLU or tanh-GELU")
    kinds = {type(norm).__name__ for layer in layers for norm in _norms(layer, sandwich)}
    if not kinds <= set(NORM_OFFSETS):
        problems.append(f"its norms are {', '.join(sorted(kinds - set(NORM_OFFSETS)))}, not an RMSNorm it knows")
    elif len({norm_eps(norm) for layer in layers for norm in _norms(layer, sandwich)}) != 1:
        problems.append("its norms differ in epsilon")
    if len({attention_scale(layer.self_attn) for layer in layers}) != 1:
        problems.append("its layers differ in attention scale")
    if len({type(mlp_activation(layer)) for layer in layers}) != 1:
        problems.append("its layers differ in activation")
    return problems


def layer_spec(model) -> LayerSpec:
    """The :class:`LayerSpec` of ``model`` (a causal LM), its :attr:`~LayerSpec.problems` naming each feature the
    native layers cannot compute (a class outside :data:`FAMILIES` has that one problem)."""
    name = type(model).__name__
    config = model.config.get_text_config()
    if name not in FAMILIES:
        why = REFUSED_FAMILIES.get(name)
        problem = (f"{name} has {why}" if why else
                   f"{name} is not one of the classes it knows ({', '.join(FAMILIES)})")
        return _unknown(name, config, problem)
    layers = list(model.model.layers)
    sandwich = hasattr(layers[0], "pre_feedforward_layernorm")
    activation = activation_name(mlp_activation(layers[0]))
    moe, moe_problems = moe_spec(layers)
    embed = model.get_input_embeddings()
    scale = getattr(embed, "scalar_embed_scale", getattr(embed, "embed_scale", None))
    softcap = getattr(config, "final_logit_softcapping", None)
    return LayerSpec(
        family=name, sandwich=sandwich, norm_offset=NORM_OFFSETS.get(type(layers[0].input_layernorm).__name__, 0.0),
        qk_norm=hasattr(layers[0].self_attn, "q_norm"), activation=activation,
        qkv_bias=layers[0].self_attn.q_proj.bias is not None, rotary=_rotary_keys(model, config, layers),
        layer_types=tuple(getattr(config, "layer_types", None) or ()),
        attention_scale=attention_scale(layers[0].self_attn), final_softcap=softcap,
        embedding_scale=float(scale) if scale is not None else None,
        tied_head=bool(getattr(config, "tie_word_embeddings", False)),
        problems=tuple(_config_problems(config) + _module_problems(layers, sandwich, activation) + moe_problems),
        moe=moe)


def _unknown(name: str, config, problem: str) -> LayerSpec:
    return LayerSpec(family=name, sandwich=False, norm_offset=0.0, qk_norm=False, activation=None, qkv_bias=False,
                     rotary=(), layer_types=(), attention_scale=None, final_softcap=None, embedding_scale=None,
                     tied_head=bool(getattr(config, "tie_word_embeddings", False)), problems=(problem,))
