"""Replay greedy EAGLE against recorded answers: tokens per step of any tree setting, in seconds, without timing.

    python -m eagle.evaluation.simulate --trees 8/2/4/16,12/2/4/16      # the embedded default pair
    python -m eagle.evaluation.simulate --base-model-path BASE --ea-model-path HEAD --trees 60/7/10/0
    python -m eagle.evaluation.simulate --base-model-path BASE --write-tree HEAD   # tune, write into HEAD

Greedy verification accepts the longest tree path whose tokens are the target's own greedy continuation, so once
that continuation is known the target is no longer needed to say what a tree would have accepted. ``record``
(:mod:`eagle.model.tuning.replay`) runs
plain decoding once per prompt and one target forward over prompt + answer (the features the head reads);
``replay`` then runs the real drafter (head, tree selection, lookup branch) step by step and accepts what matches
the recorded answer. Each tree setting costs only the head's passes, so a dozen settings take about as long as
one benchmark method, and tau is what the generation loop would get (up to rounding differences between one
forward over the whole sequence and the loop's step-by-step forwards). Tokens per step are half the story on a
device where every verified tree token costs time: the report gives the mean tree size too, and the speed of the
settings worth having is then measured side by side with ``eagle.evaluation.benchmark``.
"""

from __future__ import annotations

import argparse
import json
import logging

import torch
from tqdm import tqdm

from eagle.cli import HelpFormatter, add_model_arguments, load_model_from_args
from eagle.model.drafting.settings import TreeSettings
from eagle.model.tuning.replay import Recording, Replay, record, replay  # noqa: F401  (their home before eagle.model.tuning.replay)
from eagle.templates import TEMPLATES, encode_prompt, get_template

from .questions import load_questions, spread_over_categories

logger = logging.getLogger(__name__)


def parse_trees(text: str) -> list[TreeSettings]:
    """``"8/2/4/16,12/2/4/16"`` -> tree settings (total_token/depth/top_k/lookup_tokens; lookup may be left out)."""
    trees = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        try:
            values = [int(v) for v in item.split("/")]
            if len(values) not in (3, 4):
                raise ValueError
        except ValueError:
            raise SystemExit(f"--trees: {item!r} is not total_token/depth/top_k[/lookup_tokens], e.g. 8/2/4/16.") from None
        try:
            trees.append(TreeSettings(*values))
        except ValueError as err:
            raise SystemExit(f"--trees: {err}") from None
    if not trees:
        raise SystemExit("--trees: give at least one tree, e.g. 8/2/4/16.")
    return trees


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eagle.evaluation.simulate",
        description="Tokens per draft/verify step (tau) and tree size of several tree settings, by replaying greedy "
        "EAGLE against answers recorded once with plain decoding (no timing; see the module docstring).",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(parser, tree=False, quantization=False, drafter=False)
    parser.add_argument("--trees", default="8/2/4/16",
                        help="Comma-separated total_token/depth/top_k[/lookup_tokens] settings to compare.")
    parser.add_argument("--bench-name", default="mt_bench", help="Questions of this benchmark.")
    parser.add_argument("--question-file", default=None, help="A FastChat-format question.jsonl instead.")
    parser.add_argument("--num-questions", type=int, default=16,
                        help="Questions (first turns), taken round-robin over categories.")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="Length of the recorded answers.")
    parser.add_argument("--template", default="auto", choices=sorted(TEMPLATES),
                        help="Prompt template ('auto' = the tokenizer's chat template).")
    parser.add_argument("--output", default=None, help="Also write the results as JSON here.")
    parser.add_argument("--write-tree", metavar="HEAD_DIR", default=None,
                        help="Instead of comparing --trees: tune the whole tree on this device (what "
                        "total_token=-1 does: size, depth, top-k and lookup branch from measured costs and the "
                        "head's acceptance on built-in prompts) and write it into HEAD_DIR/config.json "
                        "(eagle_tree, under this device's kind), so the head ships with its tree. HEAD_DIR is the "
                        "head; the base model is --base-model-path (default: the embedded one).")
    return parser


def write_tree(args) -> dict:
    """``--write-tree HEAD_DIR``: tune the tree of HEAD_DIR on this device and write it into the head."""
    from eagle.model.tuning.autotune import tune_tree
    from eagle.model.backends.gguf import kernel_numerics
    from eagle.model.tuning.head_tree import kernel_backend, read_head_trees, tree_kinds, write_head_tree

    if args.ea_model_path not in (None, args.write_tree):
        raise SystemExit("--write-tree HEAD_DIR names the head to tune; leave --ea-model-path out.")
    try:
        read_head_trees(args.write_tree)  # a head directory with a readable config, before loading anything
    except (OSError, ValueError) as err:
        raise SystemExit(f"--write-tree: {err}") from None
    args.ea_model_path = args.write_tree
    model = load_model_from_args(args)  # the base model not given: the embedded one
    settings = tune_tree(model, {}, use_cache=False)
    kind = tree_kinds(model.device, kernel_backend(kernel_numerics(model.base_model)))[0]
    path = write_head_tree(args.write_tree, kind, settings)
    tree = {"total_token": settings.total_token, "depth": settings.depth, "top_k": settings.top_k,
            "lookup_tokens": settings.lookup_tokens}
    print(f"Wrote the {kind} tree {tree} into {path}")
    return tree


def main(argv: list[str] | None = None) -> list[dict]:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    if args.write_tree:
        return [write_tree(args)]
    trees = parse_trees(args.trees)
    if args.max_new_tokens <= 0 or args.num_questions <= 0:
        raise SystemExit("--max-new-tokens and --num-questions must be positive.")
    try:
        questions = spread_over_categories(load_questions(args.bench_name, args.question_file), args.num_questions)
    except (OSError, ValueError) as err:
        raise SystemExit(str(err)) from None
    model = load_model_from_args(args)
    template = get_template(args.template)
    recordings = []
    for question in tqdm(questions, desc="recording greedy answers"):
        ids = encode_prompt(template, model.tokenizer, [(question["turns"][0], None)])
        recordings.append(record(model, torch.tensor([ids], dtype=torch.long, device=model.device),
                                 args.max_new_tokens))
    results = []
    for settings in tqdm(trees, desc="replaying"):
        replays = [replay(model.ea_layer, rec, settings) for rec in recordings]
        merged = Replay([a for r in replays for a in r.accept_lengths], [s for r in replays for s in r.tree_sizes])
        results.append({"total_token": settings.total_token, "depth": settings.depth, "top_k": settings.top_k,
                        "lookup_tokens": settings.lookup_tokens, "steps": len(merged.accept_lengths),
                        "tau": merged.tau, "mean_tree_size": merged.mean_tree_size})
    print(f"{len(recordings)} answers, {sum(r.tokens.shape[0] - r.prompt_length for r in recordings)} tokens")
    print("| total_token/depth/top_k/lookup | steps | tau (tokens per step) | tree tokens per step |")
    print("|---|---:|---:|---:|")
    for row in results:
        name = f"{row['total_token']}/{row['depth']}/{row['top_k']}/{row['lookup_tokens']}"
        print(f"| {name} | {row['steps']} | {row['tau']:.3f} | {row['mean_tree_size']:.2f} |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"questions": [q["question_id"] for q in questions], "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
