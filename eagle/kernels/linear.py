"""Linear layers and embeddings over a GGUF file's quantized blocks.

:class:`QuantLinear` holds one weight in the kernels' packed layout (about the file's size) and computes
``y = x @ w.T + bias`` with ``torch.ops.eagle.quant_linear``, in one of two numerics:

- ``"float32"`` (default): the float32 weights transformers builds from the file (gguf-py's dequantization, bit for
  bit) times float32 activations, one fixed order of fused multiply-adds per output.
- ``"int8"``: activations quantized per block of 32 to int8 (scale max|x| / 127), exact integer dot products per
  group of weights, combined in float32 (how llama.cpp computes; faster where many rows are computed at once).
  F32 / F16 / BF16 weights stay on the float32 path in this mode.

Both are row-invariant: a row's output is bit-identical whatever else is in the call (how many rows, its position)
and whatever the thread count, so a token verified inside a draft tree gets exactly the bits it gets alone.

When the kernels are unavailable (see :mod:`eagle.kernels`) or do not handle the weight's type, the layer holds the
dequantized float32 weight and uses ``torch.nn.functional.linear`` (same weights; not row-invariant), logging once
per type why. :class:`QuantEmbedding` is the embedding counterpart (token ids -> dequantized rows).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from eagle import kernels
from eagle.kernels.gguf_weights import GGUFWeight

logger = logging.getLogger(__name__)

NUMERICS = ("float32", "int8")
_logged_types: set[str] = set()


def kernel_handles(type_name: str) -> bool:
    """Whether the native kernels run weights of this GGUF type (and are available here)."""
    return kernels.available() and type_name in kernels.quant_types()


def _fallback_note(type_name: str) -> None:
    if kernels.unavailable_reason() is None and type_name not in _logged_types:
        _logged_types.add(type_name)
        logger.warning("The native kernels do not handle GGUF type %s: its tensors are dequantized to float32 and run "
                       "through PyTorch (handled: %s).", type_name, ", ".join(kernels.quant_types()))


class _PackedWeight(nn.Module):
    """A 2-D weight (N, K) as the kernels' packed bytes, or as its float32 dequantization (the fallback)."""

    def __init__(self, weight: GGUFWeight, numerics: str):
        super().__init__()
        if numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {numerics!r}")
        if len(weight.shape) != 2:
            raise ValueError(f"{weight.name!r}: expected a 2-D weight (out_features, in_features), got shape "
                             f"{weight.shape}")
        self.type_name, self.numerics = weight.type_name, numerics
        self.out_features, self.in_features = weight.shape
        self.packed: torch.Tensor | None = None
        self.dense: torch.Tensor | None = None
        if kernel_handles(weight.type_name):
            self.packed = kernels.ops().repack(weight.blocks.reshape(-1), weight.type_name, self.out_features,
                                               self.in_features, numerics)
        else:
            _fallback_note(weight.type_name)
            self.dense = weight.dequantize()

    @property
    def uses_kernels(self) -> bool:
        return self.packed is not None

    # What callers read of an nn.Linear / nn.Embedding weight (its size, dtype and device), without dequantizing.
    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def dim(self) -> int:
        return 2

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (N, K)."""
        if self.dense is not None:
            return self.dense
        return kernels.ops().dequantize(self.packed, self.type_name, self.out_features, self.in_features)

    def extra_repr(self) -> str:
        path = "kernels" if self.uses_kernels else "float32 fallback"
        return (f"in_features={self.in_features}, out_features={self.out_features}, type={self.type_name}, "
                f"numerics={self.numerics}, {path}")


@functools.cache
def _quant_linear_op():
    """``torch.ops.eagle.quant_linear.default``, looked up once (a layer calls it hundreds of times per token; the
    packet's overload resolution and :func:`eagle.kernels.ops` cost more than a small call's work)."""
    return kernels.ops().quant_linear.default


def _check_input(x: torch.Tensor, features: int, who: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.device.type != "cpu":
        got = f"{x.dtype} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"{who} expects a float32 CPU tensor, got {got}")
    if x.dim() == 0 or x.shape[-1] != features:
        raise ValueError(f"{who} expects inputs of shape (..., {features}), got {tuple(x.shape)}")


class QuantLinear(nn.Module):
    """``y = x @ w.T + bias`` over a GGUF weight (N, K): x (..., K) float32 CPU -> (..., N) float32.

    ``numerics``: ``"float32"`` (default) or ``"int8"`` (module docstring). ``bias``: (N,) float32 or None."""

    def __init__(self, weight: GGUFWeight, bias: torch.Tensor | None = None, numerics: str = "float32"):
        super().__init__()
        self.weight = _PackedWeight(weight, numerics)
        self.in_features, self.out_features = self.weight.in_features, self.weight.out_features
        self.numerics, self.type_name = numerics, weight.type_name
        if bias is not None:
            bias = torch.as_tensor(bias)
            if bias.shape != (self.out_features,):
                raise ValueError(f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}")
            bias = bias.detach().to(torch.float32).contiguous()
        self.register_buffer("bias", bias)

    @property
    def uses_kernels(self) -> bool:
        """Whether calls run the native kernels (False: the float32 fallback)."""
        return self.weight.uses_kernels

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight (N, K) this layer multiplies by."""
        return self.weight.dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (type(x) is torch.Tensor and x.dtype is torch.float32 and x.device.type == "cpu" and x.dim() > 0
                and x.shape[-1] == self.in_features):  # the common case checked cheaply (hundreds of calls a token)
            _check_input(x, self.in_features, "QuantLinear")  # says what is wrong (a tensor subclass passes)
        packed = self._modules["weight"].packed
        if packed is None:
            return F.linear(x, self.weight.dense, self.bias)
        rows = x if x.dim() == 2 and x.is_contiguous() else x.reshape(-1, self.in_features).contiguous()
        y = _quant_linear_op()(rows, packed, self.type_name, self.out_features, self.in_features,
                               self._buffers["bias"], self.numerics)
        return y if rows is x else y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"bias={self.bias is not None}"


class QuantEmbedding(nn.Module):
    """Token ids (...) int64 -> rows (..., K) float32 of a GGUF table (N, K), dequantized as gguf-py does.

    Built from the table's :class:`GGUFWeight`, or from a :class:`QuantLinear` over the same tensor (a tied LM
    head), whose packed bytes it then shares."""

    def __init__(self, table: GGUFWeight | QuantLinear):
        super().__init__()
        if isinstance(table, QuantLinear):
            self.weight = table.weight  # shared, not copied
        else:
            self.weight = _PackedWeight(table, "float32")
        self.num_embeddings, self.embedding_dim = self.weight.out_features, self.weight.in_features

    @property
    def uses_kernels(self) -> bool:
        return self.weight.uses_kernels

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"QuantEmbedding expects an int64 tensor of token ids, got "
                            f"{ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__}")
        ids = ids.long()
        if not self.uses_kernels:
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
                raise IndexError(f"token ids must be in [0, {self.num_embeddings}), got {int(ids.min())}.."
                                 f"{int(ids.max())}")
            return F.embedding(ids, self.weight.dense)
        return kernels.ops().quant_embedding(ids, self.weight.packed, self.weight.type_name, self.num_embeddings,
                                             self.embedding_dim)
