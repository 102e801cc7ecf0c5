"""The linear backends by name: :data:`LINEAR_BACKENDS`, :func:`linear_backend`, :func:`switch_backend`.

This module imports the backends; they import only :mod:`eagle.model.backends.linear` (the interface and the
real-rows context), so the modules depend one way. The ``gguf`` backend is imported when it is first built: it
needs the ``gguf`` package and eagle's kernels, which the other backends do not.
"""

from __future__ import annotations

import torch

from eagle.model.backends.linear import BitsAndBytesLinear, LinearBackend, PlainLinear
from eagle.model.backends.onednn import OneDNNLinear


def _gguf_backend(**options) -> LinearBackend:
    from eagle.model.backends.gguf import GGUFLinear

    return GGUFLinear(**options)


#: name -> factory(**options) of a backend (see :mod:`eagle.model.backends.linear` for what each does). The docs'
#: lists of backends are checked against these keys (tests/test_docs_registries.py).
LINEAR_BACKENDS = {"none": PlainLinear, "onednn": OneDNNLinear, "gguf": _gguf_backend,
                   "bitsandbytes-8bit": lambda: BitsAndBytesLinear(8),
                   "bitsandbytes-4bit": lambda: BitsAndBytesLinear(4)}


def linear_backend(name: str, **options) -> LinearBackend:
    """The backend registered as ``name`` (see :data:`LINEAR_BACKENDS`), built with ``options``."""
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"Unknown linear backend {name!r}; available: {', '.join(sorted(LINEAR_BACKENDS))}.")
    return LINEAR_BACKENDS[name](**options)


def switch_backend(name: str, enabled: bool, *modules: torch.nn.Module | None) -> int:
    """Convert (``enabled``) or restore the linear layers of ``modules`` (None, e.g. a model's absent head, is
    skipped) with backend ``name``; how many changed."""
    backend = linear_backend(name)
    change = backend.convert if enabled else backend.restore
    return sum(change(module) for module in modules if module is not None)
