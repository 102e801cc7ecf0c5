"""scripts/bench_families.py builds each family's model on the kernels, checks it takes the native decoder, and
times it against transformers' per-layer Python over the same kernels: it must keep running as the decoder and the
families change, and the two paths it compares must compute the same logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from eagle import kernels

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_families.py"


@pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here")
def test_bench_families_times_both_paths_of_a_dense_and_a_moe_family(tmp_path):
    out = tmp_path / "families.json"
    command = [sys.executable, str(SCRIPT), "--families", "qwen2,qwen2_moe", "--hidden", "256", "--layers", "2",
               "--vocab", "2048", "--context", "40", "--repeats", "2", "--threads", "1", "--json", str(out)]
    printed = subprocess.run(command, capture_output=True, text=True, check=True, timeout=600).stdout
    results = json.loads(out.read_text())["results"]
    assert list(results) == ["qwen2", "qwen2_moe"] and "qwen2_moe" in printed
    for result in results.values():
        assert result["max_logit_difference"] < 1e-3  # the native path computes what the old one computed
        for shape in ("1 row", "8-node tree"):
            assert result[shape]["native_ms"] > 0 and result[shape]["before_ms"] > 0


def test_an_unknown_family_is_named():
    done = subprocess.run([sys.executable, str(SCRIPT), "--families", "llama,gpt2"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2 and "unknown families gpt2" in done.stderr
