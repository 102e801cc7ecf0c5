"""The scale benchmark's conversion (eagle.evaluation.scale convert): the widened tiny pair becomes a GGUF with the
pinned llama.cpp's converter and quantizer, the f16 GGUF computes SmolLM2's greedy tokens on the GGUF kernels, the
Q4_K_M one loads and EAGLE on it equals its own plain decoding, and the head becomes llama.cpp's EAGLE-3 draft GGUF;
missing steps and tools are named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle.evaluation.scale.convert import conversion_problem, convert_pair, converted_files

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def test_converting_before_building_names_the_missing_step(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No widened pair is built in .* run `python -m "
                                                r"eagle.evaluation.scale build`"):
        convert_pair(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"model-Q4_K_M.gguf is missing: run `python -m "
                                                r"eagle.evaluation.scale convert`"):
        converted_files(tmp_path)


def test_a_missing_converter_module_is_named(monkeypatch):
    from eagle.evaluation.scale import convert

    if convert.find_converter() is None or convert.find_llama_tool("llama-quantize") is None:
        pytest.skip(f"llama.cpp's tools are not built: {conversion_problem()}")
    monkeypatch.setattr(convert, "CONVERTER_MODULES", ("no_such_module_for_the_converter",))
    assert conversion_problem() == ("convert_hf_to_gguf.py needs the Python module(s) "
                                    "no_such_module_for_the_converter: pip install -r requirements-scale.txt")


def greedy(model, ids, eagle: bool) -> list[int]:
    generate = model.eagenerate if eagle else model.naivegenerate
    return generate(ids, max_new_tokens=24)[0, ids.shape[1]:].tolist()


def load(base, head):
    from eagle.model.ea_model import EaModel

    return EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), use_eagle3=True,
                                   gguf_kernels="float32")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The embedded pair widened to `tiny` (~210M parameters) and converted, the f16 intermediate kept."""
    problem = conversion_problem()
    if problem:
        pytest.skip(problem)
    out = tmp_path_factory.mktemp("scale") / "tiny"
    command = [sys.executable, "-m", "eagle.evaluation.scale", "build", "--shape", "tiny", "--out", str(out),
               "--convert", "--keep-intermediate", "--skip-tune"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=1500)
    return out


@pytest.mark.e2e  # the embedded SmolLM2 pair and llama.cpp's tools
def test_convert_command_makes_gguf_files_that_compute_the_embedded_pair(converted):
    from eagle.defaults import default_base_model_path, default_ea_model_path
    from eagle.export import TargetGGUF

    out = converted
    assert {p.name for p in out.glob("*.gguf")} == {"model-f16.gguf", "model-Q4_K_M.gguf", "head-eagle3.gguf"}
    assert json.loads((out / "conversion.json").read_text())["quant"] == "Q4_K_M"
    assert TargetGGUF(str(out / "head-eagle3.gguf")).arch == "eagle3"  # llama.cpp's EAGLE-3 draft
    assert TargetGGUF(str(out / "model-Q4_K_M.gguf")).value("general.file_type") == 15  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    source = load(default_base_model_path(), default_ea_model_path())
    ids = source.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    expected = greedy(source, ids, eagle=False)
    del source
    wide = load(out / "model-f16.gguf", out / "head")
    assert greedy(wide, ids, eagle=False) == expected  # f16 rounding of SmolLM2's weights: the same tokens
    del wide
    quantized = load(out / "model-Q4_K_M.gguf", out / "head")  # requantized: its own function, EAGLE exact on it
    assert greedy(quantized, ids, eagle=True) == greedy(quantized, ids, eagle=False)


@pytest.mark.e2e
def test_bench_command_sets_ours_against_llama_cpp(converted, tmp_path):
    """`scale bench` on the converted tiny pair: every method, both cost curves (k = 1 is 1x), load times, the read
    bandwidth, in the JSON it writes and the table it prints."""
    from eagle.evaluation.scale.bench import KS, METHODS

    command = [sys.executable, "-m", "eagle.evaluation.scale", "bench", "--shape", "tiny", "--out", str(converted),
               "--num-questions", "1", "--max-new-tokens", "8", "--output-dir", str(tmp_path)]
    printed = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=1500).stdout
    result = json.loads((tmp_path / "scale-bench.json").read_text())
    assert set(result["methods"]) == set(METHODS)
    assert all(row["tokens_per_s"] > 0 and row["resident_bytes"] > 0 for row in result["methods"].values())
    assert result["methods"]["eagle"]["tau"] >= 1 and result["methods"]["llamacpp"]["vs_llamacpp_plain"] == 1
    for side in ("ours", "llamacpp"):
        assert result[side]["load_s"] > 0 and result[side]["plain_token_gb_per_s"] > 0
        assert list(result[side]["cost"]["multiple_of_k1"]) == [str(k) for k in KS]
        assert result[side]["cost"]["multiple_of_k1"]["1"] == 1
    assert result["read_bandwidth"]["gb_per_s"] > 0
    assert "forward over k tokens after 256" in printed and "llama.cpp + our EAGLE-3 head" in printed
