"""Where a base model path's GGUF file is: a ``.gguf`` file, or a directory holding exactly one (read by the loaders,
the GGUF backend and the trainer alike; it imports nothing of the engine)."""

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


def gguf_file_of(base_model_path) -> str | None:
    """The GGUF file ``base_model_path`` names (a ``.gguf`` file, or a directory holding one), else None."""
    if base_model_path is None:
        return None
    try:
        location, name = split_gguf_path(str(base_model_path))
    except (FileNotFoundError, ValueError):
        return None
    return None if name is None else os.path.join(location, name)
