"""Pre-packed float32 (and bfloat16) linear layers for inference on a CPU.

On a CPU, ``F.linear`` hands each call to a general GEMM that works on the weights as stored. For one row (plain
decoding) that costs little more than weights packed ahead of time into oneDNN's blocked layout (the kernels torch's
own inductor uses for frozen CPU models), but for the handful of rows of a draft tree it costs nearly twice as much
(timings: docs/PERFORMANCE.md). Multi-token verification is what speculative decoding buys its speed with, so this
makes the difference between EAGLE losing and winning on a CPU.

:func:`pack_linear_layers` turns every plain ``nn.Linear`` of a module into a :class:`PackedLinear` in place: the
same parameters and ``state_dict`` (the original weight stays where it was), plus a packed copy used when no
gradient is needed and the input is a CPU tensor of the weight's dtype (with at most 64 rows on a CPU without
AVX-512, see :func:`packed_max_rows`). Float32 weights are always packable; bfloat16 weights on a CPU that computes in bfloat16 natively (AVX512-BF16 or
AMX, see :func:`native_bfloat16`), where the packed kernels read half the bytes of float32 ones. Anything else
(training, a long prefill on a CPU without AVX-512, another device or dtype) goes through ``F.linear``, and a weight replaced or changed in
place since packing is repacked before use. The one change a layer cannot notice is one made through
``weight.data`` (it has its own version counter): call :func:`pack_linear_layers` again after such a change. The
cost is memory: the packed copy doubles the linear layers' footprint.
"""

from __future__ import annotations

import copy
import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from eagle.model.backends.linear import PlainLinear, current_real_rows

logger = logging.getLogger(__name__)

# Rows the packed layout is tuned for (oneDNN's batch-size hint): a draft tree's verification. Any row count works.
PACKING_ROWS_HINT = 8
# The most rows a call may have to use the packed copy (more go through ``F.linear``); None: the CPU's rule,
# :func:`packed_max_rows`. Set it to force a limit.
PACKED_MAX_ROWS: int | None = None
# The limit on a CPU without AVX-512: there, past about 64 rows the packed kernel gained nothing and on one thread
# lost at 512 rows. With AVX-512 it wins at every row count measured, up to 3,200 (timings: docs/PERFORMANCE.md).
AVX2_PACKED_MAX_ROWS = 64
# The command-line choice (``--pack-cpu-weights``) -> ``EaModel.from_pretrained(pack_cpu_weights=...)``.
PACK_FLAG_VALUES = {"auto": "auto", "on": True, "off": False}
# ``pack="auto"`` packs models whose linear weights take at most this much memory (the packed copy doubles it).
AUTO_PACK_LIMIT_BYTES = 2 * 1024**3


def add_pack_cpu_weights_argument(parser) -> None:
    """``--pack-cpu-weights auto|on|off`` for a CLI; ``PACK_FLAG_VALUES[args.pack_cpu_weights]`` is the value for
    ``EaModel.from_pretrained(pack_cpu_weights=...)``."""
    parser.add_argument("--pack-cpu-weights", choices=list(PACK_FLAG_VALUES), default="auto",
                        help="pack float32 CPU linear weights for oneDNN: faster tree verification, a second copy "
                        "of those weights in memory (default: auto = float32 CPU models up to 2 GiB of linear weights)")


