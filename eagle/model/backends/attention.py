"""Attention backends: the one module that touches transformers' attention internals.

The target runs as the stock transformers class; tree attention is a 4-D mask that its SDPA and eager attention
honour as given. On a CPU, while our forward passes run, SDPA layers of grouped-query models go through
:func:`tree_sdpa_attention` instead of transformers' own SDPA function (which copies every layer's keys and values
once per query head group whenever several tokens go in under a mask). Each touch of transformers internals is named
in :data:`TRANSFORMERS_TOUCHES` and tested against the pinned transformers (``tests/test_attention_backend.py``):

- ``register``: ``AttentionInterface.register`` / ``AttentionMaskInterface.register`` (public) add our function
  under :data:`TREE_SDPA`, with SDPA's own mask builder;
- ``switch``: the config's ``_attn_implementation_internal`` (private: transformers' public
  ``set_attn_implementation`` walks every submodule, too slow around each forward) names :data:`TREE_SDPA` during
  our passes and ``"sdpa"`` again after them, so that the model's own ``generate`` and other callers see it as it was;
- ``delegate``: ``transformers.integrations.sdpa_attention.sdpa_attention_forward`` (module path) computes
  everything :func:`tree_sdpa_attention` does not handle itself;
- ``query_temperature``: Llama-4's NoPE layers scale their queries by a temperature of the query position, which
  the attention module computes from the cache length (``attn_temperature_tuning``, ``use_rope``,
  ``floor_scale``, ``attn_scale``, attributes of ``Llama4TextAttention``). A tree node's cache slot is not its
  position, so during our passes the module's own scaling is switched off and our attention function applies the
  same formula to the positions the engine passes (:class:`QueryTemperature`);
- ``module_eager``: the modeling module's own ``eager_attention_forward`` (module attribute), which our eager
  entry point calls after that scaling (a family's eager function may differ from the generic one);
- ``kernel``: with the GGUF kernels on (:func:`use_kernel_attention`), ``AttentionInterface.register`` /
  ``AttentionMaskInterface.register`` add :func:`eagle.kernels.attention.attention_forward` (the position-ordered,
  batch-invariant kernel) under :data:`KERNEL_ATTENTION`, and the ``switch`` names it instead of
  :data:`TREE_SDPA` during our passes (SDPA or eager models alike), so prefill, plain decoding and tree
  verification all run one kernel, whose bits for a token do not depend on the other queries of the call.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F

SUPPORTED_ATTENTION = ("sdpa", "eager")
# Names under which our attention functions are registered with transformers' AttentionInterface (when a Target is
# built, not on import).
TREE_SDPA = "eagle_tree_sdpa"
TREE_EAGER = "eagle_tree_eager"
# During one of our passes: (ids of the attention modules whose query temperature we apply, query positions (B, T)).
_TEMPERATURE: ContextVar = ContextVar("eagle_query_temperature", default=None)
# Name under which eagle.kernels.attention's position-ordered kernel is registered (by use_kernel_attention).
KERNEL_ATTENTION = "eagle_position_ordered"
# id(config) -> weakref(config) of the configs whose passes run KERNEL_ATTENTION (a config is not hashable).
_KERNEL_CONFIGS: dict[int, weakref.ref] = {}


def tree_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers' SDPA attention, except for several queries under a mask with grouped key/value heads on a CPU.

    There transformers repeats every key and value head for its query heads before calling SDPA (``repeat_kv``: a
    copy of the layer's whole cache, each layer, each verification), because on CUDA a masked grouped call would
    fall back to a slow kernel. On a CPU, SDPA's own ``enable_gqa`` computes the same numbers (bitwise, checked in
    the tests) without the copy (timings: docs/PERFORMANCE.md). Everything else goes to transformers' function
    unchanged.
    """
    query = _tempered(module, query)
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    plain = not any(kwargs.get(name) is not None for name in ("position_bias", "s_aux", "softcap"))
    if (grouped and plain and attention_mask is not None and query.shape[2] > 1 and query.device.type == "cpu"
            and not module.training):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def tree_eager_attention(module, query, key, value, attention_mask, **kwargs):
    """The model's own eager attention (its modeling module's ``eager_attention_forward``), after the query
    temperature of :class:`QueryTemperature`; used only for eager models that need that temperature."""
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward")
    return eager(module, _tempered(module, query), key, value, attention_mask, **kwargs)


TRANSFORMERS_TOUCHES = {
    "register": "transformers.AttentionInterface.register / AttentionMaskInterface.register",
    "switch": "PretrainedConfig._attn_implementation_internal",
    "delegate": "transformers.integrations.sdpa_attention.sdpa_attention_forward",
    "query_temperature": "Llama4TextAttention.attn_temperature_tuning / use_rope / floor_scale / attn_scale",
    "module_eager": "<modeling module>.eager_attention_forward",
    "kernel": "transformers.AttentionInterface.register / AttentionMaskInterface.register (KERNEL_ATTENTION)",
}


