"""The benchmark under load (eagle.evaluation.load): ``--busy N`` starts busy processes that are always stopped,
and ``--threads`` runs every method at every setting, interleaved, with the policy set against the best fixed
count."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from eagle.evaluation import benchmark
from eagle.evaluation.load import (
    BusyProcesses, ThreadSettings, expand_variants, parse_thread_settings, split_variant, thread_comparison,
)
from eagle.evaluation.questions import find_mt_bench_file

pytestmark = pytest.mark.e2e  # busy processes and the benchmark under load

ROOT = Path(__file__).resolve().parents[1]


def ended(pid: int) -> bool:
    """Gone, or a zombie nobody reaped (what an orphan becomes where the init process does not reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_until(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads processes from Linux /proc")


@needs_proc
def test_busy_processes_run_and_are_always_stopped():
    with BusyProcesses(2) as busy:
        pids = [p.pid for p in busy.processes]
        assert len(pids) == 2 and all(not ended(pid) for pid in pids)
        time.sleep(0.5)
    assert all(ended(pid) for pid in pids)
    record = busy.record()
    assert record["processes"] == 2 and len(record["cpu_share"]) == 2 and record["seconds"] >= 0.5
    assert all(share is not None and share > 0 for share in record["cpu_share"])  # they did compute
    assert len(record["load_average_before"]) == 3 and len(record["load_average_after"]) == 3
    with pytest.raises(RuntimeError, match="a failing benchmark"):
        with BusyProcesses(1) as busy:
            pid = busy.processes[0].pid
            raise RuntimeError("a failing benchmark")
    assert ended(pid)
    with BusyProcesses(0) as none:
        assert none.processes == []
    assert none.record() == {"processes": 0}
    with pytest.raises(ValueError, match="--busy must be >= 0"):
        BusyProcesses(-1)


@needs_proc
@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_busy_processes_end_with_the_benchmark(how):
    """Terminated, the benchmark stops them on its way out; killed outright, they notice their parent is gone."""
    script = textwrap.dedent("""
        import sys, time
        from eagle.evaluation.load import BusyProcesses
        try:
            with BusyProcesses(1) as busy:
                print(busy.processes[0].pid, flush=True)
                time.sleep(120)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        pid = int(parent.stdout.readline())
        assert not ended(pid)
        parent.send_signal(getattr(signal, how))
        parent.wait(timeout=30)
        assert wait_until(lambda: ended(pid))
        if how == "SIGTERM":
            assert parent.stdout.read().strip() == "interrupted"
    finally:
        parent.kill()
        parent.wait()


def test_thread_settings_are_parsed_and_checked():
    assert parse_thread_settings(None) == []
    assert parse_thread_settings("1, 2,policy,2") == ["1", "2", "policy"]
    for bad, message in (("0", "positive thread counts"), ("one", "got 'one'"), (",", "empty list")):
        with pytest.raises(SystemExit, match=message):
            parse_thread_settings(bad)
    assert expand_variants(["eagle", "llamacpp"], ["1", "policy"], fixed=("llamacpp",)) == [
        "eagle@1", "eagle@policy", "llamacpp"]
    assert expand_variants(["eagle", "plain"], []) == ["eagle", "plain"]
    assert split_variant("plain@policy") == ("plain", "policy") and split_variant("eagle") == ("eagle", None)


def test_the_policy_against_the_best_fixed_count():
    totals = {"eagle@1": {"tokens_per_s": 40.0}, "eagle@2": {"tokens_per_s": 12.0},
              "eagle@policy": {"tokens_per_s": 38.0}, "plain@1": {"tokens_per_s": 10.0},
              "plain@2": {"tokens_per_s": 20.0}, "llamacpp": {"tokens_per_s": 50.0}}
    comparison = thread_comparison(totals)
    assert set(comparison) == {"eagle", "plain"}
    assert comparison["eagle"]["best_fixed"] == "1"
    assert comparison["eagle"]["policy_vs_best_fixed"] == pytest.approx(38 / 40)
    assert comparison["plain"]["best_fixed"] == "2" and comparison["plain"]["policy_vs_best_fixed"] is None
    assert thread_comparison({"eagle": {"tokens_per_s": 1.0}}) == {}


def test_thread_settings_detach_and_reattach_the_policy(tiny_model):
    policy, previous = tiny_model.thread_policy, torch.get_num_threads()
    settings = ThreadSettings(tiny_model)
    try:
        settings.apply("1")
        assert tiny_model.thread_policy is None and torch.get_num_threads() == 1
        settings.apply("policy", engine=False)  # Hugging Face's methods: torch's count at start
        assert tiny_model.thread_policy is policy and torch.get_num_threads() == settings.default
        if policy is not None and policy.active:
            policy.threads = 1  # as if it had chosen one thread
            settings.apply("policy")
            assert torch.get_num_threads() == 1 and policy.active
        settings.apply(None)  # a method without a setting: nothing changes
        assert tiny_model.thread_policy is policy
    finally:
        if policy is not None:
            policy.threads = settings.default
        tiny_model.thread_policy = policy
        torch.set_num_threads(previous)


@contextlib.contextmanager
def suffix_store_sizes(model, monkeypatch, **settings):
    """A benchmark's ``TimedMethods`` over ``model`` (greedy, 16 new tokens, ``settings`` added to its arguments) and
    the list that gets the size of the suffix store each engine run starts with; the model's own store restored."""
    seen = []
    real = benchmark.engine_generate

    def spy(model, input_ids, **options):
        gc.collect()  # a finished drafter hands its rows' answers to the store when it is freed
        seen.append(len(model.engine.suffix_store))
        return real(model, input_ids, **options)

    monkeypatch.setattr(benchmark, "engine_generate", spy)
    args = SimpleNamespace(temperature=0.0, max_new_tokens=16, prompt_lookup_num_tokens=10, seed=0, **settings)
    timed = benchmark.TimedMethods(model, SimpleNamespace(is_llama3=False), [], args)
    store = model.engine.suffix_store
    try:
        yield timed, seen
    finally:
        timed.threads.restore()
        model.engine.suffix_store = store


PROMPT = torch.tensor([[5, 9, 13, 17, 21, 25, 29]])


def test_each_thread_setting_of_a_method_drafts_from_a_suffix_store_of_its_own(tiny_model, monkeypatch):
    """``suffix@1`` and ``suffix@2`` are timed apart: the second setting starts with an empty store, not with what
    the first learned from the same question, and each setting keeps its own answers for the next question."""
    with suffix_store_sizes(tiny_model, monkeypatch) as (timed, seen):
        for key in ("suffix@1", "suffix@2", "suffix@1"):
            timed.run(key, PROMPT)
    assert seen[:2] == [0, 0], "the second thread setting started with the first one's answer in its store"
    assert seen[2] > 0, "the first setting's answer did not stay in its store"


def test_the_first_timed_question_does_not_draft_from_the_warm_up_answer(tiny_model, monkeypatch):
    """The warm-up answers the first question; the timed run of that question starts with an empty suffix store."""
    with suffix_store_sizes(tiny_model, monkeypatch, warmup=1) as (timed, seen):
        benchmark.warm_up_methods(timed, ["suffix"], PROMPT, timed.args)
        timed.run("suffix", PROMPT)
    assert seen == [0, 0], "the timed run drafted from the warm-up's answer to the same question"


def busy_children() -> list[int]:
    """This process's children running the busy loop."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
                with open(f"/proc/{entry}/cmdline") as f:
                    cmdline = f.read()
            except OSError:
                continue
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == os.getpid() and "getppid" in cmdline and fields[0] != "Z":
                pids.append(int(entry))
    return pids


@needs_proc
def test_benchmark_under_load_compares_thread_counts(tmp_path, tiny_pair):
    out = tmp_path / "bench"
    results = benchmark.main([
        "--base-model-path", str(tiny_pair[0]), "--ea-model-path", str(tiny_pair[1]), "--question-file",
        str(find_mt_bench_file()), "--num-questions", "2", "--max-new-tokens", "6", "--total-token", "8", "--depth",
        "3", "--top-k", "4", "--warmup", "0", "--methods", "eagle,plain,hf_generate", "--busy", "1",
        "--threads", "1,policy", "--output-dir", str(out),
    ])
    keys = [f"{m}@{s}" for m in ("eagle", "plain", "hf_generate") for s in ("1", "policy")]
    assert list(results["methods"]) == keys
    for index, question in enumerate(results["per_question"]):  # every setting of every method, rotated
        assert set(question["methods"]) == set(keys) and question["order"][0] == keys[index % len(keys)]
    assert results["methods"]["eagle@1"]["label"] == "EAGLE (eagenerate), 1 thread"
    threads = results["threads"]
    assert set(threads) == {"eagle", "plain", "hf_generate"} and threads["eagle"]["best_fixed"] == "1"
    assert threads["eagle"]["policy_vs_best_fixed"] == pytest.approx(
        results["methods"]["eagle@policy"]["tokens_per_s"] / results["methods"]["eagle@1"]["tokens_per_s"])
    settings = results["settings"]
    assert settings["busy"]["processes"] == 1 and settings["thread_settings"] == ["1", "policy"]
    assert settings["thread_policy"] in ("on",) or settings["thread_policy"].startswith("stayed out")
    check = results["greedy_check"]  # every setting of every method gives Hugging Face's tokens
    assert check["reference"] == "hf_generate@policy" and check["differences"] == 0 and check["near_ties"] == 0
    assert results["acceptance"]["steps"] == sum(len(q["methods"]["eagle@policy"]["accept_lengths"])
                                                 for q in results["per_question"])
    report = (out / "report.md").read_text()
    assert "**Under load:** 1 busy process" in report and "## Thread counts under the same load" in report
    assert "| eagle | " in report and "policy / best fixed" in report
    assert busy_children() == []  # stopped at the end
