"""Resident memory of what each benchmark method computes with: the bytes of a model's weights as it holds them
(float32 parameters, oneDNN-packed copies, the GGUF kernels' packed blocks), and the resident set of a process
(llama.cpp's llama-server)."""

from __future__ import annotations

import torch


def _tensors(module: torch.nn.Module):
    from eagle.kernels.linear import _PackedWeight

    for tensor in list(module.parameters()) + list(module.buffers()):
        yield tensor
    for layer in module.modules():
        packed = getattr(layer, "_packed", None)  # oneDNN's packed copy (eagle.model.backends.onednn)
        if isinstance(packed, torch.Tensor):
            yield packed
        if isinstance(layer, _PackedWeight):
            for tensor in (layer.packed, layer.dense):
                if tensor is not None:
                    yield tensor


def weight_bytes(*modules: torch.nn.Module | None) -> int:
    """Bytes of the weights ``modules`` hold (each storage counted once, shared ones too; None, e.g. a model's
    absent head, holds none)."""
    seen, total = set(), 0
    for module in modules:
        if module is None:
            continue
        for tensor in _tensors(module):
            if tensor.device.type == "meta":
                continue
            try:
                storage = tensor.untyped_storage()
                key, nbytes = (storage.data_ptr(), storage.nbytes()), storage.nbytes()
            except NotImplementedError:  # an opaque tensor (oneDNN's packed layout): its logical size
                key, nbytes = ("opaque", id(tensor)), tensor.numel() * tensor.element_size()
            if key not in seen:
                seen.add(key)
                total += nbytes
    return total


def process_rss_bytes(pid: int | None = None) -> int | None:
    """Resident set size of process ``pid`` (this one by default), from /proc; None where it cannot be read."""
    try:
        with open(f"/proc/{pid or 'self'}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
