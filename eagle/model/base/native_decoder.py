"""The target's forward pass without transformers' per-layer Python, for Llama-style decoders on the GGUF kernels.

With the GGUF kernels a decode step of a small model spends a large share of its time outside them: transformers'
forward wraps every layer and attention call in decorators, keyword plumbing and output-capture hooks and looks the
attention function up per layer. :class:`NativeDecoder` computes the same forward with the model's own modules and
the same tensor operations in the same order (embedding, rotary embedding; per layer: RMSNorm, projections, rotary
embedding, cache update, the position-ordered attention kernel, output projection, residual, RMSNorm, MLP, residual;
final norm; LM head of the kept positions), so its logits and hidden states are bit-identical to the model's own
forward on the same inputs (``tests/test_native_decoder.py``), only cheaper to call.

:func:`native_decoder` builds one for a model whose structure it knows (:data:`NATIVE_CLASSES`: every linear layer
on the kernels, attention through the kernel), when the target's :class:`~eagle.model.base.plan.ForwardPlan` is
built; the plan then calls it instead of ``model(...)``. Anything it does not know (another family, a float layer
left, a query temperature, attention not on the kernel) keeps transformers' forward.

With the engine's :class:`~eagle.model.base.kv_cache.TreeKVCache` the decoder layers run as one native call,
``eagle::decoder_layers`` (``eagle/csrc/decoder.cpp``): the same steps without a Python call per operation, and
rows still computed independently of each other (row-invariant). Every step rounds as transformers' operations do
except the RMSNorm, whose sum of squares runs in a fixed order of its own (16 lanes, then the lanes in order;
:func:`eagle.kernels.reference.lane_rms_norm` is the PyTorch form ``tests/test_native_decoder.py`` checks the op's
bits against), so logits agree with transformers' forward to float32 rounding, not bit for bit. Without that
cache, with a mask it cannot read, or where the op is missing, the layers run through the modules as above.
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
from eagle.model.base.model_call import ForwardOutput

logger = logging.getLogger(__name__)

#: The causal-LM classes whose decoder layers are the Llama structure the native decoder computes (pre-norm
#: RMSNorm, rotary q/k, gated SiLU MLP, residual after each block), with their modeling modules'
#: ``apply_rotary_pos_emb``.
NATIVE_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def native_problem(model, kernel_attention: bool) -> str | None:
    """Why :class:`NativeDecoder` cannot compute ``model``'s forward exactly (with the position-ordered kernel as
    its attention when ``kernel_attention``), or None when it can."""
    name = type(model).__name__
    if name not in NATIVE_CLASSES:
        return f"{name} is not one of the Llama-style classes it knows ({', '.join(NATIVE_CLASSES)})"
    config = model.config.get_text_config()
    if not kernel_attention:
        return "its attention does not run the position-ordered kernel"
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "its MLP is not the plain gated SiLU"
    if QueryTemperature(model):
        return "its attention scales queries by a temperature"
    inner = model.model
    linears = [model.lm_head] + [module for layer in inner.layers for module in (
        layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj, layer.self_attn.o_proj,
        layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj)]
    if not all(isinstance(m, QuantLinear) and m.uses_kernels for m in linears):
        return "not every linear layer computes on the GGUF kernels"
    return None


@dataclass
class LayerArguments:
    """What ``eagle::decoder_layers`` takes of the model's layers, gathered once (7 packed weights and their types,
    3 optional biases and 2 norm weights per layer; heads, head size and MLP width; the norm's epsilon and the
    attention's scale; the activations' numerics)."""

    weights: list
    types: list
    biases: list
    norms: list
    dims: list
    eps: float
    scale: float
    numerics: str


def _same(values, what: str):
    values = set(values)
    if len(values) != 1:
        raise _NoArguments(f"its layers differ in {what}")
    return values.pop()


class _NoArguments(Exception):
    pass


def _gather_layers(layers) -> LayerArguments:
    weights, types, biases, norms, numerics = [], [], [], [], set()
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj)
        if any(m.bias is not None for m in linears[3:]):
            raise _NoArguments("an output or MLP projection has a bias")
        weights += [m.weight.packed for m in linears]
        types += [m.type_name for m in linears]
        biases += [m.bias for m in linears[:3]]
        norms += [layer.input_layernorm.weight.detach(), layer.post_attention_layernorm.weight.detach()]
        numerics.update(m.numerics for m in linears)
    if any(norm.dtype != torch.float32 for norm in norms):
        raise _NoArguments("a norm weight is not float32")
    head_dim = _same((layer.self_attn.head_dim for layer in layers), "head size")
    first = layers[0]
    dims = [first.self_attn.q_proj.out_features // head_dim, first.self_attn.k_proj.out_features // head_dim,
            head_dim, first.mlp.gate_proj.out_features]
    _same(((layer.self_attn.q_proj.out_features, layer.self_attn.k_proj.out_features,
            layer.self_attn.v_proj.out_features, layer.self_attn.o_proj.in_features,
            layer.mlp.gate_proj.out_features) for layer in layers), "shapes")
    if (dims[0] * head_dim, dims[1] * head_dim, dims[1] * head_dim) != (
            first.self_attn.q_proj.out_features, first.self_attn.k_proj.out_features,
            first.self_attn.v_proj.out_features) or first.self_attn.o_proj.in_features != dims[0] * head_dim:
        raise _NoArguments("its projections are not whole heads")
    eps = _same((norm.variance_epsilon for layer in layers
                 for norm in (layer.input_layernorm, layer.post_attention_layernorm)), "norm epsilon")
    scale = _same((float(layer.self_attn.scaling) for layer in layers), "attention scale")
    return LayerArguments(weights, types, biases, norms, dims, float(eps), scale, _same(numerics, "numerics"))


def layer_arguments(layers) -> tuple[LayerArguments | None, str | None]:
    """What ``eagle::decoder_layers`` takes of ``layers``, or (None, why not)."""
    if not kernels.available() or not hasattr(torch.ops.eagle, "decoder_layers"):
        return None, "the compiled extension has no eagle::decoder_layers"
    try:
        return _gather_layers(layers), None
    except _NoArguments as reason:
        return None, str(reason)
    except AttributeError as error:  # a layer without the modules or attributes of the Llama structure
        return None, f"a layer lacks what the native layers read ({error})"


class NativeDecoder:
    """``model``'s forward (a :data:`NATIVE_CLASSES` model checked by :func:`native_problem`), called like
    :class:`~eagle.model.base.model_call.ModelCall`: returns the kept positions' logits and, when asked, the
    hidden states as transformers gives them (each layer's input, then the final normed state). It holds the
    model's modules, not the model."""

    def __init__(self, model):
        self.inner, self.lm_head = model.model, model.lm_head
        self.layers = list(self.inner.layers)
        self.config = model.config.get_text_config()
        self.layer_types = list(getattr(self.config, "layer_types", None) or [])
        self.rotary = getattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb")
        #: what the native layers take (None: every layer runs through its modules); see :func:`layer_arguments`
        self.arguments, why = layer_arguments(self.layers)
        if self.arguments is None:
            logger.info("The decoder layers run through their modules, not eagle::decoder_layers: %s.", why)

    def _mask(self, masks, index: int):
        return masks[self.layer_types[index]] if isinstance(masks, dict) else masks

    def _layer(self, index: int, hidden: torch.Tensor, mask, cos, sin, cache) -> torch.Tensor:
        layer = self.layers[index]
        attention, mlp = layer.self_attn, layer.mlp
        batch, length = hidden.shape[:2]
        shape = (batch, length, -1, attention.head_dim)
        normed = layer.input_layernorm(hidden)
        query = attention.q_proj(normed).view(shape).transpose(1, 2)
        key = attention.k_proj(normed).view(shape).transpose(1, 2)
        value = attention.v_proj(normed).view(shape).transpose(1, 2)
        query, key = self.rotary(query, key, cos, sin)
        if cache is not None:
            key, value = cache.update(key, value, index)
        output, _ = attention_forward(attention, query, key, value, self._mask(mask, index),
                                      scaling=attention.scaling)
        hidden = hidden + attention.o_proj(output.reshape(batch, length, -1).contiguous())
        normed = layer.post_attention_layernorm(hidden)
        return hidden + mlp.down_proj(mlp.act_fn(mlp.gate_proj(normed)) * mlp.up_proj(normed))

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

    def _native_layers(self, hidden, masks, cos, sin, cache, keep_states):
        """Every decoder layer in one ``eagle::decoder_layers`` call, writing ``cache`` in place; returns the
        output of the last layer and, with ``keep_states``, each layer's input; None where it cannot run."""
        arguments = self.arguments
        if arguments is None or type(cache) is not TreeKVCache or len(cache.layers) != len(self.layers):
            return None
        batch, queries = hidden.shape[:2]
        layers = cache.layers
        start = layers[0].length
        lists = self._mask_lists(masks, queries, start + queries)
        if lists is None or cos.shape[-1] != arguments.dims[2]:
            return None
        layers[0].check_room(queries)
        for layer in layers:
            if not layer.is_initialized:
                layer.lazy_initialization(hidden.new_empty(batch, arguments.dims[1], 0, arguments.dims[2]),
                                          hidden.new_empty(batch, arguments.dims[1], 0, arguments.dims[2]))
        if cos.shape[0] != batch:
            cos, sin = cos.expand(batch, -1, -1), sin.expand(batch, -1, -1)
        out = torch.ops.eagle.decoder_layers(
            hidden.contiguous(), arguments.weights, arguments.types, arguments.biases, arguments.norms, arguments.dims,
            arguments.eps, arguments.scale, cos.contiguous(), sin.contiguous(), [layer.keys for layer in layers],
            [layer.values for layer in layers], start, lists[0], lists[1], lists[2], arguments.numerics, keep_states)
        for layer in layers:
            layer.length = start + queries
        return out[0], out[1:]

    def __call__(self, *, input_ids, attention_mask, position_ids, cache, output_hidden_states,
                 logits_to_keep=0) -> ForwardOutput:
        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, position_ids=position_ids)
        native = self._native_layers(hidden, attention_mask, cos, sin, cache, output_hidden_states)
        if native is not None:
            hidden, states = native[0], list(native[1]) if output_hidden_states else None
        else:
            states = [] if output_hidden_states else None
            for index in range(len(self.layers)):
                if states is not None:
                    states.append(hidden)
                hidden = self._layer(index, hidden, attention_mask, cos, sin, cache)
        hidden = self.inner.norm(hidden)
        if states is not None:
            states.append(hidden)
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, kept, :])
        return ForwardOutput(logits, tuple(states) if states is not None else None)


def native_decoder(model, kernel_attention: bool) -> NativeDecoder | None:
    """A :class:`NativeDecoder` of ``model`` when :func:`native_problem` finds none, else None (logged either
    way)."""
    problem = native_problem(model, kernel_attention)
    if problem is not None:
        logger.info("The target keeps transformers' forward: %s.", problem)
        return None
    logger.info("The target's forward runs without transformers' per-layer Python (eagle.model.base.native_decoder).")
    return NativeDecoder(model)
