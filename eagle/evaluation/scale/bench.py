"""``python -m eagle.evaluation.scale bench``: this project against llama.cpp on a converted widened pair
(:mod:`eagle.evaluation.scale.convert`), side by side.

- The generation methods run through :mod:`eagle.evaluation.benchmark` (interleaved question by question, the same
  prompts): ``eagle`` and ``plain`` on the GGUF kernels, ``llamacpp`` (llama-server plain) and ``llamacpp_eagle3``
  (llama-server with the widened head as its EAGLE-3 draft): tokens/s, tau, resident memory.
- Load: ours is the wall time of ``EaModel.from_pretrained`` as the benchmark's flags load it (and the process's peak
  resident memory, loaded before anything else in this process; the benchmark then runs that model, so the pair
  is loaded once); llama.cpp's the time until llama-server answers ``/health`` (and its resident memory after one
  short completion).
- The cost of one target forward over k tokens after a 256-token context, as a multiple of k = 1: ours times a
  k-node tree's verification as a step of the loop does (:func:`eagle.model.tuning.autotune.verification_run`:
  ``Target.verify``, the logits read, the cache compaction); llama.cpp's comes from ``llama-batched-bench`` (one
  decode of k sequences, one token each, after a shared 256-token prompt: the same weights read for k rows, each row
  attending to 256 + its own tokens).
- The machine's read bandwidth (``eagle.kernels.read_bandwidth`` where the extension has it, else a numpy sum over an
  array larger than the last-level cache) and the GB/s one plain token streams (the GGUF's bytes over one k = 1
  forward).

The widened models compute SmolLM2-135M's function: acceptance is the embedded head's, not a real 2B/8B model's.
"""

from __future__ import annotations

import json
import logging
import resource
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

logger = logging.getLogger(__name__)

KS = (1, 2, 4, 8, 16, 32)
CONTEXT = 256
BANDWIDTH_BYTES = 1 << 30  # larger than any last-level cache of a CPU this runs on
METHODS = ("eagle", "plain", "llamacpp", "llamacpp_eagle3")
#: the widening families whose graph in the pinned llama.cpp records the layer inputs an EAGLE-3 draft reads (its
#: qwen2 and qwen2moe graphs do not: llama-server aborts on "layer input tensor is null"); the others run without
#: ``llamacpp_eagle3``
LLAMACPP_EAGLE3_FAMILIES = ("llama",)


def bench_methods(family: str = "llama") -> tuple[str, ...]:
    """The generation methods ``bench`` runs on a pair of ``family``."""
    if family in LLAMACPP_EAGLE3_FAMILIES:
        return METHODS
    logger.warning("llama.cpp's %s graph gives an EAGLE-3 draft no layer inputs: llamacpp_eagle3 is left out.", family)
    return tuple(method for method in METHODS if method != "llamacpp_eagle3")


