"""The target's forward pass without transformers' per-layer Python, for the decoders a LayerSpec describes on the
GGUF kernels.

With the GGUF kernels a decode step of a small model spends a large share of its time outside them: transformers'
forward wraps every layer and attention call in decorators, keyword plumbing and output-capture hooks and looks the
attention function up per layer. :class:`NativeDecoder` computes the same forward with the model's own modules and
the same tensor operations in the same order (embedding, rotary tables; per layer: norm, projections, q/k norms,
rotary embedding, cache update, the position-ordered attention kernel, output projection, [norm,] residual, norm,
MLP, [norm,] residual; final norm; LM head of the kept positions, soft-capped where the model does), so its logits
and hidden states are bit-identical to the model's own forward on the same inputs (``tests/test_native_decoder.py``,
``tests/test_native_families.py``), only cheaper to call.

What a layer computes is read once, when the target's :class:`~eagle.model.base.plan.ForwardPlan` is built, into a
:class:`~eagle.model.base.layer_spec.LayerSpec` (``eagle/model/base/layer_spec.py``: Llama, Mistral, Qwen2, Qwen3,
SmolLM3, Gemma 3; Qwen2-MoE and Qwen3-MoE with their router and experts on the kernels,
``eagle/model/backends/gguf_experts.py``); :func:`native_decoder` builds a decoder where the spec has no problems
and every linear layer (:func:`mlp_linears`) and the attention run on the kernels; the plan then calls it instead
of ``model(...)``. Anything else (another
family, a feature the spec names as a problem, a float layer left, a query temperature, attention not on the kernel)
keeps transformers' forward.

With the engine's :class:`~eagle.model.base.kv_cache.TreeKVCache` the decoder layers run as one native call,
``eagle::spec_layers`` (``eagle/csrc/decoder.cpp``): the same steps without a Python call per operation, and
rows still computed independently of each other (row-invariant). Every step rounds as transformers' operations do
except the RMSNorm, whose sum of squares runs in a fixed order of its own (16 lanes, then the lanes in order;
:func:`eagle.kernels.reference.lane_rms_norm` is the PyTorch form ``tests/test_native_decoder.py`` checks the op's
bits against), so logits agree with transformers' forward to float32 rounding, not bit for bit. Without that
cache, with a mask it cannot read, or where the op is missing, the layers run through the modules as above. A
mixture-of-experts MLP runs in the op too (router, top-k, each chosen expert over its rows, the shared expert: the
ATen calls of transformers' block over the kernel router and experts, in their order).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

import torch

from eagle import kernels
from eagle.kernels.attention import attention_forward, visible_keys
from eagle.kernels.linear import QuantLinear
from eagle.model.backends.attention import QueryTemperature
from eagle.model.base.kv_cache import TreeKVCache
from eagle.model.base.layer_spec import (FAMILIES, SHARED_TABLE, LayerSpec, attention_scale, layer_spec, norm_eps,
                                         norm_factor)
from eagle.model.base.model_call import ForwardOutput

logger = logging.getLogger(__name__)

#: The causal-LM classes whose decoder layers the native decoder computes (see :mod:`eagle.model.base.layer_spec`).
NATIVE_CLASSES = tuple(FAMILIES)


def native_problem(model, kernel_attention: bool, spec: LayerSpec | None = None) -> str | None:
    """Why :class:`NativeDecoder` cannot compute ``model``'s forward exactly (with the position-ordered kernel as
    its attention when ``kernel_attention``), one sentence per feature, or None when it can. ``spec``: the model's
    :class:`~eagle.model.base.layer_spec.LayerSpec` where already read."""
    spec = spec if spec is not None else layer_spec(model)
    if spec.problems and spec.family not in FAMILIES:
        return spec.problems[0]
    problems = list(spec.problems)
    if not kernel_attention:
        problems.append("its attention does not run the position-ordered kernel")
    if QueryTemperature(model):
        problems.append("its attention scales queries by a temperature")
    inner = model.model
    linears = [model.lm_head] + [module for layer in inner.layers for module in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        *mlp_linears(layer.mlp))]
    if not all(isinstance(m, QuantLinear) and m.uses_kernels for m in linears):
        problems.append("not every linear layer computes on the GGUF kernels")
    return "; ".join(problems) or None


def mlp_linears(mlp) -> list:
    """The linear layers of an MLP: gate, up, down; a mixture of experts' router, experts and shared expert (a
    module of transformers' stands for the kernel modules it lacks: its float router or stacked experts)."""
    if not hasattr(mlp, "experts"):
        return [mlp.gate_proj, mlp.up_proj, mlp.down_proj]
    router = getattr(mlp.gate, "linear", mlp.gate)
    experts = list(mlp.experts.gate_up) + list(mlp.experts.down) if hasattr(mlp.experts, "gate_up") else [
        mlp.experts]
    shared = mlp_linears(mlp.shared_expert) + [mlp.shared_expert_gate] if hasattr(mlp, "shared_expert") else []
    return [router] + experts + shared