class QueryTemperature:
    """The attention modules of a model whose queries are scaled by a temperature of the query position (Llama-4's
    NoPE layers: ``1 + attn_scale * log1p(floor((position + 1) / floor_scale))``). transformers computes the
    position from the cache length, which for a draft-tree node or a left-padded row is its cache slot, not its
    position; during our passes the modules' own scaling is off and :func:`tree_sdpa_attention` /
    :func:`tree_eager_attention` apply the formula to the positions the engine passes."""

    def __init__(self, model):
        self.modules = [m for m in model.modules() if getattr(m, "attn_temperature_tuning", False)
                        and not getattr(m, "use_rope", True) and hasattr(m, "floor_scale")]

    def __bool__(self) -> bool:
        return bool(self.modules)

    @staticmethod
    def scales(module, positions: torch.Tensor) -> torch.Tensor:
        """positions (B, T) -> (B, 1, T, 1) float32 query scales, the formula of ``Llama4TextAttention``."""
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
        return scales[:, None, :, None]


def _tempered(module, query):
    """query (B, heads, T, head_dim), scaled by its position's temperature when ``module`` is one of the active
    :class:`QueryTemperature` modules (as transformers does: in float32, cast back)."""
    active = _TEMPERATURE.get()
    if active is None or id(module) not in active[0]:
        return query
    return (query * QueryTemperature.scales(module, active[1].to(query.device))).to(query.dtype)


def check_attention_implementation(model) -> None:
    """Refuse a model whose attention implementation ignores custom 4-D (tree) masks."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        raise ValueError(
            f"The base model uses attn_implementation={attention!r}, which ignores custom 4-D (tree) attention masks. "
            f"Load it with attn_implementation='sdpa' or 'eager'."
        )


def prepare_attention(config) -> None:
    """Make our attention usable by a model of ``config`` (registered once, when a target is built)."""
    if getattr(config, "_attn_implementation_internal", None) in SUPPORTED_ATTENTION:
        register_tree_sdpa()


def register_tree_sdpa() -> None:
    """Register :func:`tree_sdpa_attention` with transformers under :data:`TREE_SDPA` (once), with SDPA's own mask
    builder, so that masks built meanwhile by another caller of the same model (a thread) are what they were."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if TREE_SDPA not in AttentionInterface():
        AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
        AttentionMaskInterface.register(TREE_SDPA, sdpa_mask)
    if TREE_EAGER not in AttentionInterface():
        from transformers.masking_utils import eager_mask

        AttentionInterface.register(TREE_EAGER, tree_eager_attention)
        AttentionMaskInterface.register(TREE_EAGER, eager_mask)


def use_kernel_attention(config, enabled: bool = True) -> None:
    """From now on our passes over a model of ``config`` (its text config) run the position-ordered kernel
    (:func:`eagle.kernels.attention.attention_forward`, registered under :data:`KERNEL_ATTENTION` with SDPA's mask
    builder); ``enabled=False`` goes back to :func:`tree_sdpa_attention` / the model's own attention."""
    if not enabled:
        _KERNEL_CONFIGS.pop(id(config), None)
        return
    from transformers import AttentionInterface

    if KERNEL_ATTENTION not in AttentionInterface():
        from eagle.kernels.attention import register

        register(KERNEL_ATTENTION)
    _KERNEL_CONFIGS[id(config)] = weakref.ref(config)


def uses_kernel_attention(config) -> bool:
    """Whether our passes over a model of ``config`` run the position-ordered kernel."""
    entry = _KERNEL_CONFIGS.get(id(config))
    return entry is not None and entry() is config


@contextmanager
def our_attention(config, temperature: QueryTemperature | None = None, positions: torch.Tensor | None = None):
    """While the target runs a forward pass for us (always with a prepared 4-D mask, which transformers passes
    through as it is), its SDPA layers use :func:`tree_sdpa_attention` (registered by :class:`Target`), or every
    layer the position-ordered kernel where :func:`use_kernel_attention` says so, and the modules of
    ``temperature`` (if any) scale their queries by ``positions`` ((B, T) query positions) instead of their cache
    slots, under SDPA or eager attention (the kernel does not apply a query temperature: such a model runs the tree
    functions); the model is left as it was afterwards."""
    implementation = getattr(config, "_attn_implementation_internal", None)
    if uses_kernel_attention(config) and implementation in SUPPORTED_ATTENTION and not temperature:
        ours = KERNEL_ATTENTION
    else:
        ours = {"sdpa": TREE_SDPA, "eager": TREE_EAGER if temperature else None}.get(implementation)
    if ours is None:
        yield
        return
    token = _TEMPERATURE.set((frozenset(map(id, temperature.modules)), positions) if temperature else None)
    for module in temperature.modules if temperature else ():
        module.attn_temperature_tuning = False
    config._attn_implementation_internal = ours
    try:
        yield
    finally:
        config._attn_implementation_internal = implementation
        for module in temperature.modules if temperature else ():
            module.attn_temperature_tuning = True
        _TEMPERATURE.reset(token)


