"""A preallocated target KV cache that holds the committed prefix plus one draft tree, and keeps only the accepted
path after verification.

It is a transformers ``Cache``: the stock model classes write into it through ``update`` like into any cache, so no
modeling file is copied. Each layer allocates ``(B, n_kv_heads, capacity, head_dim)`` keys and values on its own
device the first time it is written to (so ``device_map="auto"`` works).

A batch of B rows shares the slot axis: every forward pass writes all rows at the same slots
(``0 .. length - 1`` are in use), and each row compacts its own accepted path to its own committed length, so rows
hold different numbers of valid slots. Which slots a row may attend is the attention mask's business: the target
builds it (:meth:`eagle.model.base.target.Target.attention_mask`) from the valid slots it is given with each forward
pass (:meth:`eagle.model.engine.commit.Rows.masks`: each row's first and last valid slot); slots beyond a row's own
length hold finite leftovers that are never attended.
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

    def check_room(self, new: int) -> None:
        """ValueError unless ``new`` more positions fit after the ``length`` held."""
        if self.length + new > self.capacity:
            raise ValueError(
                f"KV cache overflow: {self.length} cached + {new} new positions exceed its capacity of "
                f"{self.capacity}."
            )

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, new = self.length, key_states.shape[-2]
        self.check_room(new)
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

    def keep_rows(self, sources: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor | None = None,
                  flat: dict | None = None) -> None:
        """Per row ``rows[i]`` (default: row i), copy the entries at slots ``sources[i]`` to slots ``targets[i]``
        ((R, M) each). ``flat``: a dict the layers of one cache share, where the flat entry indices computed for
        one layer are kept for the next layers of the same shape and device."""
        if not self.is_initialized:
            return
        if rows is None:
            rows = torch.arange(sources.shape[0])
        key = (self.keys.device, self.keys.shape[1], self.keys.shape[2])
        if flat is None:
            flat = {}
        if key not in flat:
            flat[key] = tuple(_flat_entries(rows, slots, key[1], key[2], self.keys.device)
                              for slots in (sources, targets))
        source_index, target_index = flat[key]
        # entries as rows of a (B * heads * capacity, head_dim) view: the layer's tensors are always contiguous
        # (allocated, row-indexed or concatenated, never sliced in place)
        for tensor in (self.keys, self.values):
            view = tensor.view(-1, tensor.shape[-1])
            view.index_copy_(0, target_index, view.index_select(0, source_index))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (1-D), in that order."""
        if self.is_initialized:
            index = index.to(self.keys.device)
            self.keys, self.values = self.keys[index], self.values[index]

    def add_rows(self, other: "TreeKVLayer") -> None:
        """Append ``other``'s batch rows (same capacity) after this layer's; it holds the longer of the two
        lengths (the shorter side's extra slots are leftovers its rows never attend)."""
        if other.is_initialized:
            if self.is_initialized:
                self.keys = torch.cat([self.keys, other.keys.to(self.keys.device)])
                self.values = torch.cat([self.values, other.values.to(self.values.device)])
            else:
                self.keys, self.values, self.device = other.keys, other.values, other.device
                self.is_initialized = True
        self.length = max(self.length, other.length)

    def grow(self, capacity: int) -> None:
        """Hold up to ``capacity`` slots, keeping what is stored."""
        if self.is_initialized and self.keys.shape[2] < capacity:
            extra = capacity - self.keys.shape[2]
            self.keys = torch.cat([self.keys, self.keys.new_zeros(*self.keys.shape[:2], extra, self.keys.shape[3])], 2)
            self.values = torch.cat([self.values, self.values.new_zeros(*self.values.shape[:2], extra,
                                                                        self.values.shape[3])], 2)
        self.capacity = max(self.capacity, capacity)

    def keep(self, positions: torch.Tensor, start: int) -> None:
        """Move the entries at ``positions`` (ascending, all >= start) to ``start...`` and drop the rest."""
        if self.is_initialized and positions.numel():
            positions = positions.to(self.keys.device)
            self.keys[:, :, start : start + positions.numel()] = self.keys[:, :, positions]
            self.values[:, :, start : start + positions.numel()] = self.values[:, :, positions]
        self.length = start + positions.numel()


def _cpu_layer_tensors(layers: list[TreeKVLayer]) -> list[torch.Tensor] | None:
    """Every layer's keys and values, when all are written, contiguous, on the CPU and the native kernels are
    available; else None."""
    from eagle import kernels

    tensors = []
    for layer in layers:
        if not layer.is_initialized:
            return None
        tensors += (layer.keys, layer.values)
    if not all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) or not kernels.available():
        return None
    return tensors


