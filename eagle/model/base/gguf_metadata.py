"""One parse of a GGUF file's metadata per load.

transformers reads a GGUF file's metadata (the config and the whole tokenizer: every token and merge) with
``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint(path, return_tensors=False)``, once for the config
and once more for the tokenizer. Its reader builds a NumPy view per string, so for a 50k-token vocabulary each parse
costs seconds, whatever the model's size. Inside :func:`metadata_parsed_once`, the second and later metadata-only
calls for the same file return a copy of the first call's result instead of parsing again.

The touch of transformers: the module attribute ``load_gguf_checkpoint`` (which its config and tokenizer loaders
import at call time) is wrapped once, the first time :func:`metadata_parsed_once` is entered. Outside that context,
and for any call that reads tensors, the wrapper calls the original with the same arguments. What is remembered lives
in a context variable, so each thread (and each load) has its own; nothing outlives the ``with`` block.

The one parse itself is faster: gguf-py's ``GGUFReader`` slices its ``numpy.memmap`` once per value (hundreds of
thousands of times for a vocabulary), and each slice of a memmap runs NumPy's Python-level memmap hooks. During that
parse, ``gguf.GGUFReader`` (which transformers imports at call time) is a subclass that slices a plain ``ndarray``
view of the same mapping instead (:func:`plain_view_reader`): the same bytes, the same fields, a few times faster.
The attribute is restored after the call, under a lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import os
import threading

import numpy as np

_PARSED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("eagle_gguf_metadata", default=None)
_INSTALL_LOCK = threading.Lock()
_READER_LOCK = threading.Lock()
#: transformers' own ``load_gguf_checkpoint``, once wrapped
ORIGINAL: list = []


def _wrap(original):
    @functools.wraps(original)
    def load_gguf_checkpoint(gguf_checkpoint_path, return_tensors=False, model_to_load=None, torch_dtype=None):
        parsed = _PARSED.get()
        if parsed is None or return_tensors or model_to_load is not None or torch_dtype is not None:
            return original(gguf_checkpoint_path, return_tensors, model_to_load, torch_dtype)
        key = os.path.realpath(gguf_checkpoint_path)
        if key not in parsed:
            with _plain_view_reader_installed():
                parsed[key] = original(gguf_checkpoint_path, return_tensors=False)
        return copy.deepcopy(parsed[key])  # the callers may change what they get

    return load_gguf_checkpoint


@functools.lru_cache(maxsize=4)
def plain_view_reader(base: type) -> type:
    """A subclass of gguf-py's reader class ``base`` whose every read of the file (``_get``) slices a plain
    ``ndarray`` view of its memory map: what ``base`` reads, without a ``numpy.memmap`` per value."""

    class PlainViewReader(base):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain_data")
            if plain is None:
                plain = self._plain_data = self.data.view(np.ndarray)
            dtype, count = np.dtype(dtype), int(count)
            values = plain[offset:offset + dtype.itemsize * count].view(dtype=dtype)[:count]
            return values.view(values.dtype.newbyteorder(self.byte_order if override_order is None
                                                         else override_order))

    PlainViewReader.__qualname__ = PlainViewReader.__name__ = f"PlainView{base.__name__}"
    return PlainViewReader


@contextlib.contextmanager
def _plain_view_reader_installed():
    import gguf

    with _READER_LOCK:
        current = gguf.GGUFReader
        gguf.GGUFReader = plain_view_reader(current)
        try:
            yield
        finally:
            gguf.GGUFReader = current


def _install() -> None:
    from transformers import modeling_gguf_pytorch_utils as utils

    with _INSTALL_LOCK:
        if not ORIGINAL:
            ORIGINAL.append(utils.load_gguf_checkpoint)
            utils.load_gguf_checkpoint = _wrap(ORIGINAL[0])


@contextlib.contextmanager
def metadata_parsed_once():
    """Within the block, transformers parses each GGUF file's metadata once (see the module)."""
    _install()
    token = _PARSED.set({})
    try:
        yield
    finally:
        _PARSED.reset(token)
