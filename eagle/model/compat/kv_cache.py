"""Reference-compatibility layer: ``from eagle.model.kv_cache import initialize_past_key_values``.

The reference allocated its target KV cache with this function; here it returns the engine's own cache
(:class:`eagle.model.base.kv_cache.TreeKVCache`), with the reference's other two return values kept for the
signature's sake.
"""

from __future__ import annotations

import torch

from eagle.model.base.kv_cache import TreeKVCache

__all__ = ["initialize_past_key_values"]


def initialize_past_key_values(model, max_length: int = 2200):
    """Reference-compatible constructor: returns ``(past_key_values, past_key_values_data, current_length_data)``.

    Here ``past_key_values`` is a :class:`TreeKVCache`; the other two are kept for signature compatibility
    (the per-layer tensors once allocated, and a CPU tensor of current lengths).
    """
    num_layers = model.config.get_text_config().num_hidden_layers
    cache = TreeKVCache(num_layers, max_length)
    return cache, [layer.keys for layer in cache.layers], torch.zeros(2 * num_layers, dtype=torch.long)
