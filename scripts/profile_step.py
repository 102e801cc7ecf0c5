"""Where the time of one EAGLE step goes: each part of the generation loop timed with ``time.perf_counter`` over
greedy answers to MT-bench first turns (one at a time, or ``--batch-size`` together), printed as milliseconds per step (a step = one target forward).

    python scripts/profile_step.py --num-questions 4 --max-new-tokens 128
    python scripts/profile_step.py --tree 8/1/4/16 --plain
    python scripts/profile_step.py --num-questions 16 --batch-size 8 --plain
    python scripts/profile_step.py --base-model-path ~/.cache/eagle/scale/2b/model-Q4_K_M.gguf \
        --ea-model-path ~/.cache/eagle/scale/2b/head --plain          # a widened pair (eagle.evaluation.scale)

The parts (nested: a line's time includes the lines indented below it):

- ``observe``: the drafter learning what was committed (the head pass over the newly committed tokens);
  ``propose``: the head's tree (``expand``: the other head passes; ``select``: the tree selection); each head pass
  (``head pass``, observe's included) and its draft logits (``draft logits``); ``lookup``: the prompt-lookup
  search and graft;
- ``verify``: the tree's target forward (``target forward``: the model itself and its attention mask);
- ``evaluate``: the greedy walk over the tree (with the logits rows it projects: ``LM-head rows``);
- ``commit``: the target KV cache compaction; ``next inputs``: the drafter's next inputs; ``prefill``: the prompts'
  prefills, shared out over the steps; ``rest``: the loop itself (the step minus everything above).

``--plain`` also times plain decoding over the same prompts (same loop, no drafter), for the cost of one plain
step. Timers wrap the engine's functions by name, so the numbers include a few microseconds of timer per call.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter, defaultdict

import torch

from eagle.cli import add_model_arguments, load_model_from_args
from eagle.evaluation.questions import load_questions, spread_over_categories
from eagle.model.drafting import eagle as eagle_drafter
from eagle.model.drafting import lookup
from eagle.model.engine import loop
from eagle.model.heads import draft_head
from eagle.model.base import target
from eagle.templates import encode_prompt, get_template

# (owner, attribute, label, indent)
PARTS = [
    (eagle_drafter.EagleDrafter, "observe", "observe", 0),
    (eagle_drafter.EagleDrafter, "propose", "draft", 0),
    (eagle_drafter.EagleDrafter, "_expand", "expand", 1),
    (eagle_drafter, "select_trees", "select", 1),
    (draft_head.DraftHead, "forward", "head pass", 1),
    (draft_head.Eagle3DraftHead, "compute_logits", "draft logits", 1),
    (lookup, "find_match", "lookup", 0),
    (lookup, "graft_chain", "lookup graft", 1),
    (loop, "verify_trees", "verify", 0),
    (target.Target, "_run", "target forward", 1),
    (target.Target, "attention_mask", "attention mask", 2),
    (loop, "evaluate_batch", "evaluate", 0),
    (target.Target, "project", "LM-head rows", 1),
    (loop, "commit_batch", "commit", 0),
    (loop, "step_result", "next inputs", 0),
    (loop, "stack_trees", "stack trees", 0),
    (loop, "prefill_step", "prefill", 0),
]
TOP_LEVEL = [label for _, _, label, indent in PARTS if indent == 0]


class Timers:
    def __init__(self):
        self.seconds, self.calls = defaultdict(float), Counter()
        self.tree_tokens = []

    def wrap(self, owner, name: str, label: str) -> None:
        function = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start
                self.calls[label] += 1

        setattr(owner, name, timed)

    def clear(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.tree_tokens.clear()


def install(timers: Timers) -> None:
    for owner, name, label, _ in PARTS:
        timers.wrap(owner, name, label)
    stack = loop.stack_trees

    def counted(trees):
        batch = stack(trees)
        timers.tree_tokens.append(batch.size)
        return batch

    loop.stack_trees = counted


def run(model, prompts, max_new_tokens: int, use_eagle: bool, batch_size: int = 1) -> tuple[int, int, float]:
    """(steps, tokens, seconds) over ``prompts`` (1-D id tensors), ``batch_size`` prompts per batch."""
    steps = tokens = 0
    seconds = 0.0
    for first in range(0, len(prompts), batch_size):
        start = time.perf_counter()
        for step in model.generate_batch_steps(prompts[first:first + batch_size], max_new_tokens=max_new_tokens,
                                               use_eagle=use_eagle):
            steps += 1
            tokens += sum(int(row.shape[0]) for row in step.tokens)
        seconds += time.perf_counter() - start
    return steps, tokens, seconds


def report(timers: Timers, steps: int, tokens: int, seconds: float) -> None:
    per_step = 1e3 * seconds / steps
    print(f"{steps} steps, {tokens} tokens ({tokens / steps:.2f} per step, prefills counted as steps), "
          f"{tokens / seconds:.2f} tokens/s, {per_step:.2f} ms per step, "
          f"{sum(timers.tree_tokens) / max(len(timers.tree_tokens), 1):.1f} tree tokens per verification")
    print("| part | ms per step | calls per step | share of the step |\n|---|---:|---:|---:|")
    for _, _, label, indent in PARTS:
        if label in timers.seconds:
            ms = 1e3 * timers.seconds[label] / steps
            print(f"| {'&nbsp;&nbsp;' * indent}{label} | {ms:.2f} | {timers.calls[label] / steps:.2f} | "
                  f"{ms / per_step:.1%} |")
    rest = per_step - sum(1e3 * timers.seconds[label] / steps for label in TOP_LEVEL)
    print(f"| rest | {rest:.2f} | | {rest / per_step:.1%} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--num-questions", type=int, default=4, help="MT-bench first turns, one per category.")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="New tokens per answer at most.")
    parser.add_argument("--tree", default=None,
                        help="total_token/depth/top_k/lookup_tokens (default: the head's own tree for the device).")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="Prompts generated together (each batch's tree: the head's batch trees, or --tree).")
    parser.add_argument("--plain", action="store_true", help="Also time plain decoding on the same prompts.")
    add_model_arguments(parser, tree=False, placement=False, quantization=False, drafter=False)
    args = parser.parse_args(argv)
    timers = Timers()
    install(timers)
    model = load_model_from_args(args)
    if args.tree:
        model.set_tree(*(int(part) for part in args.tree.split("/")))
    s = model.tree_for_batch(args.batch_size)
    print(f"tree {s.total_token}/{s.depth}/{s.top_k}/{s.lookup_tokens} at batch {args.batch_size}, "
          f"{torch.get_num_threads()} torch threads")
    template = get_template("auto")
    questions = spread_over_categories(load_questions("mt_bench", None), args.num_questions)
    prompts = [torch.tensor(encode_prompt(template, model.tokenizer, [(q["turns"][0], None)])) for q in questions]
    run(model, prompts[:args.batch_size], 16, True, args.batch_size)  # warm-up
    timers.clear()
    report(timers, *run(model, prompts, args.max_new_tokens, True, args.batch_size))
    if args.plain:
        timers.clear()
        steps, tokens, seconds = run(model, prompts, args.max_new_tokens, False, args.batch_size)
        print(f"plain decoding: {steps} steps, {1e3 * seconds / steps:.2f} ms per step, {tokens / seconds:.2f} "
              "tokens/s")


if __name__ == "__main__":
    main()
