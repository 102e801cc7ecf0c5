"""Position-ordered, batch-invariant attention for tree verification and plain decoding (CPU, float32).

:func:`tree_attention` computes ``softmax(scale * q k^T) v`` for each query over the key slots its mask shows, by
the compiled op ``eagle::tree_attention``. Each query walks its visible keys in slot order with a reduction whose
structure depends only on that list, so its output bits depend only on its q row and its visible keys' rows: a tree
node verified among others (keys at scattered slots, masked slots between them) gets exactly the bits the same
token gets in plain decoding (the same keys at contiguous slots), whatever the batch, the number of queries, the
query's place among them or the thread count. PyTorch's CPU SDPA does not promise that.

:func:`attention_forward` is the same computation behind transformers' attention-function signature, to register
with ``AttentionInterface`` (:func:`register`).

The visible keys of a mask are compacted once into lists (:func:`visible_keys`) and cached for that mask object:
transformers hands the same mask object to every layer of a forward. The compiled op runs the instruction set of
every kernel of the extension (:mod:`eagle.kernels`: ``EAGLE_KERNELS_ISA``, :func:`eagle.kernels.use_isa`). Where
it is unavailable (:func:`eagle.kernels.available`: no extension, ``EAGLE_KERNELS=0``, ...) or cannot take the
call (a tensor on another device or of another dtype, autograd), the float64 reference
(:mod:`eagle.kernels.reference_attention`) computes the same math, slowly.
"""

from __future__ import annotations

import functools
import logging
import weakref
from collections import OrderedDict
from dataclasses import dataclass

import torch

from eagle import kernels
from eagle.kernels.reference_attention import reference_attention

logger = logging.getLogger(__name__)

# Keyword arguments of transformers' attention call that do not change the result of a masked attention (the mask
# already carries causality, padding and sliding windows; the rest is bookkeeping or for other kernels).
IGNORED_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "output_attentions", "output_hidden_states",
    "output_router_logits", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx",
    "num_items_in_batch", "layer_idx", "deterministic", "cache", "past_key_values", "is_causal",
})
VISIBLE_CACHE_SIZE = 8  # masks remembered at once (a forward uses one or two: full and sliding window)


@dataclass(frozen=True)
class VisibleKeys:
    """The visible key slots of a (B, T, S) mask, as lists per (mask row, query).

    ``indices[offsets[b * T + t] : offsets[b * T + t + 1]]`` are the slots query t of mask row b sees, ascending.
    """

    offsets: torch.Tensor | None  # (mask_batch * T + 1,) int64, for the compiled op
    indices: torch.Tensor | None  # (visible entries,) int32
    visible: torch.Tensor | None  # bool (mask_batch, T, S), for the reference
    mask_batch: int
    queries: int
    slots: int


# ---------------------------------------------------------------------------------------------------------------
# Masks and their visible-key lists


