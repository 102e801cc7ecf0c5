"""Finding and reading checkpoint files: draft-head configs and weights, from a local directory or the Hub."""

from __future__ import annotations

import json
import logging
import os

import torch

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def resolve_file(path_or_repo: str, filename: str, required: bool = True) -> str | None:
    """Local ``<dir>/<filename>`` if it exists, else download ``filename`` from the Hub repo ``path_or_repo``."""
    if os.path.isdir(path_or_repo):
        candidate = os.path.join(path_or_repo, filename)
        if os.path.isfile(candidate):
            return candidate
        if required:
            raise FileNotFoundError(f"{candidate} does not exist (expected in the draft-head directory {path_or_repo}).")
        return None
    if os.path.isfile(path_or_repo) and os.path.basename(path_or_repo) == filename:
        return path_or_repo
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return hf_hub_download(path_or_repo, filename)
    except (EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        if not required:
            return None
        raise FileNotFoundError(
            f"Could not find {filename!r} for {path_or_repo!r}: it is not a local directory and the Hub download "
            f"failed ({type(err).__name__}: {err})."
        ) from err


def load_state_dict_file(path: str) -> dict[str, torch.Tensor]:
    """Load a ``.safetensors`` or ``.bin`` file (``torch.load(weights_only=True)``) on the CPU, with a clear
    error for a corrupt or truncated file."""
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path, device="cpu")
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # any reader failure means the file is unusable; say which file and why
        raise ValueError(f"Could not read the weights file {path}: {type(err).__name__}: {err}. Is it complete?") from err
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path} does not hold a flat state dict of tensors.")
    return state


def load_head_state_dict(path_or_repo: str) -> dict[str, torch.Tensor]:
    """The draft head's weights: ``model.safetensors`` preferred, else ``pytorch_model.bin``."""
    for name in WEIGHT_FILES:
        found = resolve_file(path_or_repo, name, required=False)
        if found is not None:
            return load_state_dict_file(found)
    raise FileNotFoundError(
        f"No draft-head weights found for {path_or_repo!r}: expected one of {', '.join(WEIGHT_FILES)}."
    )


def read_tensor_from_model(path_or_repo: str, name: str) -> torch.Tensor | None:
    """One tensor of a (possibly sharded) model checkpoint, or None if the checkpoint has no such tensor."""
    for index_name, single_name in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        index = resolve_file(path_or_repo, index_name, required=False)
        if index is not None:
            with open(index) as f:
                shard = json.load(f)["weight_map"].get(name)
            if shard is None:
                continue
            file = resolve_file(path_or_repo, shard)
        else:
            file = resolve_file(path_or_repo, single_name, required=False)
            if file is None:
                continue
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as reader:
                if name in reader.keys():
                    return reader.get_tensor(name)
            continue
        state = load_state_dict_file(file)
        if name in state:
            return state[name]
    return None
