"""Shared fixtures: tiny models built locally (see tests/tiny_models.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import make_head, make_target, make_tiny_pair, make_tokenizer  # noqa: E402,F401


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "e2e: runs the whole system (the embedded SmolLM2 pair, servers in subprocesses, a browser, "
        "training launchers, llama.cpp) or thousands of sampled generations; `-m \"not e2e\"` leaves them out "
        "(docs/TESTING.md)")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tokenizer")
    make_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(base_dir, head_dir) of a tiny Llama target with a random full-vocabulary EAGLE-3 head."""
    return make_tiny_pair(tmp_path_factory.mktemp("pair"), "llama", eagle3=True)


@pytest.fixture(scope="module")
def tiny_model(tiny_pair):
    """An ``EaModel`` on :func:`tiny_pair` with a 12-token tree (depth 3, top-k 4), loaded once per test module."""
    import torch

    from eagle.model.ea_model import EaModel

    base_dir, head_dir = tiny_pair
    torch.manual_seed(0)
    return EaModel.from_pretrained(base_model_path=str(base_dir), ea_model_path=str(head_dir), total_token=12,
                                   depth=3, top_k=4)


@pytest.fixture(scope="module")
def kernels_float32_model():
    """The embedded pair on the GGUF kernels in float32 activations, loaded once per test module: their logits equal
    a plain transformers forward's to float rounding (in int8 activations, the default, a rounding difference can
    move a block's quantization step)."""
    from eagle.cli import ModelOptions, load_model

    return load_model(ModelOptions(gguf_kernels="float32"))
