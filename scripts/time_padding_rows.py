"""What padding rows cost in one target forward of a batch: a verification forward over trees of different sizes
(padded to the largest) and a prefill of left-padded prompts, each timed with the padding rows skipped by the
packed linear layers (``real_rows_only``, the engine's way) and computed like real rows, interleaved in
one process on the embedded default pair (or ``--base-model`` / ``--ea-model``).

    python scripts/time_padding_rows.py --tree-sizes 24,4,4,4,4,4,4,4 --prompt-lengths 30,60,90,120,150,180,210,240
    python scripts/time_padding_rows.py --generate-batches 4,8 --num-questions 16 --max-new-tokens 128

Prints, for each, the median milliseconds (CPU time by default, see ``--clock``) over ``--repeats`` runs with the padding skipped and computed; for the
verification also a batch whose trees all have the smallest size (no padding), for reference.
``--generate-batches``: greedy batched EAGLE over MT-bench first turns (the model's batch trees), each batch size
run with the padding skipped and computed in turn, ``--repeats`` times: total seconds, and milliseconds per step
of its prefills and verifications.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import defaultdict

import torch

from eagle.model.drafting.tree import DraftTree, stack_trees, tree_from_parents
from eagle.model.ea_model import EaModel
from eagle.model.engine import loop
from eagle.model.engine.commit import Rows
from eagle.model.engine.verify import prefill, verify_trees
from eagle.model.base import target as target_module


def chain_tree(root: torch.Tensor, size: int) -> DraftTree:
    """A chain of ``size`` nodes after ``root`` (node i's parent is i - 1): any shape costs the same rows."""
    tokens = torch.cat([root.reshape(1), torch.randint(100, 1000, (size - 1,))])
    return tree_from_parents(tokens, torch.arange(-1, size - 1), torch.zeros(size))


# What is timed: "cpu" (default) the process's CPU time, which other jobs on a loaded machine barely change (with one
# torch thread, the work done); "wall" the elapsed time (for an idle machine). Set by --clock.
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}
_clock = [CLOCKS["cpu"]]


def clock() -> float:
    return _clock[0]()


@contextlib.contextmanager
def padding_computed():
    """Padding rows computed like real ones: the engine without ``real_rows_only``."""
    skip = target_module.real_rows_only
    target_module.real_rows_only = contextlib.nullcontext
    try:
        yield
    finally:
        target_module.real_rows_only = skip


def time_verify(target, sizes: list[int], prefix: int) -> dict[str, float]:
    """Seconds of one verification forward (lazy logits, as the engine runs it) after ``prefix`` committed tokens
    per row, for: padding skipped, padding computed."""
    batch = len(sizes)
    cache = target.new_cache(prefix + max(sizes) + 1)
    cache.reset(batch)
    ids = torch.randint(100, 1000, (batch, prefix))
    prefill(target, ids, cache, None, False)
    rows = Rows(list(range(batch)), [0] * batch, [prefix] * batch)
    trees = stack_trees([chain_tree(ids[b, -1], n) for b, n in enumerate(sizes)])
    seconds = {}
    for label, context in (("skipped", contextlib.nullcontext()), ("computed", padding_computed())):
        with context:
            start = clock()
            verify_trees(target, trees, cache, rows, lazy_logits=True)
            seconds[label] = clock() - start
        cache.crop(prefix)
    return seconds


def time_prefill(target, lengths: list[int]) -> dict[str, float]:
    """Seconds of one prefill of prompts of ``lengths`` tokens, left-padded to the longest."""
    width = max(lengths)
    ids = torch.randint(100, 1000, (len(lengths), width))
    pads = [width - n for n in lengths]
    seconds = {}
    for label, context in (("skipped", contextlib.nullcontext()), ("computed", padding_computed())):
        cache = target.new_cache(width + 1)
        cache.reset(len(lengths))
        with context:
            start = clock()
            prefill(target, ids, cache, None, True, pads)
            seconds[label] = clock() - start
    return seconds


@contextlib.contextmanager
def timed(owner, names: list[str], seconds: dict[str, float]):
    """Add the time spent in ``owner``'s functions ``names`` to ``seconds`` while inside."""
    originals = {name: getattr(owner, name) for name in names}

    def wrap(name, function):
        def run(*args, **kwargs):
            start = clock()
            try:
                return function(*args, **kwargs)
            finally:
                seconds[name] += clock() - start
        return run

    for name, function in originals.items():
        setattr(owner, name, wrap(name, function))
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(owner, name, function)