def _mask_rows(mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, T, S) or (B, T, S) -> a (B, T, S) view, or ValueError."""
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"the attention mask must be a tensor, got {type(mask).__name__}")
    if mask.dim() == 4:
        if mask.shape[1] != 1:
            raise ValueError(f"the attention mask must be shared by all heads, (B, 1, T, S); got shape "
                             f"{tuple(mask.shape)} (per-head masks are not supported)")
        return mask[:, 0]
    if mask.dim() == 3:
        return mask
    raise ValueError(f"the attention mask must be (B, 1, T, S) or (B, T, S), got shape {tuple(mask.shape)}")


def _visible_bool(rows: torch.Tensor) -> torch.Tensor:
    """bool (B, T, S) from a boolean (True = visible) or additive (0 visible, -inf / finfo.min masked) mask."""
    if rows.dtype == torch.bool:
        return rows
    if not rows.dtype.is_floating_point:
        raise ValueError(f"the attention mask must be bool or floating point (additive), got {rows.dtype}")
    visible = rows == 0
    masked = (rows == float("-inf")) | (rows == torch.finfo(rows.dtype).min)
    if not bool((visible | masked).all()):
        bad = rows[~(visible | masked)][0].item()
        raise ValueError(f"an additive attention mask may hold only 0 (visible) and -inf or "
                         f"{torch.finfo(rows.dtype).min} (masked), got {bad} (masks that add a bias to the scores "
                         f"are not supported)")
    return visible


def _compute_visible(mask: torch.Tensor, compiled: bool) -> VisibleKeys:
    rows = _mask_rows(mask)
    batch, queries, slots = rows.shape
    if not compiled:
        return VisibleKeys(None, None, _visible_bool(rows), batch, queries, slots)
    if rows.device.type != "cpu":
        rows = rows.cpu()
    if rows.dtype == torch.float32:
        masked_value = torch.finfo(torch.float32).min
    else:
        rows, masked_value = _visible_bool(rows), 0.0
    try:
        offsets, indices = torch.ops.eagle.visible_keys(rows, masked_value)
    except RuntimeError as error:
        raise ValueError(str(error).split("\n")[0]) from None
    return VisibleKeys(offsets, indices, None, batch, queries, slots)


# id(mask) -> (weakref to the mask, its version counter or None for an inference tensor, VisibleKeys); one cache
# for the compiled op's lists, one for the reference's bool masks.
_visible_caches: dict[bool, OrderedDict] = {True: OrderedDict(), False: OrderedDict()}


def visible_keys(mask: torch.Tensor, compiled: bool | None = None) -> VisibleKeys:
    """The visible-key lists of ``mask`` ((B, 1, T, S) or (B, T, S), bool or additive float), cached per mask
    object (and rebuilt if the mask was modified in place since; inference-mode tensors have no version counter,
    so a mask created under ``torch.inference_mode`` and then modified in place is not noticed: give each forward
    its own mask tensor, as transformers does, or call :func:`clear_visible_cache`).

    ``compiled`` selects the form (lists for the compiled op, a bool mask for the reference); default: the compiled
    form when the op is available.
    """
    cache = _visible_caches[kernels.available() if compiled is None else bool(compiled)]
    entry = cache.get(id(mask))
    if entry is not None and entry[0]() is mask and (entry[1] is None or entry[1] == mask._version):
        return entry[2]
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"the attention mask must be a tensor, got {type(mask).__name__}")
    result = _compute_visible(mask, cache is _visible_caches[True])
    cache[id(mask)] = (weakref.ref(mask), None if mask.is_inference() else mask._version, result)
    while len(cache) > VISIBLE_CACHE_SIZE:
        cache.popitem(last=False)
    return result


def clear_visible_cache() -> None:
    """Forget every cached visible-key list."""
    for cache in _visible_caches.values():
        cache.clear()


# ---------------------------------------------------------------------------------------------------------------
# Attention


def _check_shapes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lists: VisibleKeys) -> None:
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(f"query, key and value must be (B, Hq, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv); got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    batch, q_heads, queries, dim = query.shape
    if (key.shape[0] != batch or value.shape[:3] != key.shape[:3] or key.shape[3] != dim or key.shape[1] == 0
            or q_heads % key.shape[1]):
        raise ValueError(f"query, key and value must be (B, Hq, T, D), (B, Hkv, S, D), (B, Hkv, S, Dv) with Hkv "
                         f"dividing Hq; got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if lists.queries != queries or lists.slots != key.shape[2] or lists.mask_batch not in (1, batch):
        raise ValueError(f"the attention mask must be (B or 1, 1, T, S) = ({batch}, 1, {queries}, {key.shape[2]}) "
                         f"for query {tuple(query.shape)} and key {tuple(key.shape)}; got mask rows "
                         f"({lists.mask_batch}, {lists.queries}, {lists.slots})")


_FLOAT32 = torch.float32


def _compiled_ok(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sinks) -> bool:
    """Whether the compiled op runs this call: float32 CPU query (the op refuses other key / value dtypes and
    devices with a clear error), no gradient wanted, the extension loaded."""
    if query.dtype is not _FLOAT32 or not query.is_cpu:
        return False
    if sinks is not None and (sinks.dtype is not _FLOAT32 or not sinks.is_cpu):
        return False
    if torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad
                                    or (sinks is not None and sinks.requires_grad)):
        return False
    return kernels.available()


@functools.cache
def _op():
    return torch.ops.eagle.tree_attention.default


def tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float,
                   sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Attention of each query over the key slots its mask shows, position-ordered and batch-invariant.

    Args:
        query: (B, Hq, T, D) float32 (any strides).
        key: (B, Hkv, S, D), Hkv dividing Hq (grouped heads share their key/value loads); may be a view of a
            longer preallocated cache (any strides; a last dimension that is not contiguous is copied).
        value: (B, Hkv, S, Dv).
        mask: (B or 1, 1, T, S) or (B or 1, T, S): bool (True = visible) or additive float (0 visible, -inf or the
            dtype's finfo.min masked), shared by all heads. Its visible-key lists are cached per mask object.
        scale: multiplies every score (transformers' ``scaling``).
        sinks: optional (Hq,) per-head logits that join the softmax's denominator only (GPT-OSS).
        softcap: optional logit soft-capping ``softcap * tanh(score / softcap)`` (Gemma 2).

    Returns:
        (B, T, Hq, Dv) contiguous, query.dtype. A query that sees no key gets zeros.

    Raises:
        ValueError: shapes that do not fit together, a per-head mask, an additive mask with other values than 0
            and -inf / finfo.min.
    """
    compiled = _compiled_ok(query, key, value, sinks)
    lists = visible_keys(mask, compiled)
    if compiled and query.dim() == 4 and key.dim() == 4:
        batch, _, queries, _ = query.shape
        if (lists.queries != queries or lists.slots != key.size(2)
                or (lists.mask_batch != 1 and lists.mask_batch != batch)):
            _check_shapes(query, key, value, lists)
        try:
            if sinks is None and softcap is None:
                return _op()(query, key, value, lists.offsets, lists.indices, scale)
            return _op()(query, key, value, lists.offsets, lists.indices, scale, sinks,
                         None if softcap is None else float(softcap))
        except RuntimeError as error:  # the op's checks (shapes, heads, values): same message, Python's type
            raise ValueError(str(error).split("\n")[0]) from None
    _check_shapes(query, key, value, lists)
    logger.debug("tree_attention: float64 reference for %s %s on %s", tuple(query.shape), query.dtype,
                 query.device)
    out = reference_attention(query, key, value, lists.visible, scale, sinks, softcap)
    return out.to(query.dtype)


