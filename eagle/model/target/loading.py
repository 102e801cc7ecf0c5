"""Loading the base (target) model and its tokenizer: a model directory, a Hub id, or a GGUF file."""

from __future__ import annotations

import os


def split_gguf_path(path: str) -> tuple[str, str | None]:
    """``(directory or repo id, gguf file name or None)`` for ``from_pretrained``.

    A ``.gguf`` file, or a directory that holds exactly one ``.gguf`` and no ``config.json``, is read through
    transformers' GGUF support (``from_pretrained(directory, gguf_file=name)``); anything else is passed on as a
    model directory or Hub id."""
    if path.endswith(".gguf") and not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path} does not exist.")
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path} is a file but not a .gguf file; pass a model directory, a Hub id or a .gguf file.")
        return os.path.dirname(os.path.abspath(path)), os.path.basename(path)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return path, ggufs[0]
        if len(ggufs) > 1:
            raise ValueError(f"{path} holds several .gguf files ({', '.join(ggufs)}); pass the path of the one to use.")
        raise FileNotFoundError(f"{path} has neither a config.json nor a .gguf file: it is not a model directory.")
    return path, None


def load_base_model(base_model_path: str, **kwargs):
    """``AutoModelForCausalLM`` + tokenizer from a directory, a Hub id, or a GGUF file (dequantised by transformers).

    The attention implementation defaults to SDPA (it honours tree masks); ``torch_dtype`` is accepted as an alias
    of ``dtype``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if "torch_dtype" in kwargs:
        kwargs.setdefault("dtype", kwargs.pop("torch_dtype"))
    kwargs.setdefault("attn_implementation", "sdpa")
    if kwargs["attn_implementation"] not in ("sdpa", "eager"):
        raise ValueError(
            f"attn_implementation={kwargs['attn_implementation']!r} cannot apply EAGLE's tree attention mask; "
            "use 'sdpa' (default) or 'eager'."
        )
    location, gguf_file = split_gguf_path(base_model_path)
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    trust = kwargs.get("trust_remote_code", False)
    model = AutoModelForCausalLM.from_pretrained(location, **extra, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=trust, **extra)
    model.eval()
    return model, tokenizer
