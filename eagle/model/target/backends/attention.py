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
  everything :func:`tree_sdpa_attention` does not handle itself.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch.nn.functional as F

SUPPORTED_ATTENTION = ("sdpa", "eager")
# Name under which tree_sdpa_attention is registered with transformers' AttentionInterface (when a Target is built,
# not on import).
TREE_SDPA = "eagle_tree_sdpa"


def tree_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    """transformers' SDPA attention, except for several queries under a mask with grouped key/value heads on a CPU.

    There transformers repeats every key and value head for its query heads before calling SDPA (``repeat_kv``: a
    copy of the layer's whole cache, each layer, each verification), because on CUDA a masked grouped call would
    fall back to a slow kernel. On a CPU, SDPA's own ``enable_gqa`` computes the same numbers (bitwise, checked in
    the tests) without the copy (timings: docs/PERFORMANCE.md). Everything else goes to transformers' function
    unchanged.
    """
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


TRANSFORMERS_TOUCHES = {
    "register": "transformers.AttentionInterface.register / AttentionMaskInterface.register",
    "switch": "PretrainedConfig._attn_implementation_internal",
    "delegate": "transformers.integrations.sdpa_attention.sdpa_attention_forward",
}


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
    if getattr(config, "_attn_implementation_internal", None) == "sdpa":
        register_tree_sdpa()


def register_tree_sdpa() -> None:
    """Register :func:`tree_sdpa_attention` with transformers under :data:`TREE_SDPA` (once), with SDPA's own mask
    builder, so that masks built meanwhile by another caller of the same model (a thread) are what they were."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    if TREE_SDPA not in AttentionInterface():
        AttentionInterface.register(TREE_SDPA, tree_sdpa_attention)
        AttentionMaskInterface.register(TREE_SDPA, sdpa_mask)


@contextmanager
def our_attention(config):
    """While the target runs a forward pass for us (always with a prepared 4-D mask, which transformers passes
    through as it is), its SDPA layers use :func:`tree_sdpa_attention` (registered by :class:`Target`); the model
    is left as it was afterwards."""
    if getattr(config, "_attn_implementation_internal", None) != "sdpa":
        yield
        return
    config._attn_implementation_internal = TREE_SDPA
    try:
        yield
    finally:
        config._attn_implementation_internal = "sdpa"


