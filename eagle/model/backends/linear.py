"""Linear backends: how the target's (and the head's) linear layers compute, behind one small interface.

A :class:`LinearBackend` prepares a model's linear layers once it is loaded (``convert``), can undo that
(``restore``), and may add ``from_pretrained`` options (``load_options``: bitsandbytes quantises at load time).
This module holds what every backend builds on and depends on nothing of theirs: the interface, the real-rows
context, :class:`PlainLinear` and :class:`BitsAndBytesLinear`. The backends this package ships are registered by
name in :data:`eagle.model.backends.registry.LINEAR_BACKENDS`:

- ``"onednn"``: float32 (and native bfloat16) CPU weights packed into oneDNN's blocked layout
  (:mod:`eagle.model.backends.onednn`), much cheaper for the handful of rows of a draft tree;
- ``"bitsandbytes-8bit"`` / ``"bitsandbytes-4bit"``: 8-bit / 4-bit quantisation at load time on CUDA
  (``load_options``);
- ``"gguf"``: a GGUF-loaded model computed over the file's quantized blocks by eagle's native kernels
  (:mod:`eagle.model.backends.gguf`; ``linear_backend("gguf", gguf_path=..., numerics=...)``);
- ``"none"``: the layers as transformers built them.

:func:`real_rows_only`: while the target runs a call whose token rows are partly padding (a batch's draft trees
padded to the largest, left-padded prompts), a layer given one input row per token may compute the real rows alone
(:func:`current_real_rows`). The ``onednn`` and ``gguf`` layers do; the layers of ``none`` (transformers'
``nn.Linear``) and of bitsandbytes compute every row.
"""
from __future__ import annotations

import contextvars
import importlib.util
import logging
from contextlib import contextmanager
from typing import Protocol

import torch

logger = logging.getLogger(__name__)

# real_rows_only skips padding rows when a call has at least this many: gathering the real rows and scattering their
# outputs costs each of a forward's linear layers a few fixed microseconds, about what 8 to 12 rows of SmolLM2-135M
# cost in all (timings: docs/PERFORMANCE.md).
MIN_PADDING_ROWS = 12


class RealRows:
    """Which token rows of a model call are real: ``shape`` (B, T) the call's token rows, ``index`` (R,) the flat
    indices (``b * T + t``) of the real ones, ascending. Remembers the last input it gathered: the layers that read
    the same input (query, key and value projections; gate and up projections) gather it once."""

    def __init__(self, shape: tuple[int, int], index: torch.Tensor):
        self.shape, self.index = shape, index
        # for each of the B * T rows, its place among the real rows, or R (a zero row appended) for a padding row
        self.source = torch.full((shape[0] * shape[1],), index.shape[0], dtype=torch.long, device=index.device)
        self.source[index] = torch.arange(index.shape[0], device=index.device)
        self._last: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (input, its version, its real rows)

    def matches(self, input: torch.Tensor) -> bool:  # noqa: A002
        """Whether ``input`` holds one row per token of the call, in order: (B, T, in) or (B * T, in)."""
        batch, length = self.shape
        return tuple(input.shape[:-1]) in ((batch, length), (batch * length,))

    def gather(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        """The real rows of ``input`` (R, in)."""
        last = self._last
        if last is not None and last[0] is input and last[1] == input._version:
            return last[2]
        rows = input.reshape(-1, input.shape[-1]).index_select(0, self.index.to(input.device))
        self._last = (input, input._version, rows)
        return rows

    def scatter(self, rows: torch.Tensor) -> torch.Tensor:
        """(R, out) outputs of the real rows -> (B * T, out), zeros for the padding rows."""
        # a CPU does this several times faster than index_put_ or index_copy_ into zeros
        return torch.cat([rows, rows.new_zeros(1, rows.shape[-1])]).index_select(0, self.source.to(rows.device))


# The real rows of the model call under way (set by :func:`real_rows_only`); a context variable, so that each thread
# (a server's requests) sees its own.
_REAL_ROWS: contextvars.ContextVar[RealRows | None] = contextvars.ContextVar("eagle_real_rows", default=None)


def current_real_rows() -> RealRows | None:
    """The real rows of the model call under way on this thread, or None (every row is real)."""
    return _REAL_ROWS.get()


@contextmanager
def real_rows_only(real: torch.Tensor | None):
    """While a model call runs over (B, T) token rows of which only some are real (``real`` (B, T) bool: a batch's
    draft trees padded to the largest, left-padded prompts), every linear layer of a backend that reads
    :func:`current_real_rows` and is given one input row per token, in order ((B, T, in) or (B * T, in)), may
    compute the real rows alone and return zeros for the others.

    On a CPU the linear layers cost in proportion to their rows, so this makes a padded forward cost what its real
    rows cost. It is exact for the real rows of a model in which no real token reads a padding token (the attention
    masks hide padding keys from real queries; everything else works row by row), and padding rows stay finite (zero
    vectors through the norms). Does nothing when ``real`` is None or has fewer than :data:`MIN_PADDING_ROWS`
    padding rows (gathering and scattering would cost more than the rows save)."""
    if real is None or real.numel() - int(real.sum()) < MIN_PADDING_ROWS:
        yield
        return
    token = _REAL_ROWS.set(RealRows(tuple(real.shape), real.reshape(-1).nonzero()[:, 0]))
    try:
        yield
    finally:
        _REAL_ROWS.reset(token)


class LinearBackend(Protocol):
    """How a model's linear layers compute (see the module docstring)."""

    name: str

    def load_options(self, base_model_path: str | None) -> dict:
        """Extra ``from_pretrained`` keyword arguments (raise ``ValueError`` where the backend cannot work)."""

    def convert(self, module: torch.nn.Module) -> int:
        """Prepare ``module``'s linear layers in place; returns how many changed."""

    def restore(self, module: torch.nn.Module) -> int:
        """Undo :meth:`convert`; returns how many changed."""


class PlainLinear:
    """The layers as transformers built them."""

    name = "none"

    def load_options(self, base_model_path=None) -> dict:
        return {}

    def convert(self, module) -> int:
        return 0

    def restore(self, module) -> int:
        return 0


class BitsAndBytesLinear(PlainLinear):
    """8-bit or 4-bit quantisation of the base model at load time (bitsandbytes, CUDA only)."""

    def __init__(self, bits: int, label: str | None = None):
        if bits not in (8, 4):
            raise ValueError(f"bitsandbytes quantises to 8 or 4 bits, not {bits}.")
        self.bits, self.name = bits, f"bitsandbytes-{bits}bit"
        self.label = label or f"{bits}-bit quantisation"  # what the errors call it (a command names its flag)

    def load_options(self, base_model_path=None) -> dict:
        what = self.label
        if not torch.cuda.is_available():
            raise ValueError(f"{what} needs a CUDA GPU (bitsandbytes quantisation); none is available. Load the "
                             "model unquantised or on a machine with a GPU.")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"{what} needs the bitsandbytes package: pip install bitsandbytes")
        if base_model_path and str(base_model_path).endswith(".gguf"):
            raise ValueError(f"{what} cannot quantise a GGUF base model; pass a transformers checkpoint.")
        from transformers import BitsAndBytesConfig

        config = BitsAndBytesConfig(load_in_8bit=self.bits == 8, load_in_4bit=self.bits == 4)
        return {"quantization_config": config, "device_map": "auto"}