@dataclass
class LayerArguments:
    """What the native layers take of the model's layers, gathered once: 7 packed weights and their types, 3
    optional biases, the 2 norms every layer has (input, feedforward input; ``eagle::decoder_layers``'s) and the 6
    of ``eagle::spec_layers`` (input, attention output, feedforward input, feedforward output, q, k; None where the
    layer has none) per layer, each a norm's factor (:func:`~eagle.model.base.layer_spec.norm_factor`); heads, head
    size and MLP width; the norms' epsilon, the attention's scale, the MLP's activation and the numerics."""

    weights: list
    types: list
    biases: list
    norms: list
    spec_norms: list
    dims: list
    eps: float
    scale: float
    activation: str
    numerics: str
    #: a mixture of experts' weights per layer (router, each expert's gate-up, each expert's down, the shared
    #: expert's gate) and types, and ``(experts, top_k, renormalise, shared expert, expert width)``; empty: dense
    expert_weights: list = None
    expert_types: list = None
    moe: list = None


def _same(values, what: str):
    values = set(values)
    if len(values) != 1:
        raise _NoArguments(f"its layers differ in {what}")
    return values.pop()


class _NoArguments(Exception):
    pass


def _layer_norms(layer, spec: LayerSpec) -> list:
    """The layer's 6 norm modules in ``eagle::spec_layers``'s order, None where it has none."""
    attention = layer.self_attn
    if spec.sandwich:
        blocks = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                  layer.post_feedforward_layernorm]
    else:
        blocks = [layer.input_layernorm, None, layer.post_attention_layernorm, None]
    heads = [attention.q_norm, attention.k_norm] if spec.qk_norm else [None, None]
    return blocks + heads


def _dense_mlp(mlp):
    """The gated MLP in the op's dense slots: the layer's own, a mixture of experts' shared expert, or None."""
    if not hasattr(mlp, "experts"):
        return mlp
    return getattr(mlp, "shared_expert", None)


# What the dense slots hold for a mixture of experts without a shared expert (never read: the op checks `moe`).
_NO_WEIGHT = torch.empty(0, dtype=torch.uint8)


def _expert_linears(mlp) -> list:
    experts = mlp.experts
    shared_gate = [mlp.shared_expert_gate] if hasattr(mlp, "shared_expert") else []
    return [mlp.gate.linear, *experts.gate_up, *experts.down, *shared_gate]


def _gather_weights(layers, spec: LayerSpec):
    weights, types, biases, norms, numerics, experts = [], [], [], [], set(), []
    for layer in layers:
        attention, mlp = layer.self_attn, _dense_mlp(layer.mlp)
        dense = (mlp.gate_proj, mlp.up_proj, mlp.down_proj) if mlp is not None else ()
        linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, *dense)
        if any(m.bias is not None for m in linears[3:]):
            raise _NoArguments("an output or MLP projection has a bias")
        weights += [m.weight.packed for m in linears] + [_NO_WEIGHT] * (7 - len(linears))
        types += [m.type_name for m in linears] + [""] * (7 - len(linears))
        biases += [m.bias for m in linears[:3]]
        norms += _layer_norms(layer, spec)
        numerics.update(m.numerics for m in linears)
        if spec.moe is not None:
            experts += _expert_linears(layer.mlp)
    if any(m.bias is not None for m in experts):
        raise _NoArguments("a router or expert projection has a bias")
    numerics.update(m.numerics for m in experts)
    if any(norm.weight.dtype != torch.float32 for norm in norms if norm is not None):
        raise _NoArguments("a norm weight is not float32")
    eps = _same((norm_eps(norm) for norm in norms if norm is not None), "norm epsilon")
    spec_norms = [norm_factor(norm) if norm is not None else None for norm in norms]
    return weights, types, biases, spec_norms, float(eps), _same(numerics, "numerics"), experts


def _mlp_width(layer) -> int:
    mlp = _dense_mlp(layer.mlp)
    return mlp.gate_proj.out_features if mlp is not None else 1


