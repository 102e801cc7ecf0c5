"""The docs' lists of linear backends, drafters and GGUF quantization types are the registries' lists.

A list in the docs is a marker followed by backticked names separated by commas, e.g.
``LINEAR_BACKENDS``: ``none``, ``onednn`` or GGUF types: ``Q4_0``, ``Q8_0``; every such list in every Markdown
file is checked, and the documents that must carry one are named below.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from test_docs import markdown_files  # noqa: E402  (tests/ is on sys.path, see conftest.py)

ROOT = Path(__file__).resolve().parents[1]
NAMES = r"`[^`\n]+`(?:,\s+`[^`\n]+`)*"


def linear_backends() -> set[str]:
    from eagle.model.backends.registry import LINEAR_BACKENDS

    return set(LINEAR_BACKENDS)


def drafters() -> set[str]:
    from eagle.model.drafting.registry import DRAFTERS

    return set(DRAFTERS)


def combinators() -> set[str]:
    from eagle.model.drafting.registry import COMBINATORS

    return set(COMBINATORS)


def kernel_quant_types() -> set[str]:
    """The GGUF types the kernels handle: ``eagle.kernels.quant_types()`` (the extension's own table) where it
    exists, else the table the Python side decides with (``eagle.kernels.reference.BLOCKS``)."""
    from eagle import kernels

    quant_types = getattr(kernels, "quant_types", None)
    if quant_types is None:
        from eagle.kernels.reference import BLOCKS

        return set(BLOCKS)
    if not kernels.available():
        pytest.skip(f"the kernels are unavailable: {kernels.unavailable_reason()}")
    return {getattr(name, "name", name) for name in quant_types()}


# marker -> (what the names must be, the documents that must list them)
LISTS = {
    "`LINEAR_BACKENDS`:": (linear_backends, ("README.md", "docs/ARCHITECTURE.md")),
    "`DRAFTERS`:": (drafters, ("README.md", "docs/ARCHITECTURE.md")),
    "`COMBINATORS`:": (combinators, ("README.md", "docs/ARCHITECTURE.md")),
    "GGUF types:": (kernel_quant_types, ("README.md", "docs/ARCHITECTURE.md", "docs/USAGE.md")),
}


def listed(text: str, marker: str) -> list[list[str]]:
    """Every list ``marker`` introduces in ``text``: the backticked names after it (the list may wrap lines)."""
    return [re.findall(r"`([^`]+)`", match) for match in re.findall(re.escape(marker) + r"\s+(" + NAMES + ")", text)]


def test_the_list_reader_reads_what_the_docs_write():
    text = ("linear backends (`LINEAR_BACKENDS`: `none`, `onednn`,\n  `gguf`); added to `LINEAR_BACKENDS` in `x.py`\n"
            "blocks (GGUF types: `Q4_0`, `Q8_0`; float32)")
    assert listed(text, "`LINEAR_BACKENDS`:") == [["none", "onednn", "gguf"]]
    assert listed(text, "GGUF types:") == [["Q4_0", "Q8_0"]]
    assert listed(text, "`DRAFTERS`:") == []


@pytest.mark.parametrize("marker", list(LISTS))
def test_every_list_in_the_docs_is_the_registry(marker):
    expected, required = LISTS[marker]
    names = expected()
    wrong, found_in = [], set()
    for path in markdown_files():
        relative = path.relative_to(ROOT).as_posix()
        for items in listed(path.read_text(encoding="utf-8"), marker):
            found_in.add(relative)
            if len(items) != len(set(items)) or set(items) != names:
                wrong.append(f"{relative}: {', '.join(items)}")
    assert not wrong, f"{marker} lists that are not {', '.join(sorted(names))}:\n" + "\n".join(wrong)
    missing = [doc for doc in required if doc not in found_in]
    assert not missing, f"no {marker} list in {', '.join(missing)}"
