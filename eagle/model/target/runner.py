"""The target's forward pass without transformers' per-layer Python, for Llama-style decoders on the GGUF kernels.

With the GGUF kernels a decode step of a small model spends a large share of its time outside them: transformers'
forward wraps every layer and attention call in decorators, keyword plumbing and output-capture hooks and looks the
attention function up per layer. :class:`DecoderRunner` computes the same forward with the model's own modules and
the same tensor operations in the same order (embedding, rotary embedding; per layer: RMSNorm, projections, rotary
embedding, cache update, the position-ordered attention kernel, output projection, residual, RMSNorm, MLP, residual;
final norm; LM head of the kept positions), so its logits and hidden states are bit-identical to the model's own
forward on the same inputs (``tests/test_runner.py``), only cheaper to call.

:func:`install_runner` attaches one to a model whose structure it knows (:data:`RUNNER_CLASSES`: every linear layer
on the kernels, attention through the kernel); :class:`~eagle.model.target.model_call.ModelCall` then calls it
instead of ``model(...)``. Anything it does not know (another family, a float layer left, a query temperature, a
model switched back to float layers) keeps transformers' forward.
"""

from __future__ import annotations

import logging
import sys
import weakref

import torch

from eagle.kernels.attention import attention_forward
from eagle.model.target.backends.attention import uses_kernel_attention

logger = logging.getLogger(__name__)

#: The causal-LM classes whose decoder layers are the Llama structure the runner computes (pre-norm RMSNorm,
#: rotary q/k, gated SiLU MLP, residual after each block), with their modeling modules' ``apply_rotary_pos_emb``.
RUNNER_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_RUNNERS: "weakref.WeakKeyDictionary[torch.nn.Module, DecoderRunner]" = weakref.WeakKeyDictionary()


def runner_problem(model) -> str | None:
    """Why :class:`DecoderRunner` cannot compute ``model``'s forward exactly, or None when it can."""
    from eagle.kernels.linear import QuantLinear
    from eagle.model.target.backends.attention import QueryTemperature

    name = type(model).__name__
    if name not in RUNNER_CLASSES:
        return f"{name} is not one of the Llama-style classes it knows ({', '.join(RUNNER_CLASSES)})"
    config = model.config.get_text_config()
    if not uses_kernel_attention(config):
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


class DecoderRunner:
    """``model``'s forward (a :data:`RUNNER_CLASSES` model checked by :func:`runner_problem`), called like
    :class:`~eagle.model.target.model_call.ModelCall`: returns the kept positions' logits and, when asked, the
    hidden states as transformers gives them (each layer's input, then the final normed state)."""

    def __init__(self, model):
        # no reference to ``model`` itself: it is the key of the weak dictionary holding this runner
        self.inner, self.lm_head = model.model, model.lm_head
        self.layers = list(self.inner.layers)
        self.config = model.config.get_text_config()
        self.layer_types = list(getattr(self.config, "layer_types", None) or [])
        self.rotary = getattr(sys.modules[type(model).__module__], "apply_rotary_pos_emb")

    def usable(self) -> bool:
        """Whether the model still runs attention through the kernel (it may have been switched back)."""
        return uses_kernel_attention(self.config)

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

    def __call__(self, *, input_ids, attention_mask, position_ids, cache, output_hidden_states, logits_to_keep=0):
        from eagle.model.target.model_call import ForwardOutput

        hidden = self.inner.embed_tokens(input_ids)
        cos, sin = self.inner.rotary_emb(hidden, position_ids=position_ids)
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


def install_runner(model) -> bool:
    """Attach a :class:`DecoderRunner` to ``model`` when :func:`runner_problem` finds none (logged either way);
    returns whether it did."""
    problem = runner_problem(model)
    if problem is not None:
        _RUNNERS.pop(model, None)
        logger.info("The target keeps transformers' forward: %s.", problem)
        return False
    _RUNNERS[model] = DecoderRunner(model)
    logger.info("The target's forward runs without transformers' per-layer Python (eagle.model.target.runner).")
    return True


def remove_runner(model) -> None:
    """``model`` goes back to transformers' forward."""
    _RUNNERS.pop(model, None)


def runner_for(model) -> DecoderRunner | None:
    """The runner attached to ``model``, or None."""
    return _RUNNERS.get(model)
