"""Batch trees side by side: batched EAGLE with each given tree against Hugging Face batched ``generate`` on the
same left-padded batches, at each batch size, every configuration run ``--repeats`` times in turn in one process.

    python scripts/sweep_batch_trees.py --batch-sizes 4,8 --trees 2/0/1/0,3/1/2/0,4/1/3/0,8/2/4/0,8/2/4/16

Greedy; MT-bench first turns taken round-robin over categories, cut into batches of each size; every batch runs
every configuration in turn (the order rotated from batch to batch), one tree at a time set as the model's only
batch tree (``EaModel.set_batch_trees({2: tree})``), so every batch of two or more rows drafts with it. Speeds are total new tokens over total seconds; the ratio in brackets is
the geometric mean, over batches and repeats, of a tree's speed over HF's on the same batch in the same turn (what
to read on a loaded machine). What it prints is what chose the trees the embedded head carries in
``eagle_batch_tree`` (see docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import logging
import math

from eagle.cli import HelpFormatter, add_model_arguments, load_model_from_args, resolve_model_args
from eagle.evaluation.batch_benchmark import first_turn_prompts, left_pad, parse_batch_sizes, run_method
from eagle.evaluation.methods import engine_stop_ids
from eagle.evaluation.simulate import parse_trees

logger = logging.getLogger("sweep_batch_trees")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    add_model_arguments(parser, tree=False, quantization=False)
    parser.add_argument("--batch-sizes", default="4,8", help="Comma-separated batch sizes.")
    parser.add_argument("--trees", default="2/0/1/0,3/1/2/0,4/1/3/0,6/1/4/0,8/2/4/0,8/2/4/16",
                        help="Comma-separated total_token/depth/top_k/lookup trees.")
    parser.add_argument("--num-questions", type=int, default=16, help="MT-bench first turns.")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="New tokens per answer at most.")
    parser.add_argument("--repeats", type=int, default=2, help="Runs of every configuration, in turn.")
    return parser


def sweep(model, prompts, size: int, trees: dict, args, stop_ids, pad_id) -> dict[str, tuple[float, float]]:
    """{configuration: (mean tokens/s, geometric mean of its speed over HF's on the same batch)} at one batch size
    ("hf" is Hugging Face batched generate). Every batch runs every configuration in turn, in an order rotated
    from batch to batch, so a change of the machine's load hits them alike."""
    names = ["hf", *trees]
    totals = {name: [0.0, 0.0] for name in names}  # tokens, seconds
    log_ratios: dict[str, list[float]] = {name: [] for name in names}
    batches = [prompts[i : i + size] for i in range(0, len(prompts) - size + 1, size)]
    for turn, batch in enumerate(batches * args.repeats):
        ids, mask = left_pad(batch, pad_id)
        seconds = {}
        for name in names[turn % len(names):] + names[: turn % len(names)]:
            method = "hf_batched" if name == "hf" else "eagle_batched"
            if name != "hf":
                model.set_batch_trees({2: trees[name]})
            rows, seconds[name] = run_method(method, model, ids, mask, args.max_new_tokens, stop_ids)
            totals[name][0] += sum(len(r) for r in rows)
            totals[name][1] += seconds[name]
        for name in names:
            log_ratios[name].append(math.log(seconds["hf"] / seconds[name]))
        logger.info("batch %d, turn %d: %s", size, turn,
                    ", ".join(f"{name} {seconds['hf'] / seconds[name]:.2f}x" for name in names[1:]))
    return {name: (tokens / spent, math.exp(sum(log_ratios[name]) / len(log_ratios[name])))
            for name, (tokens, spent) in totals.items()}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    resolve_model_args(args)
    model = load_model_from_args(args)
    trees = dict(zip(args.trees.split(","), parse_trees(args.trees.replace("b", ""))))
    tokenizer = model.tokenizer
    stop_ids = engine_stop_ids(tokenizer, model.base_model, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    prompts = first_turn_prompts(tokenizer, args.num_questions)
    ids, mask = left_pad(prompts[:2], pad_id)
    run_method("hf_batched", model, ids, mask, 8, stop_ids)  # warm-up
    print("| batch | " + " | ".join(["HF batched generate", *trees]) + " |")
    print("|---:|" + "---:|" * (len(trees) + 1))
    for size in parse_batch_sizes(args.batch_sizes):
        speeds = sweep(model, prompts, size, trees, args, stop_ids, pad_id)
        cells = [f"{speeds['hf'][0]:.1f}"] + [f"{speeds[n][0]:.1f} ({speeds[n][1]:.2f}x)" for n in trees]
        print(f"| {size} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
