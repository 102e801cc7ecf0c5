"""eagle's native CPU kernels (the compiled extension ``eagle._kernels``, ops in ``torch.ops.eagle``).

Nothing is loaded at import: the extension loads on the first call that needs it. When it is missing (not built:
no compiler at install, not an x86-64 or other supported build) or fails to load, :func:`available` is False,
:func:`unavailable_reason` says why, a warning is logged once, and the modules built on it run their fallback:
:class:`eagle.kernels.linear.QuantLinear` and friends dequantize to float32 and use ``torch.nn.functional`` (the
same weights through PyTorch's own kernels), :mod:`eagle.kernels.attention` its float64 reference (the same math).

``EAGLE_KERNELS=0`` in the environment, or :func:`force_fallback`, makes the kernels unavailable on purpose (tests
of the fallback, comparisons). ``EAGLE_KERNELS_ISA=avx512|avx2|portable`` picks the instruction set every kernel
of the extension runs with, the linear kernels and the attention alike (read once, when the extension first needs
it; default: the best this CPU runs); :func:`use_isa` changes it while active. A name this CPU cannot run, or an
unknown one, leaves the kernels unavailable, :func:`unavailable_reason` naming the valid ones. :func:`isa` and
:func:`isa_reason` report the one in use and why, :func:`isas` those this CPU runs.

:func:`quant_types` lists the GGUF types the kernels handle, as the extension's one table of types has them.
:func:`read_bandwidth` measures the memory read bandwidth the linear kernels can at best stream weights at.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import threading
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict = {"loaded": False, "reason": None, "warned": set()}


class _ForcedOff(threading.local):
    value = False  # force_fallback() of this thread


_forced_off = _ForcedOff()
_OFF = ("0", "off", "false", "no")


def _load() -> str | None:
    """Loads the extension once; returns why it is unavailable, or None."""
    if _state["loaded"]:
        return _state["reason"]
    with _lock:
        if not _state["loaded"]:
            try:
                import torch  # first: the extension links against torch's libraries, which torch's import loads

                importlib.import_module("eagle._kernels")
                torch.ops.eagle.kernel_isas()  # the ops registered
            except Exception as err:  # noqa: BLE001 - any load failure means: run the fallback
                _state["reason"] = f"the compiled extension eagle._kernels could not be loaded ({err})"
            else:
                _state["reason"] = _isa_problem()
            _state["loaded"] = True
        return _state["reason"]


def _isa_problem() -> str | None:
    """Why the instruction set the environment asks for cannot be used (EAGLE_KERNELS_ISA), or None."""
    import torch

    try:
        torch.ops.eagle.kernel_isa()
    except RuntimeError as err:
        return f"the kernels' instruction set cannot be set: {str(err).splitlines()[0]}"
    return None


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used (None when they can)."""
    switch = os.environ.get("EAGLE_KERNELS")  # (read on every call: the attention asks once per layer)
    if switch is not None and switch.strip().lower() in _OFF:
        return "disabled by EAGLE_KERNELS=0"
    if _forced_off.value:
        return "disabled by eagle.kernels.force_fallback()"
    return _load()


def available() -> bool:
    """Whether the native kernels can run here (logs once per reason why not, and what runs instead)."""
    reason = unavailable_reason()
    if reason is not None and reason not in _state["warned"]:
        _state["warned"].add(reason)
        logger.warning("eagle's native CPU kernels are unavailable: %s. GGUF weights are dequantized to float32 and "
                       "run through PyTorch instead, and the position-ordered attention runs its float64 reference "
                       "(slower, and exact only up to float rounding between a token computed alone and inside a "
                       "batch).", reason)
    return reason is None


def ops():
    """``torch.ops.eagle`` (raises RuntimeError when the kernels are unavailable)."""
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"eagle's native CPU kernels are unavailable: {reason}")
    import torch

    return torch.ops.eagle


@contextmanager
def force_fallback(enabled: bool = True):
    """While active (in this thread), the kernels count as unavailable and modules built meanwhile use the float32
    fallback."""
    previous = _forced_off.value
    _forced_off.value = enabled
    try:
        yield
    finally:
        _forced_off.value = previous


def isa() -> str:
    """The instruction set the kernels run with: ``avx512``, ``avx2`` or ``portable``."""
    return str(ops().kernel_isa()[0])


def isa_reason() -> str:
    """Why :func:`isa` is the one in use, e.g. ``EAGLE_KERNELS_ISA=avx2`` or ``the best this CPU runs
    (EAGLE_KERNELS_ISA is not set)``."""
    return str(ops().kernel_isa()[1])


def isas() -> list[str]:
    """The instruction sets this CPU runs the kernels with, best first (e.g. ``['avx512', 'avx2', 'portable']``)."""
    return [str(name) for name in ops().kernel_isas()]


def best_isa() -> str:
    """The best instruction set this CPU runs the kernels with."""
    return isas()[0]


@contextmanager
def use_isa(name: str):
    """Run the kernels (linear and attention) with instruction set ``name`` (``avx512``, ``avx2``, ``portable``)
    while active; a CPU that lacks it, or an unknown name, raises RuntimeError. Process-wide (the kernels read one
    setting)."""
    previous = isa()
    ops().set_kernel_isa(name)
    try:
        yield
    finally:
        ops().set_kernel_isa(previous)


@functools.cache
def _quant_types() -> tuple[str, ...]:
    import torch

    return tuple(str(name) for name in torch.ops.eagle.quant_types()[0])


def quant_types() -> tuple[str, ...]:
    """The GGUF type names the kernels handle, e.g. ``('F32', 'F16', 'BF16', 'Q4_0', ...)``, as the extension's
    table of types lists them; empty when the kernels are unavailable."""
    return _quant_types() if unavailable_reason() is None else ()


READ_BANDWIDTH_BYTES = 512 * 2**20  # 16x the 32 MiB L3 of the CPUs the kernels were tuned on


def read_bandwidth(nbytes: int = READ_BANDWIDTH_BYTES, threads: int | None = None, passes: int = 5) -> float:
    """The machine's memory read bandwidth as the linear kernels see it, in GB/s (1e9 bytes per second).

    What it measures: a STREAM-style read of one buffer of ``nbytes`` (rounded down to 256 KiB; meant to be much
    larger than the last-level cache, so the bytes come from DRAM), allocated and written first by the same threads,
    then read whole ``passes`` times, every 64-bit word added into a sum; each pass splits the buffer in 256 KiB
    chunks that ``threads`` of torch's intra-op threads claim one at a time (the thread pool and work splitting the
    kernels use); the result is the fastest pass's bytes per second. A one-row ``quant_linear`` over a weight bigger
    than the cache cannot stream its weights faster than this. ``threads`` (default: ``torch.get_num_threads()``)
    sets torch's thread count for the measurement, restored afterwards. Raises RuntimeError when the kernels are
    unavailable."""
    import torch

    threads = torch.get_num_threads() if threads is None else threads
    if not (isinstance(nbytes, int) and nbytes >= 2**18):
        raise ValueError(f"nbytes must be an int of at least {2**18} (256 KiB), got {nbytes!r}")
    if not (isinstance(threads, int) and threads >= 1) or not (isinstance(passes, int) and passes >= 1):
        raise ValueError(f"threads and passes must be positive ints, got threads={threads!r}, passes={passes!r}")
    return float(ops().read_bandwidth(nbytes, threads, passes))