def packing_available() -> bool:
    """Whether this torch build can pack linear weights (oneDNN on a CPU build that registers the ops)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=None)
def native_bfloat16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX instructions): there bfloat16 matrix
    products run at full speed and read half the memory of float32 ones; elsewhere they are emulated, slowly."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    try:
        return packing_available() and any(check is not None and check() for check in checks)
    except RuntimeError:
        return False


@functools.lru_cache(maxsize=None)
def _cpu_row_limit() -> int | None:
    capability = torch.backends.cpu.get_cpu_capability()
    return None if capability.startswith("AVX512") or "AMX" in capability else AVX2_PACKED_MAX_ROWS


def packed_max_rows() -> int | None:
    """The most rows a call may have to use the packed copy; None: no limit. :data:`PACKED_MAX_ROWS` when set,
    else none on a CPU with AVX-512 (or AMX), where packed beats ``F.linear`` at every row count measured (a batch's
    draft trees, long prefills, one thread or two), and :data:`AVX2_PACKED_MAX_ROWS` elsewhere."""
    return _cpu_row_limit() if PACKED_MAX_ROWS is None else PACKED_MAX_ROWS


def _packable_dtype(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or (dtype == torch.bfloat16 and native_bfloat16())


def _packable(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dim() == 2 and _packable_dtype(weight.dtype)


class PackedLinear(nn.Linear):
    """An ``nn.Linear`` that keeps a oneDNN-packed copy of its weight for gradient-free CPU calls (float32, or
    bfloat16 where the CPU computes in it natively)."""

    def _pack(self) -> None:
        weight = self.weight.detach()
        self._packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACKING_ROWS_HINT)
        self._packed_from = (weight.data_ptr(), self.weight._version)

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's own argument name
        rows = current_real_rows()
        if rows is None or not rows.matches(input):
            return self._linear(input)
        # the real rows alone (see real_rows_only); the padding rows' outputs are zeros
        return rows.scatter(self._linear(rows.gather(input))).reshape(*input.shape[:-1], self.out_features)

    def _linear(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        if not self._packed_call(input):
            return F.linear(input, self.weight, self.bias)
        if self._packed_from != (self.weight.data_ptr(), self.weight._version):
            self._pack()  # the weight was replaced or changed in place since it was packed
        return torch.ops.mkldnn._linear_pointwise(input, self._packed, self.bias, "none", [], "")

    def _packed_call(self, input: torch.Tensor) -> bool:
        """Whether this call can use the packed copy: a few rows of CPU tensors of the packed dtype, and no gradient
        to record."""
        limit = packed_max_rows()
        if limit is not None and input.numel() > limit * self.in_features:
            return False
        tensors = (input, self.weight) if self.bias is None else (input, self.weight, self.bias)
        if any(t.device.type != "cpu" or t.dtype != self.weight.dtype for t in tensors):
            return False
        if not _packable_dtype(self.weight.dtype):
            return False
        return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))

    # The packed copy is an opaque oneDNN tensor that can be neither copied nor pickled: copies and unpickled layers
    # repack at their first call.
    def __deepcopy__(self, memo):
        clone = nn.Linear.__new__(PackedLinear)
        memo[id(self)] = clone
        state = {key: value for key, value in self.__dict__.items() if key not in ("_packed", "_packed_from")}
        clone.__dict__.update(copy.deepcopy(state, memo))
        clone._packed_from = None
        return clone

    def __getstate__(self):
        state = {key: value for key, value in self.__dict__.items() if key != "_packed"}
        state["_packed_from"] = None
        return state


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes held by the weights of the plain ``nn.Linear`` layers of ``module`` (tied weights counted once)."""
    seen, total = set(), 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear) and layer.weight.data_ptr() not in seen:
            seen.add(layer.weight.data_ptr())
            total += layer.weight.numel() * layer.weight.element_size()
    return total


def pack_linear_layers(module: nn.Module) -> int:
    """Turn every plain float32 (or natively supported bfloat16) CPU ``nn.Linear`` of ``module`` into a
    :class:`PackedLinear`, in place, and repack the layers that already are (the way to make them see a weight
    changed through ``weight.data``, which a packed layer cannot notice by itself).

    Returns how many layers were packed (0 where this torch build cannot pack). Undo with
    :func:`unpack_linear_layers`."""
    if not packing_available():
        logger.info("This torch build cannot pack linear weights (no oneDNN); linear layers left as they are.")
        return 0
    packed = 0
    for layer in module.modules():
        if type(layer) in (nn.Linear, PackedLinear) and _packable(layer.weight):
            layer.__class__ = PackedLinear
            try:
                layer._pack()
            except RuntimeError as err:  # an unsupported shape or build: leave this layer alone
                _unpack(layer)
                logger.info("Could not pack a %s linear layer (%s); it stays unpacked.", tuple(layer.weight.shape), err)
                continue
            packed += 1
    return packed


def unpack_linear_layers(module: nn.Module) -> int:
    """Turn the :class:`PackedLinear` layers of ``module`` back into plain ``nn.Linear``, freeing the packed copies.
    Returns how many were unpacked."""
    count = 0
    for layer in module.modules():
        if type(layer) is PackedLinear:
            _unpack(layer)
            count += 1
    return count


def _unpack(layer: PackedLinear) -> None:
    layer.__dict__.pop("_packed", None)  # a copy that never ran has none
    layer.__dict__.pop("_packed_from", None)
    layer.__class__ = nn.Linear


class OneDNNLinear(PlainLinear):
    """This module's packing as a :class:`~eagle.model.backends.linear.LinearBackend`: :func:`pack_linear_layers`
    and :func:`unpack_linear_layers`."""

    name = "onednn"

    def convert(self, module) -> int:
        return pack_linear_layers(module)

    def restore(self, module) -> int:
        return unpack_linear_layers(module)


def packed_layer_count(module: nn.Module) -> int:
    """How many :class:`PackedLinear` layers ``module`` holds."""
    return sum(type(layer) is PackedLinear for layer in module.modules())


def should_auto_pack(model: nn.Module) -> bool:
    """The ``"auto"`` rule: float32 weights on a CPU, a build that can pack, and linear weights of at most
    :data:`AUTO_PACK_LIMIT_BYTES` (the packed copy doubles their memory)."""
    weight = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    if weight is None or weight.dtype != torch.float32 or not _packable(weight) or not packing_available():
        return False
    size = linear_weight_bytes(model)
    if size > AUTO_PACK_LIMIT_BYTES:
        logger.info("Linear weights take %.1f GiB: not packing them for the CPU automatically (it would double that "
                    "memory); pass pack_cpu_weights=True to pack anyway.", size / 1024**3)
        return False
    return True
