"""Batch trees side by side: batched EAGLE with each given tree against Hugging Face batched ``generate`` on the
same left-padded batches, at each batch size, every configuration run ``--repeats`` times in turn in one process.

    python scripts/sweep_batch_trees.py --batch-sizes 4,8 --trees 2/0/1/0,3/1/2/0,4/1/3/0,8/2/4/0,8/2/4/16

Greedy; MT-bench first turns taken round-robin over categories, cut into batches of each size; one tree at a time
is set as the model's only batch tree (``EaModel.set_batch_trees({2: tree})``), so every batch of two or more rows
drafts with it. Speeds are total new tokens over total seconds, the mean over repeats. What it prints is what
chose the trees the embedded head carries in ``eagle_batch_tree`` (see docs/PERFORMANCE.md).
"""

from __future__ import annotations

import argparse
import logging

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


def sweep(model, prompts, size: int, trees: dict, args, stop_ids, pad_id) -> dict[str, float]:
    """{configuration: mean tokens/s} at one batch size ("hf" is Hugging Face batched generate)."""
    speeds: dict[str, list[float]] = {}
    batches = [prompts[i : i + size] for i in range(0, len(prompts) - size + 1, size)]
    for _ in range(args.repeats):
        for name in ["hf", *trees]:
            method = "hf_batched" if name == "hf" else "eagle_batched"
            if name != "hf":
                model.set_batch_trees({2: trees[name]})
            tokens = seconds = 0.0
            for batch in batches:
                ids, mask = left_pad(batch, pad_id)
                rows, spent = run_method(method, model, ids, mask, args.max_new_tokens, stop_ids)
                tokens, seconds = tokens + sum(len(r) for r in rows), seconds + spent
            speeds.setdefault(name, []).append(tokens / seconds)
            logger.info("batch %d, %s: %.1f tokens/s", size, name, tokens / seconds)
    return {name: sum(v) / len(v) for name, v in speeds.items()}


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    resolve_model_args(args)
    model = load_model_from_args(args)
    trees = dict(zip(args.trees.split(","), parse_trees(args.trees)))
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
        cells = [f"{speeds['hf']:.1f}"] + [f"{speeds[n]:.1f} ({speeds[n] / speeds['hf']:.2f}x)" for n in trees]
        print(f"| {size} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
