"""A preallocated target KV cache that holds the committed prefix plus one draft tree, and keeps only the accepted
path after verification.

It is a transformers ``Cache``: the stock model classes write into it through ``update`` like into any cache, so no
modeling file is copied. Each layer allocates ``(1, n_kv_heads, capacity, head_dim)`` keys and values on its own
device the first time it is written to (so ``device_map="auto"`` works).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class TreeKVLayer(CacheLayerMixin):
    """One layer's preallocated keys/values; ``length`` positions are valid."""

    is_compileable = False
    is_sliding = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        bsz, heads, _, head_dim = key_states.shape
        self.device = key_states.device
        self.keys = key_states.new_zeros(bsz, heads, self.capacity, head_dim)
        self.values = value_states.new_zeros(bsz, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = self.length, key_states.shape[-2]
        if start + new > self.capacity:
            raise ValueError(
                f"KV cache overflow: {start} cached + {new} new positions exceed its capacity of {self.capacity}."
            )
        self.keys[:, :, start : start + new] = key_states
        self.values[:, :, start : start + new] = value_states
        self.length = start + new
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0

    def keep(self, positions: torch.Tensor, start: int) -> None:
        """Move the entries at ``positions`` (ascending, all >= start) to ``start...`` and drop the rest."""
        if self.is_initialized and positions.numel():
            positions = positions.to(self.keys.device)
            self.keys[:, :, start : start + positions.numel()] = self.keys[:, :, positions]
            self.values[:, :, start : start + positions.numel()] = self.values[:, :, positions]
        self.length = start + positions.numel()


class TreeKVCache(Cache):
    """Cache of a whole target model: committed prefix + tree, compacted after each verification."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[TreeKVLayer(capacity) for _ in range(num_layers)])
        self.capacity = capacity

    @property
    def length(self) -> int:
        """Number of positions held (the same in every layer)."""
        return self.layers[0].length

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions (drop a rejected tree or a failed call's leftovers)."""
        for layer in self.layers:
            layer.length = min(layer.length, length)

    def keep_path(self, positions: torch.Tensor, start: int) -> None:
        """Keep the accepted tree nodes: entries at absolute ``positions`` move to ``start, start+1, ...``."""
        for layer in self.layers:
            layer.keep(positions, start)


def initialize_past_key_values(model, max_length: int = 2200):
    """Reference-compatible constructor: returns ``(past_key_values, past_key_values_data, current_length_data)``.

    Here ``past_key_values`` is a :class:`TreeKVCache`; the other two are kept for signature compatibility
    (the per-layer tensors once allocated, and a CPU tensor of current lengths).
    """
    num_layers = model.config.get_text_config().num_hidden_layers
    cache = TreeKVCache(num_layers, max_length)
    return cache, [layer.keys for layer in cache.layers], torch.zeros(2 * num_layers, dtype=torch.long)
