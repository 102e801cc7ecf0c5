"""eagle's native CPU kernels (the compiled extension ``eagle._kernels``, ops in ``torch.ops.eagle``).

Nothing is loaded at import: the extension loads on the first call that needs it. When it is missing (not built:
no compiler at install, not an x86-64 or other supported build) or fails to load, :func:`available` is False,
:func:`unavailable_reason` says why, a warning is logged once, and the modules built on it
(:class:`eagle.kernels.linear.QuantLinear`, ...) run their float32 fallback (dequantized weights and
``torch.nn.functional``), which computes the same weights with PyTorch's own kernels.

``EAGLE_KERNELS=0`` in the environment, or :func:`force_fallback`, makes the kernels unavailable on purpose (tests
of the fallback, comparisons). ``EAGLE_KERNELS_ISA=avx512|avx2|portable`` (or :func:`use_isa`) picks the
instruction set the kernels run with (default: the best this CPU has).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from contextlib import contextmanager

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_state: dict = {"loaded": False, "reason": None, "warned": set()}
_forced_off = threading.local()  # force_fallback() of this thread


def _load() -> str | None:
    """Loads the extension once; returns why it is unavailable, or None."""
    with _lock:
        if not _state["loaded"]:
            _state["loaded"] = True
            try:
                import torch  # first: the extension links against torch's libraries, which torch's import loads

                importlib.import_module("eagle._kernels")
                torch.ops.eagle.kernel_isa()  # the ops registered
            except Exception as err:  # noqa: BLE001 - any load failure means: run the fallback
                _state["reason"] = f"the compiled extension eagle._kernels could not be loaded ({err})"
        return _state["reason"]


def unavailable_reason() -> str | None:
    """Why the kernels cannot be used (None when they can)."""
    if os.environ.get("EAGLE_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return "disabled by EAGLE_KERNELS=0"
    if getattr(_forced_off, "value", False):
        return "disabled by eagle.kernels.force_fallback()"
    return _load()


def available() -> bool:
    """Whether the native kernels can run here (logs once per reason why not, and what runs instead)."""
    reason = unavailable_reason()
    if reason is not None and reason not in _state["warned"]:
        _state["warned"].add(reason)
        logger.warning("eagle's native CPU kernels are unavailable: %s. GGUF weights are dequantized to float32 and "
                       "run through PyTorch instead (slower, and exact only up to float rounding between a token "
                       "computed alone and inside a batch).", reason)
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
    previous = getattr(_forced_off, "value", False)
    _forced_off.value = enabled
    try:
        yield
    finally:
        _forced_off.value = previous


def isa() -> str:
    """The instruction set the kernels run with: ``avx512``, ``avx2`` or ``portable``."""
    return str(ops().kernel_isa())


def best_isa() -> str:
    """The best instruction set this CPU runs the kernels with."""
    return str(ops().best_kernel_isa())


@contextmanager
def use_isa(name: str):
    """Run the kernels with instruction set ``name`` (``avx512``, ``avx2``, ``portable``) while active; a CPU
    that lacks it raises RuntimeError. Process-wide (the kernels read one setting)."""
    previous = isa()
    ops().set_kernel_isa(name)
    try:
        yield
    finally:
        ops().set_kernel_isa(previous)
