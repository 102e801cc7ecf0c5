"""End to end in llama.cpp: the embedded default head, exported with ``python -m eagle.export --format llama.cpp``,
runs as llama-server's EAGLE-3 draft next to the embedded SmolLM2 GGUF, on 8 MT-bench first turns (one per
category). Greedy answers equal llama.cpp's plain decoding token for token with one thread (with several, llama.cpp's
own plain decoding splits its one-token attention over the threads past 256 cached tokens and can part from its
speculative decoding at a near-tie; the benchmark's rerun against one thread, tested here, tells those apart), and
at least 0.25 of the drafted tokens are accepted at 3 draft tokens with llama.cpp's default draft settings (0.298
measured on these questions, 0.329 on the benchmark's 16 x 256 tokens; the issue's target was 0.30). And on the
same float32 weights (the target's GGUF dequantized by scripts/gguf_to_float.py) the head accepts in llama.cpp what
it accepts in this project's engine with the same 3-token chain: a conversion mistake (target layers, RoPE order,
norms, d2t) shows as a gap there.

llama-server is built once per machine by scripts/build_llama_cpp.sh (15-40 minutes on 2 cores; reused from its
cache directory afterwards). Without cmake or a C++ compiler the test is skipped, saying so."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from eagle.defaults import default_base_model_path
from eagle.evaluation import llamacpp
from eagle.evaluation.questions import load_questions, spread_over_categories
from eagle.export import main as export_main

pytestmark = pytest.mark.e2e  # llama.cpp's llama-server (built once per machine)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def llama_server_binary():
    binary = llamacpp.find_llama_server()
    if binary is not None:
        return binary
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"llama-server is not built and {', '.join(missing)} is missing to build it")
    build = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_cpp.sh")], capture_output=True, text=True,
                           timeout=3 * 3600)
    assert build.returncode == 0, f"scripts/build_llama_cpp.sh failed:\n{build.stderr[-3000:]}"
    bin_dir = build.stdout.strip().splitlines()[-1]
    os.environ["EAGLE_LLAMA_CPP_BIN"] = bin_dir
    binary = llamacpp.find_llama_server()
    assert binary is not None and binary.startswith(bin_dir)
    return binary


def _chat(question: str) -> str:  # SmolLM2-Instruct's chat format, the prompt the benchmark gives every method
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"


def test_exported_default_head_runs_in_llama_server(tmp_path, llama_server_binary):
    # One thread: llama.cpp's threads wait for each other by spinning, which collapses on a shared, busy machine; and
    # with one thread its plain and speculative decoding compute attention alike (see the module docstring).
    questions = [q["turns"][0] for q in spread_over_categories(load_questions("mt_bench"), 8)]  # one per category
    draft = tmp_path / "head.gguf"
    assert export_main(["--format", "llama.cpp", "--output", str(draft)]) == 0
    base = default_base_model_path()
    plain = llamacpp.LlamaServer(llama_server_binary, base, threads=1)
    try:
        expected = [plain.complete(_chat(q), 96)["tokens"] for q in questions]
    finally:
        plain.close()
    eagle3 = llamacpp.LlamaServer(llama_server_binary, base, draft=str(draft), draft_tokens=3, threads=1)
    try:
        answers = [eagle3.complete(_chat(q), 96) for q in questions]
        log = eagle3.log_tail(200)
    finally:
        eagle3.close()
    assert "EAGLE3" in log or "eagle3" in log
    for question, reference, answer in zip(questions, expected, answers):
        assert len(reference) > 8, question
        assert answer["tokens"] == reference, question
    stats = llamacpp.acceptance([a["timings"] for a in answers])
    assert stats is not None, "llama-server drafted nothing: the EAGLE-3 draft was not used"
    # Measured 2026-12-01: 355 of 1,191 drafted tokens accepted (0.298) on these questions; the floor sits below it.
    assert stats["accepted_fraction"] >= 0.25, stats


def _engine_chain_acceptance(prompts: list[str], max_new_tokens: int) -> dict:
    """Drafted and accepted tokens of this project's engine drafting what llama.cpp drafts: a chain of the head's
    3 likeliest tokens (top-1 at each of 3 levels), no lookup branch, greedy."""
    from eagle.model.ea_model import EaModel

    model = EaModel.from_pretrained(total_token=4, depth=2, top_k=1, lookup_tokens=0)
    drafted = accepted = 0
    for prompt in prompts:
        ids = model.tokenizer(prompt, return_tensors="pt")["input_ids"]
        steps = model.generate_batch_steps(ids, max_new_tokens=max_new_tokens)
        next(steps)  # the prefill's step drafts nothing
        for step in steps:
            if step.tokens[0].numel():
                drafted, accepted = drafted + 3, accepted + step.accepted[0]
    return {"drafted": drafted, "accepted": accepted, "accepted_fraction": accepted / drafted}


def test_head_accepts_in_llama_cpp_what_it_accepts_here(tmp_path, llama_server_binary):
    prompts = [_chat(q["turns"][0]) for q in spread_over_categories(load_questions("mt_bench"), 8)[:4]]
    target = tmp_path / "target.f32.gguf"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gguf_to_float.py"), "--output", str(target)], check=True,
                   capture_output=True)
    draft = tmp_path / "head.gguf"
    assert export_main(["--format", "llama.cpp", "--base-model-path", str(target), "--output", str(draft)]) == 0
    server = llamacpp.LlamaServer(llama_server_binary, str(target), draft=str(draft), draft_tokens=3, threads=1)
    try:
        theirs = llamacpp.acceptance([server.complete(p, 64)["timings"] for p in prompts])
    finally:
        server.close()
    ours = _engine_chain_acceptance(prompts, 64)
    # Measured 2026-12-01 on 8 questions, 96 tokens: 359/1177 (0.305) in llama.cpp, 365/1203 (0.303) here. The two
    # engines round differently (float16 head products in llama.cpp, bfloat16 here), so a draft can differ now and
    # then; a conversion mistake moves the fraction by far more.
    assert theirs is not None and abs(theirs["accepted_fraction"] - ours["accepted_fraction"]) <= 0.04, (theirs, ours)


def test_benchmark_summary_reads_acceptance_and_answers_after_the_servers_close(llama_server_binary):
    from eagle.defaults import default_ea_model_path

    prompts = [_chat(q["turns"][0]) for q in spread_over_categories(load_questions("mt_bench"), 8)[:2]]
    runner = llamacpp.LlamaCppMethods(list(llamacpp.LLAMACPP_METHODS), default_base_model_path(),
                                     default_ea_model_path(), threads=1, extra_args=["--poll", "0"])
    per_question, outputs = [], {}
    try:
        for number, prompt in enumerate(prompts):
            record, outputs[number] = {"question_id": number, "methods": {}}, {}
            for method in llamacpp.LLAMACPP_METHODS:
                generation, timings = runner.run(method, prompt, 32, 0.0, 0)
                record["methods"][method] = {"llamacpp_timings": timings}
                outputs[number][method] = generation.new_ids
            per_question.append(record)
    finally:
        runner.close()  # the benchmark closes the servers before it summarises
    section = llamacpp.summarise(per_question, outputs, runner, [], 3)
    assert section["threads"] == 1 and section["acceptance"]["drafted"] > 0
    assert section["greedy_check"] == {"checked": 2, "identical": 2, "different_questions": [], "one_thread": None}
    lines = "\n".join(llamacpp.report_lines(section, 0.0))
    assert "Drafted tokens accepted" in lines and "1 thread, extra arguments `--poll 0`" in lines


def test_benchmark_skips_llamacpp_with_a_note_when_its_arguments_are_refused(llama_server_binary):
    from eagle.defaults import default_ea_model_path

    runner, methods, notes = llamacpp.start_for_benchmark(
        ["eagle", "llamacpp"], default_base_model_path(), default_ea_model_path(), 1, 3, ["--no-such-flag"])
    assert runner is None and methods == ["eagle"]
    assert "llama-server failed to start" in notes[0] and "--no-such-flag" in notes[0]


def test_benchmark_sets_differing_answers_against_one_thread_plain_decoding(llama_server_binary):
    # With several threads llama.cpp's plain decoding can part from its speculative decoding (its one-token attention
    # is split over threads past 256 cached tokens). The benchmark reruns such questions with one thread: an answer
    # with our head equal to that is llama.cpp's own difference; one that is not stays a difference.
    prompts = {number: _chat(q["turns"][0])
               for number, q in enumerate(spread_over_categories(load_questions("mt_bench"), 8)[:2])}
    server = llamacpp.LlamaServer(llama_server_binary, default_base_model_path(), threads=1)
    try:
        answers = {n: server.complete(p, 24, n_probs=llamacpp.ONE_THREAD_PROBS) for n, p in prompts.items()}
    finally:
        server.close()
    exact = {n: [int(t) for t in a["tokens"]] for n, a in answers.items()}
    top = [int(e["id"]) for e in answers[0]["completion_probabilities"][5]["top_logprobs"]]
    assert top[0] == exact[0][5]
    flipped = exact[0][:5] + [top[1]] + exact[0][6:]  # a multi-thread plain answer parting at a close second
    broken = exact[1][:5] + [(exact[1][5] + 1) % 49152] + exact[1][6:]  # an answer with our head gone wrong
    outputs = {0: {"llamacpp": flipped, "llamacpp_eagle3": exact[0]}, 1: {"llamacpp": exact[1], "llamacpp_eagle3": broken}}
    runner = SimpleNamespace(binary=llama_server_binary, base_gguf=default_base_model_path(), threads=2, context=4096,
                             extra_args=[], methods=llamacpp.LLAMACPP_METHODS)
    found = llamacpp.recheck_with_one_thread(runner, outputs, prompts, 24)
    rows = {row["question_id"]: row for row in found["questions"]}
    assert rows[0]["equals_one_thread_plain"] and rows[0]["first_difference"] == 5
    expected_gap = abs(answers[0]["completion_probabilities"][5]["top_logprobs"][0]["logprob"]
                               - answers[0]["completion_probabilities"][5]["top_logprobs"][1]["logprob"])
    assert rows[0]["logit_gap"] == pytest.approx(expected_gap, abs=1e-4)
    assert not rows[1]["equals_one_thread_plain"] and rows[1]["first_difference"] == 5
    section = {"notes": [], "server": "llama-server", "threads": 2, "extra_args": [], "draft_tokens": 3,
               "acceptance": None, "greedy_check": {"checked": 2, "identical": 0, "different_questions": [0, 1],
                                                    "one_thread": found}}
    lines = "\n".join(llamacpp.report_lines(section, 0.0))
    assert "(both on 2 threads) on 0 of 2" in lines and "1 of 2 equal llama.cpp's plain decoding with 1 thread (not: [1])" in lines
    # one thread, one llama.cpp method, or no difference: nothing to recheck
    assert llamacpp.recheck_with_one_thread(SimpleNamespace(**{**vars(runner), "threads": 1}), outputs, prompts, 24) is None
    plain_only = {n: {"llamacpp": answers["llamacpp"]} for n, answers in outputs.items()}
    assert llamacpp.recheck_with_one_thread(SimpleNamespace(**{**vars(runner), "methods": ("llamacpp",)}), plain_only,
                                            prompts, 24) is None
    assert llamacpp.recheck_with_one_thread(runner, {0: {"llamacpp": exact[0], "llamacpp_eagle3": exact[0]}}, prompts,
                                            24) is None
