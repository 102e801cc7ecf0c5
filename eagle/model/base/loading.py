"""Loading the base (target) model and its tokenizer: a model directory, a Hub id, or a GGUF file."""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from eagle.kernels.gguf_check import check_gguf_file
from eagle.model.base.gguf_metadata import metadata_parsed_once
from eagle.utils.gguf_paths import gguf_file_of, split_gguf_path
from eagle.model.backends.attention import SUPPORTED_ATTENTION

logger = logging.getLogger(__name__)


def _check_attention_argument(kwargs: dict) -> None:
    """``torch_dtype`` renamed ``dtype`` in ``kwargs``; a ValueError for an attention that ignores tree masks."""
    if "torch_dtype" in kwargs:
        kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
    asked = kwargs.get("attn_implementation")
    if asked is not None and asked not in SUPPORTED_ATTENTION:
        raise ValueError(f"attn_implementation={asked!r} cannot apply EAGLE's tree attention mask; use 'sdpa' "
                         "(the default where transformers supports it for the model) or 'eager'.")


def load_base_model(base_model_path: str, **kwargs):
    """``AutoModelForCausalLM`` + tokenizer from a directory, a Hub id, or a GGUF file (dequantised by transformers).

    The attention implementation defaults to what transformers picks when none is asked for: SDPA where it supports
    the model's class, else eager (GPT-OSS, whose attention sinks its SDPA path does not take); both honour tree
    masks. ``attn_implementation`` may ask for either; anything else (a flash kernel ignores 4-D masks) is
    refused. ``torch_dtype`` is accepted as an alias of ``dtype``. Remote code runs only when the caller passes
    ``trust_remote_code``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _check_attention_argument(kwargs)
    location, gguf_file = split_gguf_path(base_model_path)
    if gguf_file:
        checked_gguf_file(os.path.join(location, gguf_file))
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    trust = kwargs.get("trust_remote_code", False)
    try:
        model = AutoModelForCausalLM.from_pretrained(location, **extra, **kwargs)
    except ImportError as err:
        if not trust:
            raise
        raise ImportError(
            f"The model's own code (trust_remote_code) at {base_model_path} could not be imported: {err}. Code "
            "written for transformers 4 often imports modules transformers 5 removed (transformers."
            "modeling_attn_mask_utils...): use a revision of the model written for transformers 5, or its family's "
            "transformers class if there is one; install the package it names if it is another one."
        ) from err
    chosen = getattr(model.config, "_attn_implementation", None)
    if chosen not in SUPPORTED_ATTENTION:  # e.g. a config.json that names a flash kernel
        raise ValueError(f"{base_model_path} loaded with attn_implementation={chosen!r}, which ignores EAGLE's tree "
                         "attention mask; pass attn_implementation='sdpa' or 'eager'.")
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust, **extra)
    model.eval()
    return model, tokenizer


def checked_gguf_file(path: str) -> str:
    """``path`` after :func:`~eagle.kernels.gguf_check.check_gguf_file` found it well formed: a malformed file is
    named here, before transformers' or the kernels' readers see it. A file checked once (same size and time of
    change) is not scanned again by the later steps of the same load."""
    stat = os.stat(path)
    _check_once(os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
    return path


@functools.lru_cache(maxsize=8)
def _check_once(path: str, size: int, mtime_ns: int) -> None:
    check_gguf_file(path)


# The keyword arguments a GGUF load straight into the kernels honours (anything else goes through transformers).
DIRECT_LOAD_ARGUMENTS = ("attn_implementation", "dtype", "torch_dtype", "trust_remote_code")


def direct_gguf_load_possible(base_model_path: str, kwargs: dict) -> bool:
    """Whether :func:`load_gguf_direct` can load ``base_model_path`` with ``kwargs``: a GGUF file on the CPU in
    float32 (no ``device_map``, no other dtype) whose architecture transformers loads tensor by tensor."""
    from eagle.model.backends.gguf import gguf_architecture, loads_tensor_by_tensor

    path = gguf_file_of(base_model_path)
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
    if path is None or any(key not in DIRECT_LOAD_ARGUMENTS for key in kwargs):
        return False
    checked_gguf_file(path)
    if dtype not in (None, "auto", torch.float32, "float32"):
        return False
    return loads_tensor_by_tensor(gguf_architecture(path))


def load_gguf_direct(base_model_path: str, numerics: str = "float32", **kwargs):
    """``(model, tokenizer)`` for a GGUF file with the model's linear layers, embedding and tied LM head on eagle's
    kernels, built without a float32 model: the config and tokenizer from the file's metadata through transformers,
    the model's modules on the meta device, then filled from the file one tensor at a time
    (:func:`eagle.model.backends.gguf.fill_from_gguf`). The result equals :func:`load_base_model` followed by
    :func:`eagle.model.backends.gguf.convert_gguf_model` (the same modules, blocks and float norms), at about the
    file's size in memory. ``kwargs``: those of :data:`DIRECT_LOAD_ARGUMENTS`."""
    from transformers import AutoConfig, AutoTokenizer

    from eagle.model.backends.gguf import release_freed_memory

    started = time.perf_counter()
    _check_attention_argument(kwargs)
    kwargs.pop("dtype", None)
    location, gguf_file = split_gguf_path(base_model_path)
    if gguf_file is None:
        raise ValueError(f"{base_model_path} is not a .gguf file (nor a directory holding one): only a GGUF file "
                         "loads straight into the kernels; load it with load_base_model.")
    trust = kwargs.get("trust_remote_code", False)
    with metadata_parsed_once():
        config = AutoConfig.from_pretrained(location, gguf_file=gguf_file, trust_remote_code=trust)
        config.name_or_path = location
        # The tokenizer first: the metadata it parses is freed before the blocks are packed, so peaks do not add up.
        tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust, gguf_file=gguf_file)
    release_freed_memory()
    model, count = build_gguf_model(os.path.join(location, gguf_file), config, numerics, **kwargs)
    logger.info("Loaded %s straight into the kernels in %.1f s: %d modules on the kernels (%s activations)",
                base_model_path, time.perf_counter() - started, count, numerics)
    return model, tokenizer


def build_gguf_model(gguf_path: str, config, numerics: str = "float32", **kwargs):
    """``(model, count)``: the model ``config`` describes, built on the meta device and filled from the GGUF file
    at ``gguf_path`` (:func:`eagle.model.backends.gguf.fill_from_gguf`, ``count`` modules on the kernels), in eval
    mode. ``kwargs``: ``AutoModelForCausalLM.from_config``'s (the attention implementation, remote code)."""
    from transformers import AutoModelForCausalLM

    from eagle.model.backends.gguf import fill_from_gguf

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, **kwargs)
    count = fill_from_gguf(model, checked_gguf_file(gguf_path), numerics)
    return model.eval(), count
