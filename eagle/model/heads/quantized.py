"""A draft head whose linear layers compute over Q8_0 (or Q4_0) blocks of its own weights, on eagle's CPU kernels
(``draft_dtype="q8_0"``, what ``"auto"`` picks for an EAGLE-3 head when the target runs on the GGUF kernels; or
``draft_dtype="q4_0"``, 0.56 bytes per weight, for a head whose passes read a large share of a step's bytes).

A draft pass of a small head is bound by reading its weights (and, between target forwards that stream the
target's weights, they are no longer in the cache): Q8_0 reads 1.06 bytes per weight against bfloat16's 2, and the
kernels' int8 activations (``numerics="int8"``, as llama.cpp computes) cost about one row's time for the few rows a
draft pass has. The head's proposals change slightly; the output never does, since the target verifies every token.
The layers are quantized at load (:func:`quantize_blocks`, gguf-py's quantizer bit for bit: per 32 weights a
float16 scale and 32 int8 codes (Q8_0) or 32 4-bit codes (Q4_0)), the
RMSNorms run on the kernels' row norm (:class:`KernelRMSNorm`), the rest of the head
(embedding, rotary, attention) in float32.
"""

from __future__ import annotations

import logging

import numpy as np
import torch
from torch import nn

from eagle.model.heads.draft_layers import RMSNorm

logger = logging.getLogger(__name__)

#: the ``draft_dtype`` value that ``"auto"`` picks, and the GGUF type of each quantized ``draft_dtype``
QUANTIZED_DRAFT = "q8_0"
QUANTIZED_DRAFTS = {"q8_0": "Q8_0", "q4_0": "Q4_0"}
QUANT_TYPE = QUANTIZED_DRAFTS[QUANTIZED_DRAFT]
BLOCK = 32  # inputs per Q8_0 / Q4_0 block: a layer's input size must be a multiple of it


def head_quantization_problem(head) -> str | None:
    """Why ``head`` cannot run on the kernels' quantized layers, or None when it can."""
    from eagle import kernels

    if not kernels.available():
        return f"eagle's native kernels are unavailable ({kernels.unavailable_reason()})"
    if getattr(head, "eagle_version", None) != 3:
        return "an EAGLE-1 head shares the base model's LM head and runs in the base model's dtype"
    if head.weight.device.type != "cpu":
        return f"the head is on {head.weight.device}; the kernels compute on the CPU"
    return None


def quantize_head(head: nn.Module, shared: nn.Module | None = None, type_name: str = QUANT_TYPE) -> int:
    """Replace ``head``'s own ``nn.Linear`` layers (not those of ``shared``, e.g. a target LM head the head
    borrows) by kernel layers over ``type_name`` (Q8_0 or Q4_0) blocks of their weights with int8 activations;
    returns how many. A layer whose input size is not a multiple of 32 stays float32. The head must be float32 on
    the CPU."""
    from eagle.kernels.gguf_weights import GGUFWeight
    from eagle.kernels.linear import QuantLinear
    from eagle.model.backends.gguf import set_module

    borrowed = {id(module) for module in shared.modules()} if shared is not None else set()
    count = 0
    for name, layer in list(head.named_modules()):
        if not isinstance(layer, nn.Linear) or id(layer) in borrowed:
            continue
        if layer.in_features % BLOCK:
            logger.info("The draft head's %s (%d inputs, not a multiple of %d) stays float32.", name,
                        layer.in_features, BLOCK)
            continue
        weight = layer.weight.detach()
        packed = GGUFWeight(name, type_name, tuple(weight.shape), quantize_blocks(weight, type_name))
        bias = layer.bias.detach().to(torch.float32) if layer.bias is not None else None
        set_module(head, name, QuantLinear(packed, bias, "int8"))
        count += 1
    _norms_on_kernels(head, borrowed)
    if hasattr(head, "native_layer"):
        from eagle.model.heads.native import head_layer_plan

        head.native_layer = head_layer_plan(head)
    return count


