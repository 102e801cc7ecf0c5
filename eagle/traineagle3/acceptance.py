"""Measure a trained head: mean tokens per target forward pass (greedy) on MT-bench-format questions.

    python -m eagle.traineagle3.acceptance --basepath MODEL --ea-model-path runs/head/state_9 \\
        --questions question.jsonl --limit 20 --max-new-tokens 256

Every turn of every question is answered with ``EaModel.eagenerate(temperature=0)`` in a conversation that
carries the model's own earlier answers (as MT-bench does); the result is
``sum(new tokens) / sum(target forward passes)``, prefill counted. ``--check`` also runs plain decoding and
asserts the outputs are identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle.traineagle3.acceptance", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--basepath", required=True, help="Target model (directory, .gguf, or directory with one .gguf).")
    parser.add_argument("--ea-model-path", required=True, help="Head directory (config.json + model.safetensors).")
    parser.add_argument("--questions", required=True, help="Questions in the MT-bench JSONL format (`turns`).")
    parser.add_argument("--limit", type=int, default=None, help="Use the first N questions.")
    parser.add_argument("--turns", type=int, default=2, help="Turns per question (at most).")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="Longest answer per turn.")
    parser.add_argument("--total-token", type=int, default=60, help="Draft tree size (nodes verified per step).")
    parser.add_argument("--depth", type=int, default=7, help="Draft tree depth.")
    parser.add_argument("--top-k", type=int, default=10, help="Draft top-k per node.")
    parser.add_argument("--check", action="store_true", help="Also decode plainly and assert identical output.")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import torch
    from tqdm import tqdm

    from eagle.model.ea_model import EaModel

    from .prompts import read_json_records

    questions = read_json_records(args.questions)[: args.limit]
    if not questions:
        raise SystemExit(f"No questions in {args.questions}.")
    model = EaModel.from_pretrained(use_eagle3=True, base_model_path=args.basepath, ea_model_path=args.ea_model_path,
                                    total_token=args.total_token, depth=args.depth, top_k=args.top_k)
    tokenizer = model.tokenizer
    new_tokens = forwards = 0
    started = time.time()
    for question in tqdm(questions, desc="questions"):
        messages = []
        for turn in question["turns"][: args.turns]:
            messages.append({"role": "user", "content": turn})
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)["input_ids"]
            output, new, steps = model.eagenerate(ids, temperature=0.0, max_new_tokens=args.max_new_tokens, log=True)
            if args.check:
                plain = model.naivegenerate(ids, temperature=0.0, max_new_tokens=args.max_new_tokens)
                if not torch.equal(plain, output):
                    raise SystemExit(f"Speculative and plain greedy outputs differ on: {turn[:80]!r}")
            new_tokens += int(new)
            forwards += int(steps) + 1
            messages.append({"role": "assistant", "content": tokenizer.decode(output[0, ids.shape[1]:], skip_special_tokens=True)})
    elapsed = time.time() - started
    result = {"questions": len(questions), "new_tokens": new_tokens, "target_forwards": forwards,
              "tokens_per_forward": new_tokens / max(1, forwards), "tokens_per_s": new_tokens / elapsed}
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
