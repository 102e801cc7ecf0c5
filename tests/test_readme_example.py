"""README's first Python example runs as written (offline, on the embedded default pair)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from eagle import kernels
from eagle.model.tuning.head_tree import embedded_tree_settings

pytestmark = pytest.mark.e2e  # README's example on the embedded pair

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_first_python_example_runs(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks, "README.md has no ```python block"
    example = blocks[0]
    assert "from_pretrained()" in example  # the offline example comes first
    namespace: dict = {}
    exec(compile(example, "README.md (first Python example)", "exec"), namespace)
    model, output_ids, input_ids = namespace["model"], namespace["output_ids"], namespace["input_ids"]
    # the embedded head's own tree for the backend it runs on (the GGUF kernels where built), no argument given
    kind = "cpu-gguf-int8" if kernels.available() else "cpu"
    assert model.tree_settings.total_token == embedded_tree_settings(kind)["total_token"]
    assert 0 < output_ids.shape[1] - input_ids.shape[1] <= 32
    assert output_ids.tolist() == model.naivegenerate(input_ids, max_new_tokens=32).tolist()
    assert capsys.readouterr().out.strip()