def quantize_blocks(weight: torch.Tensor, type_name: str = QUANT_TYPE, chunk_values: int = 1 << 20) -> torch.Tensor:
    """The ``type_name`` (``"Q8_0"`` or ``"Q4_0"``) blocks of a 2-D ``weight`` (rows of a multiple of 32 values, any
    float dtype) as a (rows, K / 32 * block bytes) uint8 tensor: gguf-py's ``quants.quantize`` of its float32 values
    (Q8_0: per block ``d = max|w| / 127``, codes rounded half away from zero; Q4_0: ``d = w_max / -8`` for the
    value of largest magnitude, 4-bit codes; ``d`` stored as float16), which quantizes each row alone, applied to
    whole rows of about ``chunk_values`` values at a time: the float32 copy of a float16 or bfloat16 weight is one
    chunk's, never the whole matrix's."""
    import gguf

    if type_name not in QUANTIZED_DRAFTS.values():
        raise ValueError(f"quantize_blocks quantizes to {sorted(QUANTIZED_DRAFTS.values())}, got {type_name!r}.")
    if weight.dim() != 2 or weight.shape[1] % BLOCK or not weight.is_floating_point():
        raise ValueError(f"quantize_blocks takes a 2-D float weight whose rows are a multiple of {BLOCK} values, "
                         f"got shape {tuple(weight.shape)} ({weight.dtype}).")
    qtype = gguf.GGMLQuantizationType[type_name]
    block_bytes = gguf.GGML_QUANT_SIZES[qtype][1]
    rows, k = weight.shape
    rows_per_chunk = max(1, chunk_values // k)
    out = np.empty((rows, k // BLOCK * block_bytes), dtype=np.uint8)
    source = weight.detach()
    for start in range(0, rows, rows_per_chunk):  # float32 rows, one chunk at a time (a float32 weight: no copy)
        values = source[start:start + rows_per_chunk].to(torch.float32).numpy()
        out[start:start + rows_per_chunk] = gguf.quants.quantize(values, qtype)
    return torch.from_numpy(out)


class KernelRMSNorm(RMSNorm):
    """The head's RMSNorm on eagle's CPU kernels (``eagle::rms_norm``): each float32 CPU row normalised by one fixed
    sequence of roundings (the decoder layers' norm, :func:`eagle.kernels.reference.lane_rms_norm` bit for bit), in
    one native call instead of the eight tensor operations of :class:`RMSNorm`'s formula, which other inputs (another
    dtype or device, the kernels unavailable) still take."""

    @classmethod
    def from_norm(cls, norm: RMSNorm) -> "KernelRMSNorm":
        """A kernel norm with ``norm``'s weight (its float32 storage shared, frozen) and epsilon."""
        new = cls(norm.weight.shape[0], eps=norm.variance_epsilon)
        new.weight = nn.Parameter(norm.weight.detach().to(torch.float32), requires_grad=False)
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from eagle import kernels

        if x.dtype == torch.float32 and x.device.type == "cpu" and x.shape[-1] and kernels.available():
            return kernels.ops().rms_norm(x, self.weight, self.variance_epsilon)
        return super().forward(x)


def _norms_on_kernels(head: nn.Module, borrowed: set[int]) -> None:
    """The head's own RMSNorms on the kernels' row norm (one call each, instead of eight tensor operations)."""
    from eagle.model.backends.gguf import set_module

    for name, norm in list(head.named_modules()):
        if type(norm) is RMSNorm and id(norm) not in borrowed:
            set_module(head, name, KernelRMSNorm.from_norm(norm))


def quantized_at_load(draft_dtype, target_on_kernels: bool) -> bool:
    """Whether the head is to be quantized once loaded (``"q8_0"`` / ``"q4_0"``, or ``"auto"`` with the target on
    the GGUF kernels): its linear weights are then loaded in the checkpoint's dtype and quantized from it, never
    made float32 whole (:func:`apply_draft_quantization` casts those it leaves float)."""
    return draft_dtype in QUANTIZED_DRAFTS or (draft_dtype in (None, "auto") and target_on_kernels)


def draft_load_dtype(draft_dtype, target_on_kernels: bool):
    """The ``draft_dtype`` to load the head in: float32 where it is then quantized (:func:`quantized_at_load`),
    else ``draft_dtype`` itself."""
    return "float32" if quantized_at_load(draft_dtype, target_on_kernels) else draft_dtype


def apply_draft_quantization(head, base_model, draft_dtype, target_on_kernels: bool) -> bool:
    """Quantize ``head`` (loaded by :func:`draft_load_dtype`'s dtype) where ``draft_dtype`` asks for it: ``"q8_0"``
    or ``"q4_0"`` (refused, with the reason, where the kernels cannot run it) or ``"auto"`` with the target on the
    GGUF kernels (Q8_0 where possible; else the head stays float32, logged). Returns whether it did."""
    if not quantized_at_load(draft_dtype, target_on_kernels):
        return False
    problem = head_quantization_problem(head)
    if problem is not None and draft_dtype in QUANTIZED_DRAFTS:
        raise ValueError(f"draft_dtype={draft_dtype!r} is not possible here: {problem}.")
    type_name = QUANTIZED_DRAFTS.get(draft_dtype, QUANT_TYPE)
    count = quantize_head(head, shared=base_model, type_name=type_name) if problem is None else 0
    _float32_linears(head, base_model)
    if problem is not None:
        logger.info("The draft head stays float32: %s.", problem)
        return False
    logger.info("The draft head's %d linear layers compute over %s blocks with int8 activations (draft_dtype=%r).",
                count, type_name, draft_dtype)
    return count > 0


def _float32_linears(head: nn.Module, shared: nn.Module | None) -> None:
    """The head's own ``nn.Linear`` weights still in another dtype (loaded in the checkpoint's, left unquantized)
    made float32, as the rest of the head is."""
    borrowed = {id(module) for module in shared.modules()} if shared is not None else set()
    for layer in head.modules():
        if isinstance(layer, nn.Linear) and id(layer) not in borrowed and layer.weight.dtype != torch.float32:
            layer.weight.data = layer.weight.data.to(torch.float32)


def draft_dtype_name(head) -> str:
    """How ``head`` computes, as ``draft_dtype`` names it: ``"q8_0"`` / ``"q4_0"`` for a quantized head, else its
    dtype."""
    type_name = getattr(head.weight, "type_name", None)  # the packed weight of a kernel layer
    for name, quantized_type in QUANTIZED_DRAFTS.items():
        if type_name == quantized_type:
            return name
    return str(head.weight.dtype).replace("torch.", "")