_causal_masks: OrderedDict = OrderedDict()


def causal_mask(queries: int, slots: int, device: torch.device, sliding_window: int | None = None,
                is_causal: bool = True) -> torch.Tensor:
    """bool (1, 1, T, S) for a call without a mask, as transformers' SDPA path reads one: a single query sees every
    slot (it is the last position); T > 1 queries are causal from slot 0 (query t sees slots 0..t). With a sliding
    window, query position p sees slots j with p - j < sliding_window. Cached per shape (one object per forward)."""
    key = (queries, slots, str(device), sliding_window, is_causal)
    mask = _causal_masks.get(key)
    if mask is None:
        positions = torch.arange(queries, device=device)[:, None] + (slots - 1 if queries == 1 else 0)
        slot = torch.arange(slots, device=device)[None, :]
        mask = (slot <= positions) if is_causal else torch.ones(queries, slots, dtype=torch.bool, device=device)
        if sliding_window is not None:
            mask = mask & (positions - slot < sliding_window)
        mask = mask[None, None]
        _causal_masks[key] = mask
        while len(_causal_masks) > VISIBLE_CACHE_SIZE:
            _causal_masks.popitem(last=False)
    return mask


def _refuse_unknown(kwargs: dict) -> None:
    unknown = sorted(name for name, val in kwargs.items() if val is not None and name not in IGNORED_KWARGS)
    if unknown:
        raise ValueError(f"attention_forward does not support the attention argument(s) {', '.join(unknown)} "
                         f"(they would change the result); use attn_implementation='sdpa' or 'eager' for this model")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, s_aux: torch.Tensor | None = None,
                      softcap: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``AttentionInterface``) over :func:`tree_attention`.

    query (B, Hq, T, D), key (B, Hkv, S, D), value (B, Hkv, S, Dv); attention_mask (B, 1, T, S) bool or additive
    (it carries causality, padding and any sliding window), or None for causal (:func:`causal_mask`).
    ``s_aux`` are GPT-OSS's per-head sinks, ``softcap`` Gemma 2's logit cap. Returns ((B, T, Hq, Dv), None): no
    attention weights. Refuses (ValueError) dropout while training and keyword arguments that would change the
    result in a way this kernel does not compute (e.g. ``position_bias``).
    """
    if dropout and getattr(module, "training", False):
        raise ValueError(f"attention_forward cannot apply attention dropout ({dropout}) in training; put the model "
                         f"in eval() mode or use attn_implementation='sdpa' for training")
    if not IGNORED_KWARGS.issuperset(kwargs):
        _refuse_unknown(kwargs)
    if kwargs.get("output_attentions"):
        logger.warning("attention_forward returns no attention weights (output_attentions=True is ignored)")
    if attention_mask is None:
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        attention_mask = causal_mask(query.shape[2], key.shape[2], query.device, sliding_window, bool(is_causal))
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return tree_attention(query, key, value, attention_mask, scale, sinks=s_aux, softcap=softcap), None


def register(name: str = "eagle_position_ordered") -> str:
    """Register :func:`attention_forward` with transformers under ``name`` (with SDPA's mask builder, so models
    build the same boolean masks as for ``attn_implementation='sdpa'``); returns ``name``. Load or switch a model
    with ``attn_implementation=name`` to use it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
