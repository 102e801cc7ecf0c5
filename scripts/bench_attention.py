"""The position-ordered attention kernel (eagle.kernels.attention.tree_attention) against PyTorch's CPU SDPA on
SmolLM2-135M's attention shapes (9 query heads, 3 key/value heads, head dim 64, 30 layers), under a 4-D tree mask
like a verification forward's: S slots, the first S - T committed (fewer in some rows of a batch), the last T a
random draft tree.

    python scripts/bench_attention.py                       # the whole grid, 1 and 2 threads
    python scripts/bench_attention.py --slots 300 --queries 1,12 --batch 1 --threads 1 --repeats 9

For every (threads, B, S, T) it times, interleaved, ``--repeats`` times each:
  - ``ours``: tree_attention (visible-key lists cached for the mask object, as in a forward);
  - ``sdpa_gqa``: F.scaled_dot_product_attention(..., attn_mask=mask, enable_gqa=True);
  - ``sdpa_repeat``: repeat_kv then SDPA, what transformers' SDPA integration does for a masked grouped call;
first one call (one layer's tensors, called ``--calls`` times in a row), then a forward's ``--layers`` layers (each
layer its own key/value tensors, one mask for all, as transformers hands it). Prints the median milliseconds and the
ratios ours / sdpa (below 1: ours is faster). Clock: ``--clock cpu`` (process CPU time: little changed by other
jobs on a loaded machine; with 2 threads it sums both threads' work) or ``wall`` (default; for an idle machine).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.nn.functional as F

from eagle import kernels
from eagle.kernels import attention

logger = logging.getLogger("bench_attention")

Q_HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def tree_mask(batch: int, queries: int, slots: int, generator: torch.Generator) -> torch.Tensor:
    """bool (B, 1, T, S): row b has S - T - 5 b committed slots (then unused ones), and the last T slots hold a
    random tree whose nodes see their ancestors."""
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=generator)) for j in range(1, queries)]
    ancestors = torch.eye(queries, dtype=torch.bool)
    for j in range(1, queries):
        ancestors[j] |= ancestors[parents[j]]
    mask = torch.zeros(batch, 1, queries, slots, dtype=torch.bool)
    for b in range(batch):
        committed = max(slots - queries - 5 * b, 1)
        mask[b, 0, :, :committed] = True
        mask[b, 0, :, slots - queries:] = ancestors
    return mask


def implementations(mask: torch.Tensor) -> dict:
    """name -> f(q, k, v) for one layer's attention under ``mask``."""
    group = Q_HEADS // KV_HEADS
    scale = HEAD_DIM ** -0.5

    def ours(q, k, v):
        return attention.tree_attention(q, k, v, mask, scale)

    def sdpa_gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    def sdpa_repeat(q, k, v):
        k = k[:, :, None].expand(-1, -1, group, -1, -1).reshape(k.shape[0], Q_HEADS, *k.shape[2:])
        v = v[:, :, None].expand(-1, -1, group, -1, -1).reshape(v.shape[0], Q_HEADS, *v.shape[2:])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)

    return {"ours": ours, "sdpa_gqa": sdpa_gqa, "sdpa_repeat": sdpa_repeat}


def time_config(batch: int, slots: int, queries: int, args, clock) -> dict[str, dict[str, float]]:
    """{"call": {name: ms}, "forward": {name: ms}} medians over the repeats, implementations interleaved."""
    generator = torch.Generator().manual_seed(slots * 100 + queries * 10 + batch)
    mask = tree_mask(batch, queries, slots, generator)
    layers = [(torch.randn(batch, Q_HEADS, queries, HEAD_DIM, generator=generator),
               torch.randn(batch, KV_HEADS, slots, HEAD_DIM, generator=generator),
               torch.randn(batch, KV_HEADS, slots, HEAD_DIM, generator=generator)) for _ in range(args.layers)]
    impls = implementations(mask)
    samples = {"call": {name: [] for name in impls}, "forward": {name: [] for name in impls}}
    with torch.no_grad():
        for f in impls.values():  # warm up (and build the visible-key lists once)
            f(*layers[0])
        for _ in range(args.repeats):
            for name, f in impls.items():
                start = clock()
                for _ in range(args.calls):
                    f(*layers[0])
                samples["call"][name].append((clock() - start) / args.calls * 1e3)
                start = clock()
                for q, k, v in layers:
                    f(q, k, v)
                samples["forward"][name].append((clock() - start) * 1e3)
    return {kind: {name: statistics.median(ms) for name, ms in by_name.items()} for kind, by_name in samples.items()}


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slots", type=int_list, default=[100, 300, 1000],
                        help="key slots S (committed length plus the tree), comma-separated (default 100,300,1000)")
    parser.add_argument("--queries", type=int_list, default=[1, 4, 8, 12, 16],
                        help="queries T (tree nodes; 1 = plain decoding), comma-separated (default 1,4,8,12,16)")
    parser.add_argument("--batch", type=int_list, default=[1, 8], help="batch sizes B, comma-separated (default 1,8)")
    parser.add_argument("--threads", type=int_list, default=[1, 2],
                        help="torch intra-op thread counts, comma-separated (default 1,2)")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved repeats per configuration (default 5)")
    parser.add_argument("--calls", type=int, default=20, help="calls per 'call' sample (default 20)")
    parser.add_argument("--layers", type=int, default=LAYERS, help=f"layers per 'forward' sample (default {LAYERS})")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall (elapsed, default) or cpu (process CPU time, for a loaded machine)")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not kernels.available():
        logger.warning("the compiled kernel is unavailable (%s): 'ours' times the float64 reference",
                       kernels.unavailable_reason())
    else:
        logger.info("kernel paths on this CPU: %s; running %s (%s)", ", ".join(kernels.isas()), kernels.isa(),
                    kernels.isa_reason())
    previous = torch.get_num_threads()
    print(f"{'thr':>3} {'B':>2} {'S':>5} {'T':>3} | {'call ms: ours':>13} {'sdpa_gqa':>9} {'sdpa_rep':>9} "
          f"{'ratio_gqa':>9} {'ratio_rep':>9} | {'forward ms: ours':>16} {'sdpa_gqa':>9} {'sdpa_rep':>9} "
          f"{'ratio_gqa':>9} {'ratio_rep':>9}")
    try:
        for threads in args.threads:
            torch.set_num_threads(threads)
            for batch in args.batch:
                for slots in args.slots:
                    for queries in args.queries:
                        logger.debug("threads %d, B %d, S %d, T %d", threads, batch, slots, queries)
                        ms = time_config(batch, slots, queries, args, CLOCKS[args.clock])
                        row = []
                        for kind in ("call", "forward"):
                            m = ms[kind]
                            row.append(f"{m['ours']:13.3f} {m['sdpa_gqa']:9.3f} {m['sdpa_repeat']:9.3f} "
                                       f"{m['ours'] / m['sdpa_gqa']:9.2f} {m['ours'] / m['sdpa_repeat']:9.2f}")
                        print(f"{threads:>3} {batch:>2} {slots:>5} {queries:>3} | {row[0]} | {' ' * 3}{row[1]}",
                              flush=True)
    finally:
        torch.set_num_threads(previous)


if __name__ == "__main__":
    main()