def _flat_entries(rows: torch.Tensor, slots: torch.Tensor, heads: int, capacity: int, device) -> torch.Tensor:
    """The entries (row ``rows[i]``, every head, slot ``slots[i, j]``) of a (B, heads, capacity, dim) tensor, as
    indices into its (B * heads * capacity, dim) view: (R * heads * M,), row-major."""
    base = (rows.to(device)[:, None, None] * heads + torch.arange(heads, device=device)[None, :, None]) * capacity
    return (base + slots.to(device)[:, None, :]).flatten()


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
        """Keep the accepted tree nodes: entries at absolute ``positions`` (ascending, all >= start) move to
        ``start, start+1, ...``. On the CPU every layer's entries move in one native call (``eagle::keep_slots``,
        where the kernels are built), else layer by layer."""
        tensors = _cpu_layer_tensors(self.layers)
        if tensors is None or not positions.numel():
            for layer in self.layers:
                layer.keep(positions, start)
            return
        from eagle import kernels

        kernels.ops().keep_slots(tensors, positions.tolist(), start)
        for layer in self.layers:
            layer.length = start + positions.numel()

    @property
    def batch_size(self) -> int | None:
        """Rows of the allocated tensors (None before the first write)."""
        layer = self.layers[0]
        return layer.keys.shape[0] if layer.is_initialized else None

    def reset(self, batch_size: int) -> None:
        """Empty the cache for a batch of ``batch_size`` rows; tensors of another batch size are dropped (and
        allocated again, zero-filled, at the next write)."""
        for layer in self.layers:
            if layer.is_initialized and layer.keys.shape[0] != batch_size:
                layer.keys = layer.values = None
                layer.is_initialized = False
            layer.length = 0

    def keep_rows(self, sources: torch.Tensor, targets: torch.Tensor, length: int,
                  rows: torch.Tensor | None = None) -> None:
        """Per row ``rows[i]`` (default: every row, in order), move the entries at slots ``sources[i]`` to
        ``targets[i]`` ((R, M) each; a row with fewer entries repeats its last source and writes past its own
        length), then hold ``length`` slots. The entry indices are computed once for all layers."""
        flat: dict = {}
        for layer in self.layers:
            layer.keep_rows(sources, targets, rows, flat)
            layer.length = length

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (finished rows leave the batch)."""
        for layer in self.layers:
            layer.select_rows(index)

    def add_rows(self, other: "TreeKVCache") -> None:
        """Append the batch rows of ``other`` (a cache of the same capacity, where joining rows were prefilled)
        after this cache's rows (rows join a running batch). Every row keeps its slots; the cache holds the longer
        of the two lengths."""
        if other.capacity != self.capacity:
            raise ValueError(f"Cannot join a cache of {other.capacity} slots to one of {self.capacity}.")
        for layer, joining in zip(self.layers, other.layers):
            layer.add_rows(joining)

    def grow(self, capacity: int) -> None:
        """Hold up to ``capacity`` slots per row from now on, keeping every row's entries."""
        for layer in self.layers:
            layer.grow(capacity)
        self.capacity = max(self.capacity, capacity)

    def get_usable_length(self, new_seq_length: int, layer_idx: int = 0) -> int:
        """transformers 4's ``Cache.get_usable_length``, which remote code written for 4.x calls: the cached
        positions a new input may attend (all of them: this cache has room for the whole generation)."""
        return self.get_seq_length(layer_idx)

    def slot_bytes(self) -> int:
        """Bytes one row holds per slot over all written layers: keys and values of every head, at the widths and
        dtype the model wrote (an MLA model writes its compressed latent; a layer never written holds nothing)."""
        total = 0
        for layer in self.layers:
            if layer.is_initialized:
                for tensor in (layer.keys, layer.values):
                    total += tensor.shape[1] * tensor.shape[3] * tensor.element_size()
        return total


def cache_bytes(slot_bytes: int, batch_size: int, capacity: int) -> int:
    """Bytes of keys and values that a :class:`TreeKVCache` of ``batch_size`` rows and ``capacity`` slots holds,
    for a model writing ``slot_bytes`` per row and slot (:meth:`TreeKVCache.slot_bytes`)."""
    return slot_bytes * batch_size * capacity


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on ``device`` (None when unknown)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        try:
            import psutil
        except ImportError:
            return None
        return psutil.virtual_memory().available
    return None


def check_cache_fits(slot_bytes: int, batch_size: int, capacity: int, device: torch.device) -> None:
    """Refuse, before anything runs, a cache of ``batch_size`` rows x ``capacity`` slots of ``slot_bytes`` each
    that would not fit in the free memory of ``device`` (with a quarter of it left for the activations)."""
    needed, free = cache_bytes(slot_bytes, batch_size, capacity), free_memory(torch.device(device))
    if free is not None and needed > 0.75 * free:
        gib = 1024 ** 3
        raise ValueError(
            f"A batch of {batch_size} rows needs a KV cache of {capacity} positions per row, {needed / gib:.2f} GiB, "
            f"but only {free / gib:.2f} GiB of memory is free on {device}: use fewer rows, fewer max_new_tokens or a "
            "smaller max_length."
        )
