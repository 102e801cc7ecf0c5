"""Device helpers that work the same on CUDA, MPS, XPU and CPU.

Timing code must wait for queued device work before reading the clock; on a CPU there is nothing to wait
for. ``synchronize`` hides that difference so no module calls ``torch.cuda.synchronize`` directly.
"""

from __future__ import annotations

import torch



def _as_device(device) -> torch.device:
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.device):
        return device
    if isinstance(device, int):  # a bare ordinal means a CUDA device, as in torch
        return torch.device("cuda", device)
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"Not a device: {device!r} (expected e.g. 'cpu', 'cuda', 'cuda:1', 'mps', 'xpu').") from err


def synchronize(device=None) -> None:
    """Wait until all work queued on ``device`` has finished.

    ``torch.cuda.synchronize`` for a CUDA device, ``torch.mps.synchronize`` for MPS, ``torch.xpu.synchronize``
    for XPU; a no-op for the CPU (and for ``None``, which means the CPU). ``device`` may be a ``torch.device``,
    a string such as ``"cuda:0"`` or a CUDA ordinal.
    """
    device = _as_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "xpu":
        torch.xpu.synchronize(device)


def default_device() -> torch.device:
    """The best available accelerator: CUDA, then XPU, then MPS, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")
