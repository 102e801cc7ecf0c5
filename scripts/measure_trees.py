"""Tree settings side by side: EAGLE with the head's own tree, with the tree ``total_token=-1`` tunes, with a
hand-given tree and with the reference's 60/7/10, against Hugging Face ``generate``, interleaved question by
question in one run (the benchmark compares one EAGLE configuration at a time).

    python scripts/measure_trees.py --num-questions 8 --max-new-tokens 128
    python scripts/measure_trees.py --base-model-path BASE --ea-model-path HEAD --hand 8/2/4/16

Greedy; MT-bench first turns taken round-robin over categories; every method runs on the same model object
(the same packed weights), the order rotated from question to question; speeds are ratios of totals. The
tuner's own time (calibration and timing, or a cache hit) is printed too; ``--fresh`` ignores its cache.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from eagle.cli import resolve_model_args
from eagle.evaluation.methods import eagle_generate, engine_stop_ids, hf_generate, hf_generation_config
from eagle.evaluation.questions import load_questions, spread_over_categories
from eagle.evaluation.simulate import parse_trees
from eagle.model.tuning import autotune
from eagle.model.ea_model import EaModel
from eagle.model.tuning.head_tree import REFERENCE_TREE
from eagle.templates import encode_prompt, get_template


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--base-model-path", default=None, help="Target model (default: the embedded one).")
    parser.add_argument("--ea-model-path", default=None, help="Draft head (default: the embedded one).")
    parser.add_argument("--num-questions", type=int, default=8, help="MT-bench first turns.")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="New tokens per answer at most.")
    parser.add_argument("--hand", default="8/2/4/16", help="A hand-tuned total_token/depth/top_k/lookup tree.")
    parser.add_argument("--fresh", action="store_true", help="Tune again instead of reading the tuner's cache.")
    parser.add_argument("--configs", default="head,tuned,hand,reference",
                        help="EAGLE configurations to run: head (the head's own tree), tuned (total_token=-1), "
                        "hand (--hand), reference (60/7/10).")
    return parser


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    names = {"head": "eagle_head_tree", "tuned": "eagle_tuned", "hand": "eagle_hand", "reference": "eagle_60_7_10"}
    wanted = [part.strip() for part in args.configs.split(",") if part.strip()]
    if not wanted or set(wanted) - set(names):
        raise SystemExit(f"--configs: expected a comma-separated subset of {', '.join(names)}, got {args.configs!r}.")
    resolve_model_args(args)
    model = EaModel.from_pretrained(base_model_path=args.base_model_path, ea_model_path=args.ea_model_path)
    tuned = None
    if "tuned" in wanted:
        start = time.perf_counter()
        tuned = autotune.tune_tree(model, {}, use_cache=not args.fresh)
        print(f"tuner: {time.perf_counter() - start:.1f} s")
    trees = {"eagle_head_tree": model.tree_settings, "eagle_tuned": tuned, "eagle_hand": parse_trees(args.hand)[0],
             "eagle_60_7_10": REFERENCE_TREE}
    trees = {names[w]: trees[names[w]] for w in wanted}
    template = get_template("auto")
    stop_ids = engine_stop_ids(model.tokenizer, model.base_model, model, template.is_llama3)
    hf_config = hf_generation_config(max_new_tokens=args.max_new_tokens, stop_ids=stop_ids)
    methods = ["hf_generate", *trees]
    totals = {m: [0, 0.0] for m in methods}
    mismatches = 0
    questions = spread_over_categories(load_questions("mt_bench", None), args.num_questions)
    for index, question in enumerate([questions[0]] + questions):  # the first run of each method warms up
        ids = torch.tensor([encode_prompt(template, model.tokenizer, [(question["turns"][0], None)])])
        outputs = {}
        for method in methods[index % len(methods):] + methods[: index % len(methods)]:
            if method == "hf_generate":
                result = hf_generate(model.base_model, ids, hf_config, stop_ids)
            else:
                s = trees[method]
                model.set_tree(s.total_token, s.depth, s.top_k, s.lookup_tokens)
                result = eagle_generate(model, ids, max_new_tokens=args.max_new_tokens)
            outputs[method] = result.new_ids
            if index:
                totals[method][0] += result.new_tokens
                totals[method][1] += result.wall_time
        mismatches += sum(outputs[m] != outputs["hf_generate"] for m in trees)
        print(f"question {index}/{len(questions)} done", flush=True)
    hf_rate = totals["hf_generate"][0] / totals["hf_generate"][1]
    print("| method | tree | tokens | seconds | tokens/s | vs HF generate |\n|---|---|---:|---:|---:|---:|")
    for method in methods:
        tokens, seconds = totals[method]
        s = trees.get(method)
        tree = f"{s.total_token}/{s.depth}/{s.top_k}/{s.lookup_tokens}" if s else "-"
        print(f"| {method} | {tree} | {tokens} | {seconds:.1f} | {tokens / seconds:.2f} | "
              f"{tokens / seconds / hf_rate:.2f}x |")
    print(f"greedy outputs different from HF generate: {mismatches} (of {len(questions) * len(trees)})")


if __name__ == "__main__":
    main()