def time_generation(model, prompts: list[list[int]], batch: int, max_new_tokens: int) -> dict[str, float]:
    """Greedy batched EAGLE over ``prompts`` in batches of ``batch``: seconds in all, in prefills and in
    verifications, and the number of steps (target forwards)."""
    seconds: dict[str, float] = defaultdict(float)
    steps = 0
    start = clock()
    with timed(loop, ["prefill", "verify_trees"], seconds):
        for first in range(0, len(prompts), batch):
            rows = [torch.tensor(p) for p in prompts[first:first + batch]]
            steps += sum(1 for _ in model.generate_batch_steps(rows, max_new_tokens=max_new_tokens))
    seconds["total"] = clock() - start
    seconds["steps"] = steps
    return seconds


def compare_generation(model, args) -> None:
    from eagle.evaluation.batch_benchmark import first_turn_prompts

    prompts = first_turn_prompts(model.tokenizer, args.num_questions)
    for batch in (int(n) for n in args.generate_batches.split(",")):
        time_generation(model, prompts[:batch], batch, 16)  # warm-up
        runs: dict[str, list[dict[str, float]]] = {"skipped": [], "computed": []}
        for _ in range(args.repeats):
            for label, context in (("skipped", contextlib.nullcontext), ("computed", padding_computed)):
                with context():
                    runs[label].append(time_generation(model, prompts, batch, args.max_new_tokens))
        for label, results in runs.items():
            steps = results[0]["steps"]
            total = statistics.median(r["total"] for r in results)
            prefill, verify = (1e3 * statistics.median(r[name] for r in results) / steps
                               for name in ("prefill", "verify_trees"))
            print(f"batch {batch}, padding {label}: {total:.1f} s for {len(prompts)} answers, {steps} steps; "
                  f"ms per step: prefill {prefill:.2f}, verify {verify:.2f}")


def median_ms(runs: list[dict[str, float]]) -> dict[str, float]:
    return {label: 1e3 * statistics.median(run[label] for run in runs) for label in runs[0]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--tree-sizes", default="24,4,4,4,4,4,4,4",
                        help="Comma-separated node counts of the batch's trees (root included), one per row.")
    parser.add_argument("--prefix", type=int, default=200, help="Committed tokens per row before the trees.")
    parser.add_argument("--prompt-lengths", default="30,60,90,120,150,180,210,240",
                        help="Comma-separated prompt lengths of the prefill's rows (empty: no prefill timing).")
    parser.add_argument("--repeats", type=int, default=7, help="Runs of each, interleaved; the median is printed.")
    parser.add_argument("--generate-batches", default="",
                        help="Comma-separated batch sizes: time batched generation instead (see above).")
    parser.add_argument("--num-questions", type=int, default=16, help="MT-bench first turns (--generate-batches).")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="New tokens per answer (--generate-batches).")
    parser.add_argument("--clock", choices=list(CLOCKS), default="cpu",
                        help="cpu: the process's CPU time (robust to other jobs' load; run with one torch thread); "
                        "wall: elapsed time (an idle machine).")
    parser.add_argument("--base-model", default=None, help="Base model (default: the embedded pair's).")
    parser.add_argument("--ea-model", default=None, help="EAGLE head (default: the embedded pair's).")
    args = parser.parse_args(argv)
    _clock[0] = CLOCKS[args.clock]
    model = EaModel.from_pretrained(base_model_path=args.base_model, ea_model_path=args.ea_model)
    target = model.engine.target
    print(f"{torch.get_num_threads()} torch threads, {args.clock} time, median of {args.repeats}")
    if args.generate_batches:
        compare_generation(model, args)
        return
    sizes = [int(n) for n in args.tree_sizes.split(",")]
    torch.manual_seed(0)
    time_verify(target, sizes, args.prefix)  # warm-up
    runs = [time_verify(target, sizes, args.prefix) for _ in range(args.repeats)]
    uniform = [time_verify(target, [min(sizes)] * len(sizes), args.prefix)["computed"] for _ in range(args.repeats)]
    verify = median_ms(runs)
    print(f"ms: verify, trees {sizes} ({sum(sizes)} real rows of {len(sizes) * max(sizes)}): padding skipped "
          f"{verify['skipped']:.1f}, computed {verify['computed']:.1f}; every tree of {min(sizes)} nodes "
          f"{1e3 * statistics.median(uniform):.1f}")
    if args.prompt_lengths:
        lengths = [int(n) for n in args.prompt_lengths.split(",")]
        time_prefill(target, lengths)  # warm-up
        prefill = median_ms([time_prefill(target, lengths) for _ in range(args.repeats)])
        print(f"ms: prefill, prompts {lengths} ({sum(lengths)} real rows of {len(lengths) * max(lengths)}): padding "
              f"skipped {prefill['skipped']:.1f}, computed {prefill['computed']:.1f}")


if __name__ == "__main__":
    main()