def _moe_arguments(layers, spec: LayerSpec, experts: list) -> dict:
    """The op's ``expert_weights``, ``expert_types`` and ``moe`` for ``experts`` (:func:`_expert_linears` of
    every layer, in order); empty for dense layers."""
    if spec.moe is None:
        return dict(expert_weights=[], expert_types=[], moe=[])
    width = _same((gate_up.out_features // 2 for layer in layers for gate_up in layer.mlp.experts.gate_up),
                  "expert width")
    moe = spec.moe
    return dict(expert_weights=[m.weight.packed for m in experts], expert_types=[m.type_name for m in experts],
                moe=[moe.experts, moe.top_k, int(moe.norm_topk_prob), int(moe.shared_expert), width])


def _gather_layers(layers, spec: LayerSpec) -> LayerArguments:
    weights, types, biases, spec_norms, eps, numerics, experts = _gather_weights(layers, spec)
    head_dim = _same((layer.self_attn.head_dim for layer in layers), "head size")
    first = layers[0]
    dims = [first.self_attn.q_proj.out_features // head_dim, first.self_attn.k_proj.out_features // head_dim,
            head_dim, _mlp_width(first)]
    _same(((layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features,
            layer.self_attn.v_proj.out_features, layer.self_attn.o_proj.in_features,
            _mlp_width(layer)) for layer in layers), "shapes")
    if (dims[0] * head_dim, dims[1] * head_dim, dims[1] * head_dim) != (
            first.self_attn.q_proj.out_features, first.self_attn.k_proj.out_features,
            first.self_attn.v_proj.out_features) or first.self_attn.o_proj.in_features != dims[0] * head_dim:
        raise _NoArguments("its projections are not whole heads")
    scale = _same((attention_scale(layer.self_attn) for layer in layers), "attention scale")
    norms = [norm for index, norm in enumerate(spec_norms) if index % 6 in (0, 2)]
    return LayerArguments(weights, types, biases, norms, spec_norms, dims, eps, scale, spec.activation, numerics,
                          **_moe_arguments(layers, spec, experts))


def layer_arguments(layers, spec: LayerSpec) -> tuple[LayerArguments | None, str | None]:
    """What the native layers take of ``layers`` (described by ``spec``), or (None, why not)."""
    if not kernels.available() or not hasattr(torch.ops.eagle, "spec_layers"):
        return None, "the compiled extension has no eagle::spec_layers"
    try:
        return _gather_layers(layers, spec), None
    except _NoArguments as reason:
        return None, str(reason)
    except AttributeError as error:  # a layer without the modules or attributes its spec names
        return None, f"a layer lacks what the native layers read ({error})"


class NativeDecoder:
    """``model``'s forward (a :data:`NATIVE_CLASSES` model checked by :func:`native_problem`), called like
    :class:`~eagle.model.base.model_call.ModelCall`: returns the kept positions' logits and, when asked, the
    hidden states as transformers gives them (each layer's input, then the final normed state). It holds the
    model's modules and its :class:`~eagle.model.base.layer_spec.LayerSpec`, not the model."""

    def __init__(self, model, spec: LayerSpec | None = None):
        self.inner, self.lm_head = model.model, model.lm_head
        self.layers = list(self.inner.layers)
        self.config = model.config.get_text_config()
        #: what a layer computes, read once (see eagle.model.base.layer_spec)
        self.spec = spec if spec is not None else layer_spec(model)
        self.layer_types = list(getattr(self.config, "layer_types", None) or [])
        self.rotary = getattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb")
        #: the rotary tables the layers read (SHARED_TABLE or layer types) and each layer's index into them (-1: none)
        self.table_keys = list(dict.fromkeys(key for key in self.spec.rotary if key is not None))
        self.layer_rotary = [self.table_keys.index(key) if key is not None else -1 for key in self.spec.rotary]
        #: what the native layers take (None: every layer runs through its modules); see :func:`layer_arguments`
        self.arguments, why = layer_arguments(self.layers, self.spec)
        if self.arguments is None:
            logger.info("The decoder layers run through their modules, not eagle::spec_layers: %s.", why)

    def _mask(self, masks, index: int):
        return masks[self.layer_types[index]] if isinstance(masks, dict) else masks

    def _tables(self, hidden: torch.Tensor, position_ids: torch.Tensor) -> list:
        """The (cos, sin) of every table in :attr:`table_keys`, as the model's rotary module computes them."""
        rotary = self.inner.rotary_emb
        return [rotary(hidden, position_ids=position_ids) if key == SHARED_TABLE else
                rotary(hidden, position_ids, key) for key in self.table_keys]

    def _layer(self, index: int, hidden: torch.Tensor, mask, tables, cache) -> torch.Tensor:
        layer, spec = self.layers[index], self.spec
        attention, mlp = layer.self_attn, layer.mlp
        batch, length = hidden.shape[:2]
        shape = (batch, length, -1, attention.head_dim)
        normed = layer.input_layernorm(hidden)
        query = attention.q_proj(normed).view(shape)
        key = attention.k_proj(normed).view(shape)
        if spec.qk_norm:
            query, key = attention.q_norm(query), attention.k_norm(key)
        query, key = query.transpose(1, 2), key.transpose(1, 2)
        value = attention.v_proj(normed).view(shape).transpose(1, 2)
        if self.layer_rotary[index] >= 0:
            query, key = self.rotary(query, key, *tables[self.layer_rotary[index]])
        if cache is not None:
            key, value = cache.update(key, value, index)
        output, _ = attention_forward(attention, query, key, value, self._mask(mask, index),
                                      scaling=attention.scaling)
        output = attention.o_proj(output.reshape(batch, length, -1).contiguous())
        hidden = hidden + (layer.post_attention_layernorm(output) if spec.sandwich else output)
        normed = (layer.pre_feedforward_layernorm if spec.sandwich else layer.post_attention_layernorm)(hidden)
        if spec.moe is not None:  # the router, experts and shared expert on the kernels
            output = mlp(normed)
        else:
            output = mlp.down_proj(mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed))
        return hidden + (layer.post_feedforward_layernorm(output) if spec.sandwich else output)

    def _mask_lists(self, masks, queries: int, slots: int):
        """The visible-key lists of the layers' masks and which list each layer reads, or None when a mask is not a
        (B or 1, 1, T, S) tensor for this call."""
        chosen = [self._mask(masks, index) for index in range(len(self.layers))]
        unique: dict[int, int] = {}
        offsets, indices, layer_masks = [], [], []
        for mask in chosen:
            if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-2:] != (queries, slots):
                return None
            if id(mask) not in unique:
                lists = visible_keys(mask, True)
                unique[id(mask)] = len(offsets)
                offsets.append(lists.offsets)
                indices.append(lists.indices)
            layer_masks.append(unique[id(mask)])
        return offsets, indices, layer_masks

    def _native_layers(self, hidden, masks, tables, cache, keep_states):
        """Every decoder layer in one ``eagle::spec_layers`` call, writing ``cache`` in place; returns the
        output of the last layer and, with ``keep_states``, each layer's input; None where it cannot run."""
        arguments = self.arguments
        if arguments is None or type(cache) is not TreeKVCache or len(cache.layers) != len(self.layers):
            return None
        batch, queries = hidden.shape[:2]
        layers = cache.layers
        start = layers[0].length
        lists = self._mask_lists(masks, queries, start + queries)
        if lists is None or any(cos.shape[-1] != arguments.dims[2] for cos, _ in tables):
            return None
        layers[0].check_room(queries)
        for layer in layers:
            if not layer.is_initialized:
                layer.lazy_initialization(hidden.new_empty(batch, arguments.dims[1], 0, arguments.dims[2]),
                                          hidden.new_empty(batch, arguments.dims[1], 0, arguments.dims[2]))
        cos = [table[0].expand(batch, -1, -1).contiguous() for table in tables]
        sin = [table[1].expand(batch, -1, -1).contiguous() for table in tables]
        out = torch.ops.eagle.spec_layers(
            hidden.contiguous(), arguments.weights, arguments.types, arguments.biases, arguments.spec_norms,
            arguments.dims, arguments.eps, arguments.scale, arguments.activation, cos, sin, self.layer_rotary,
            [layer.keys for layer in layers], [layer.values for layer in layers], start, lists[0], lists[1], lists[2],
            arguments.numerics, keep_states, arguments.expert_weights, arguments.expert_types, arguments.moe)
        for layer in layers:
            layer.length = start + queries
        return out[0], out[1:]

    def __call__(self, *, input_ids, attention_mask, position_ids, cache, output_hidden_states,
                 logits_to_keep=0) -> ForwardOutput:
        hidden = self.inner.embed_tokens(input_ids)
        tables = self._tables(hidden, position_ids)
        native = self._native_layers(hidden, attention_mask, tables, cache, output_hidden_states)
        if native is not None:
            hidden, states = native[0], list(native[1]) if output_hidden_states else None
        else:
            states = [] if output_hidden_states else None
            for index in range(len(self.layers)):
                if states is not None:
                    states.append(hidden)
                hidden = self._layer(index, hidden, attention_mask, tables, cache)
        hidden = self.inner.norm(hidden)
        if states is not None:
            states.append(hidden)
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, kept, :])
        cap = self.spec.final_softcap
        if cap is not None:  # as the model's forward soft-caps: divide, tanh, multiply
            logits = torch.tanh(logits / cap) * cap
        return ForwardOutput(logits, tuple(states) if states is not None else None)


def native_decoder(model, kernel_attention: bool) -> NativeDecoder | None:
    """A :class:`NativeDecoder` of ``model`` when :func:`native_problem` finds none, else None (logged either
    way)."""
    spec = layer_spec(model)
    problem = native_problem(model, kernel_attention, spec)
    if problem is not None:
        logger.info("The target keeps transformers' forward: %s.", problem)
        return None
    logger.info("The target's forward runs without transformers' per-layer Python (eagle.model.base.native_decoder).")
    return NativeDecoder(model, spec)
