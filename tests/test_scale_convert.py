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

from eagle.evaluation.scale.convert import conversion_problem, convert_pair, converted_files, find_llama_tool

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


@pytest.fixture(scope="module")
def tiny_source(tmp_path_factory):
    """A tiny random Llama (hidden 64, 2 layers) with SmolLM2's tokenizer and vocabulary, and an EAGLE-3 head."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle.defaults import default_base_model_path
    from tiny_models import make_head, target_config

    problem = conversion_problem()
    if problem:
        pytest.skip(problem)
    root, gguf_path = tmp_path_factory.mktemp("source"), default_base_model_path()
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))
    torch.manual_seed(0)
    config = target_config("llama", layers=2, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           tie_word_embeddings=True, initializer_range=0.2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(root / "base")
    tokenizer.save_pretrained(root / "base")
    make_head(root / "head", model, draft_vocab_size=512)
    return root, model


@pytest.mark.e2e  # the embedded tokenizer and llama.cpp's tools
@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe"])
def test_a_widened_family_converts_and_loads_natively(tiny_source, tmp_path, family):
    """A tiny Qwen2 / Qwen2-MoE widening converts with the pinned llama.cpp (SmolLM2's pre-tokenizer kept), loads
    from its GGUF on the native decoder, and the f16 file decodes the source's greedy tokens (its matrices rounded
    to f16 as the file's are); EAGLE on the Q8_0 file equals its own plain decoding."""
    from transformers import AutoModelForCausalLM

    from eagle.evaluation.scale.build import build_pair
    from eagle.evaluation.scale.widen import Shape
    from eagle.export import TargetGGUF
    from eagle.model.ea_model import EaModel

    root, source = tiny_source
    moe = dict(experts=4, experts_per_token=2, expert_size=1408) if family == "qwen2_moe" else {}
    shape = Shape("tiny", 128, 8, 2, 5632 if moe else 256, 2, head_dim=16, **moe)  # transformers' MoE GGUF widths
    out = tmp_path / family
    build_pair(shape, out, str(root / "base"), str(root / "head"), dtype=torch.float32, family=family)
    convert_pair(out, "f16", "Q8_0", keep_intermediate=True)
    assert TargetGGUF(str(out / "model-f16.gguf")).value("tokenizer.ggml.pre") == "smollm"
    llama_bench = find_llama_tool("llama-batched-bench")
    if llama_bench is not None:  # llama.cpp loads and runs it (its qwen2moe needs an output matrix of its own)
        command = [str(llama_bench), "-m", str(out / "model-Q8_0.gguf"), "-c", "256", "-npp", "16", "-ntg", "4",
                   "-npl", "1", "-t", "1"]
        assert subprocess.run(command, capture_output=True, timeout=300).returncode == 0
    rounded = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    with torch.no_grad():
        for parameter in rounded.parameters():
            if parameter.dim() == 2:
                parameter.copy_(parameter.half().float())
    ids = torch.tensor([[1, 400, 401, 402, 403, 404, 405, 406]])
    expected = rounded.generate(ids, max_new_tokens=16, do_sample=False, pad_token_id=0)[0, 8:].tolist()
    architecture = {"qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[family]
    for quant in ("f16", "Q8_0"):
        model = EaModel.from_pretrained(base_model_path=str(out / f"model-{quant}.gguf"),
                                        ea_model_path=str(out / "head"), use_eagle3=True, gguf_kernels="float32")
        assert type(model.base_model).__name__ == architecture
        assert model.engine.target.forward_plan.native is not None
        plain = model.naivegenerate(ids, max_new_tokens=16)[0, 8:].tolist()
        if quant == "f16":
            assert plain == expected
        else:
            assert model.eagenerate(ids, max_new_tokens=16)[0, 8:].tolist() == plain


def test_bench_leaves_out_llama_cpp_eagle3_where_its_graph_cannot_feed_a_draft():
    """The pinned llama.cpp's qwen2 / qwen2moe graphs record no layer inputs for an EAGLE-3 draft (llama-server
    aborts), so a widened Qwen2 or Qwen2-MoE pair is benchmarked without that method; a Llama pair with all four."""
    from eagle.evaluation.scale.bench import METHODS, bench_methods

    assert bench_methods("llama") == METHODS
    for family in ("qwen2", "qwen2_moe"):
        assert bench_methods(family) == ("eagle", "plain", "llamacpp")