def read_bandwidth(threads: int, nbytes: int = BANDWIDTH_BYTES, repeats: int = 3) -> dict:
    """The machine's read bandwidth in GB/s: the kernels' own measurement where the extension has it
    (``read_bandwidth(nbytes, threads)``, taken as GB/s), else the best of ``repeats`` numpy sums over ``nbytes``
    (one thread)."""
    from eagle import kernels

    if kernels.available():
        return {"gb_per_s": float(kernels.read_bandwidth(nbytes, threads)), "source": "eagle.kernels.read_bandwidth",
                "bytes": nbytes, "threads": threads}
    data = np.ones(nbytes // 8, dtype=np.float64)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    del data
    return {"gb_per_s": nbytes / best / 1e9, "source": "numpy sum", "bytes": nbytes, "threads": 1}


def cost_curve(seconds: dict[int, float]) -> dict:
    """Seconds per k and their multiple of k = 1."""
    return {"seconds": {str(k): s for k, s in seconds.items()},
            "multiple_of_k1": {str(k): s / seconds[1] for k, s in seconds.items()}}


def ours(benchmark_args, ks=KS) -> tuple[dict, object]:
    """Load time and memory of this project's pair on the GGUF kernels (loaded as the benchmark's flags
    ``benchmark_args`` describe), and its verification cost curve; returns them and the model, which the benchmark
    then runs (the pair is loaded once)."""
    from eagle.cli import load_model_from_args
    from eagle.evaluation.benchmark_memory import process_rss_bytes, weight_bytes
    from eagle.model.tuning.autotune import REPEATS, best_seconds, verification_run

    start = time.perf_counter()
    model = load_model_from_args(benchmark_args)
    load_s = time.perf_counter() - start
    record = {"load_s": load_s, "peak_rss_bytes_during_load": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
              "rss_bytes_after_load": process_rss_bytes(),
              "weight_bytes": weight_bytes(model.base_model, model.ea_layer)}
    logger.info("Ours: loaded in %.2f s; timing a forward over k = %s tokens after %d", load_s, ks, CONTEXT)
    runs = {k: verification_run(model, k, prefix=CONTEXT) for k in ks}
    with tqdm(total=REPEATS + 1, desc="our cost of k tokens", unit="round") as progress:
        record["cost"] = cost_curve(best_seconds(runs, REPEATS, model.device, progress))
    del runs
    return record, model


def llama_load(model_gguf: Path, threads: int) -> dict:
    """Seconds until llama-server is ready on ``model_gguf``, and its resident memory after one short completion."""
    from eagle.evaluation.benchmark_memory import process_rss_bytes
    from eagle.evaluation.llamacpp import LlamaServer, find_llama_server

    start = time.perf_counter()
    server = LlamaServer(find_llama_server(), str(model_gguf), threads=threads)
    ready_s = time.perf_counter() - start
    try:
        server.complete([1, 2, 3], 4)
        rss = process_rss_bytes(server.process.pid)
    finally:
        server.close()
    return {"load_s": ready_s, "rss_bytes": rss}


def llama_cost(model_gguf: Path, threads: int, ks=KS, steps: int = 4) -> dict | None:
    """llama.cpp's cost of one decode over k tokens after a 256-token context (``llama-batched-bench``: k
    sequences sharing the prompt in one unified KV cache, ``steps`` decodes each, seconds per decode), or None when
    the binary is missing or fails."""
    from eagle.evaluation.scale.convert import find_llama_tool

    binary = find_llama_tool("llama-batched-bench")
    if binary is None:
        logger.warning("llama-batched-bench is not built (scripts/build_llama_cpp.sh builds it): llama.cpp's cost "
                       "curve is left out.")
        return None
    command = [str(binary), "-m", str(model_gguf), "-c", str(CONTEXT + max(ks) * steps + 64), "-npp", str(CONTEXT),
               "-ntg", str(steps), "-npl", ",".join(map(str, ks)), "-pps", "-kvu", "-t", str(threads),
               "--output-format", "jsonl"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    rows = [json.loads(line) for line in (done.stdout + "\n" + done.stderr).splitlines()
            if line.startswith('{"n_kv_max"')]
    if done.returncode or not rows:
        logger.warning("llama-batched-bench failed (exit code %d): %s", done.returncode, done.stderr[-2000:])
        return None
    return cost_curve({int(row["pl"]): float(row["t_tg"]) / int(row["tg"]) for row in rows})


def benchmark_arguments(model_gguf: Path, head_dir: Path, args):
    """The parsed flags of :mod:`eagle.evaluation.benchmark` for the generation methods (:func:`bench_methods`)
    on the pair."""
    from eagle.evaluation import benchmark

    argv = ["--base-model-path", str(model_gguf), "--ea-model-path", str(head_dir), "--use-eagle3",
            "--gguf-kernels", args.numerics, "--methods", ",".join(bench_methods(getattr(args, "family", "llama"))),
            "--num-questions",
            str(args.num_questions), "--max-new-tokens", str(args.max_new_tokens), "--llamacpp-threads",
            str(args.threads), "--output-dir", str(args.output_dir / "benchmark")]
    return benchmark.build_parser().parse_args(argv)


def run_benchmark(benchmark_args, model) -> dict:
    """The generation methods through :func:`eagle.evaluation.benchmark.run`, on ``model`` as loaded."""
    from eagle.evaluation import benchmark

    return benchmark.run(benchmark_args, model)


def method_rows(results: dict) -> dict:
    """Per method: tokens/s, its ratio to llama.cpp plain, tau (EAGLE), the fraction of drafted tokens accepted
    (llama.cpp with the head) and resident bytes (measured on the first question)."""
    totals, first = results["methods"], results["per_question"][0]["methods"]
    base = (totals.get("llamacpp") or {}).get("tokens_per_s")
    llama_acceptance = ((results.get("llamacpp") or {}).get("acceptance") or {}).get("accepted_fraction")
    rows = {}
    for method, total in totals.items():
        rate = total["tokens_per_s"]
        rows[method] = {"label": total["label"], "tokens_per_s": rate,
                        "vs_llamacpp_plain": rate / base if rate and base else None,
                        "tau": total["tau"] if method == "eagle" else None,
                        "accepted_fraction": llama_acceptance if method == "llamacpp_eagle3" else None,
                        "resident_bytes": first[method].get("resident_bytes")}
    return rows


def streaming(model_gguf: Path, seconds_k1: float | None) -> float | None:
    """GB/s one plain token streams: the GGUF's bytes over one k = 1 forward."""
    return model_gguf.stat().st_size / seconds_k1 / 1e9 if seconds_k1 else None


def bench(args) -> dict:
    """Every measurement of the module docstring on the converted pair under ``args.out``; writes
    ``args.output_dir/scale-bench.json`` and returns what it wrote."""
    from eagle.evaluation.scale.convert import converted_files

    if args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}.")
    files = converted_files(args.out, args.quant)
    torch.set_num_threads(args.threads)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    result = {"shape": args.shape, "family": getattr(args, "family", "llama"), "quant": args.quant,
              "numerics": args.numerics, "threads": args.threads,
              "model_file": files["model"].name, "model_file_bytes": files["model"].stat().st_size}
    benchmark_args = benchmark_arguments(files["model"], files["head_dir"], args)
    result["ours"], model = ours(benchmark_args)  # first: the process's peak is the load's
    logger.info("Measuring the read bandwidth")
    result["read_bandwidth"] = read_bandwidth(args.threads)
    logger.info("llama.cpp: server load and its cost curve")
    result["llamacpp"] = {**llama_load(files["model"], args.threads),
                          "cost": None if args.skip_llamacpp_curve else llama_cost(files["model"], args.threads)}
    results = run_benchmark(benchmark_args, model)
    del model
    result["methods"] = method_rows(results)
    result["benchmark"] = {"settings": results["settings"], "acceptance": results["acceptance"],
                           "llamacpp": results["llamacpp"], "greedy_check": results["greedy_check"]}
    for side in ("ours", "llamacpp"):
        cost = result[side]["cost"]
        result[side]["plain_token_gb_per_s"] = streaming(files["model"], cost and cost["seconds"]["1"])
    path = args.output_dir / "scale-bench.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    result["json"] = str(path)
    return result


def _fmt(value, spec: str = ".2f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value / scale, spec)


def table(result: dict) -> list[str]:
    """The report printed on stdout."""
    lines = [f"scale bench: shape {result['shape']} ({result['model_file']}, {result['model_file_bytes'] / 1e9:.2f} "
             f"GB), {result['threads']} threads; synthetic shape computing SmolLM2-135M's function",
             f"read bandwidth {result['read_bandwidth']['gb_per_s']:.1f} GB/s ({result['read_bandwidth']['source']})",
             "", f"{'method':<34} {'tok/s':>8} {'x llama.cpp':>11} {'tau':>6} {'accepted':>9} {'mem GB':>7}"]
    for row in result["methods"].values():
        lines.append(f"{row['label'][:34]:<34} {_fmt(row['tokens_per_s']):>8} {_fmt(row['vs_llamacpp_plain']):>11} "
                     f"{_fmt(row['tau']):>6} {_fmt(row['accepted_fraction'], '.3f'):>9} "
                     f"{_fmt(row['resident_bytes'], '.2f', 1e9):>7}")
    ours, llama = result["ours"], result["llamacpp"]
    lines += ["mem: the weights ours computes with (target and head); llama.cpp's: its server's resident set",
              "", f"load: ours {ours['load_s']:.2f} s (peak RSS {ours['peak_rss_bytes_during_load'] / 1e9:.2f} GB, "
                  f"RSS after {_fmt(ours['rss_bytes_after_load'], '.2f', 1e9)} GB), "
                  f"llama-server ready {llama['load_s']:.2f} s (RSS {_fmt(llama['rss_bytes'], '.2f', 1e9)} GB)",
              f"plain token streams: ours {_fmt(ours['plain_token_gb_per_s'], '.1f')} GB/s, llama.cpp "
              f"{_fmt(llama['plain_token_gb_per_s'], '.1f')} GB/s",
              f"forward over k tokens after {CONTEXT}, multiple of k = 1:",
              "  k          " + " ".join(f"{k:>6}" for k in KS)]
    for name, side in (("ours", ours), ("llama.cpp", llama)):
        multiples = (side["cost"] or {}).get("multiple_of_k1", {})
        lines.append(f"  {name:<10} " + " ".join(f"{_fmt(multiples.get(str(k))):>6}" for k in KS))
    return lines
