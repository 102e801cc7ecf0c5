"""Self-distilled training data: the target model answers prompts, and the conversations (its own answers) are
written as ShareGPT-style JSONL that ``eagle.traineagle3.main`` trains on.

Examples::

    # prompts written by the model itself (no dataset needed), 2000 two-turn conversations
    python -m eagle.traineagle3.gen_data --basepath MODEL_DIR_OR_GGUF --output data/train.jsonl \\
        --synthesize 2000 --turns 2 --max-new-tokens 384 --batch-size 16

    # regenerate the answers of a ShareGPT file, or answer MT-bench-format questions
    python -m eagle.traineagle3.gen_data --basepath MODEL --output out.jsonl --sharegpt sharegpt.json
    python -m eagle.traineagle3.gen_data --basepath MODEL --output out.jsonl --questions question.jsonl

    # one share of the prompts per machine (or GPU), then concatenate the outputs
    python -m eagle.traineagle3.gen_data --basepath MODEL --output data/part0.jsonl --synthesize 8000 --shard 0/4
    ...                                                    --output data/part3.jsonl --synthesize 8000 --shard 3/4

Every output line is ``{"id", "source", "conversations": [{"from": "human"|"gpt", "value"}...], "finished"}``
(``finished[i]`` is False where the i-th answer was cut by ``--max-new-tokens``). The run is resumable: an
existing output file is read first and the conversations it already holds are skipped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch

from eagle.utils.jsonl import read_jsonl

logger = logging.getLogger("eagle.traineagle3.gen_data")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eagle.traineagle3.gen_data",
        description="Generate self-distilled EAGLE-3 training data: the target model's own answers to prompts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--basepath", required=True, help="Target model: a local model directory, a .gguf file, "
                        "or a directory holding one .gguf.")
    parser.add_argument("--output", required=True, help="Output JSONL file (appended to; existing ids are skipped).")
    parser.add_argument("--sharegpt", action="append", default=[], help="ShareGPT-style JSON/JSONL file "
                        "(`conversations` with `from`/`value`); its user turns are answered anew. Repeatable.")
    parser.add_argument("--questions", action="append", default=[], help="Question file in the MT-bench JSONL "
                        "format (`turns`: list of user messages). Repeatable.")
    parser.add_argument("--synthesize", type=int, default=0, help="Number of conversations whose user prompts the "
                        "target writes itself from its chat template (no dataset needed).")
    parser.add_argument("--turns", type=int, default=1, help="User turns per conversation (at most; given "
                        "conversations may have fewer). Later turns see the model's earlier answers.")
    parser.add_argument("--limit", type=int, default=None, help="Use at most this many prompts from the files.")
    parser.add_argument("--max-new-tokens", type=int, default=384, help="Longest answer, in tokens.")
    parser.add_argument("--max-prompt-tokens", type=int, default=1024, help="Conversations whose prompt grows "
                        "beyond this many tokens stop there (counted and reported).")
    parser.add_argument("--batch-size", type=int, default=16, help="Conversations generated together.")
    parser.add_argument("--temperature", type=float, default=0.0, help="Answer temperature; 0 = greedy (best for "
                        "greedy acceptance).")
    parser.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling for answers when temperature > 0.")
    parser.add_argument("--prompt-temperature", type=float, default=0.9, help="Temperature for synthesized prompts.")
    parser.add_argument("--prompt-top-p", type=float, default=0.95, help="Nucleus sampling for synthesized prompts.")
    parser.add_argument("--prompt-max-tokens", type=int, default=64, help="Longest synthesized user message.")
    parser.add_argument("--seed", type=int, default=0, help="Seed for prompt synthesis and sampling.")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                        help="Target dtype; auto = float32 on CPU, bfloat16 on GPU.")
    parser.add_argument("--device", default=None, help="Device (default: cuda if available, else cpu).")
    parser.add_argument("--time-budget", type=float, default=None, help="Minutes: start no batch that would not end "
                        "within this long (model loading not counted) at the pace of the batches so far (a batch is "
                        "written only when done, so this keeps every started batch, where an outside `timeout` loses "
                        "the one in flight). Rerun with the same flags to continue.")
    parser.add_argument("--shard", type=parse_shard, default=(0, 1), metavar="I/N",
                        help="Answer only the I-th of N equal shares of the prompts (0 <= I < N; every I-th prompt "
                        "of the full list, so N machines with I = 0..N-1 cover each prompt once; concatenate their "
                        "outputs to train).")
    parser.add_argument("--log-level", default="INFO", help="Logging level.")
    return parser


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N), with 0 <= I < N."""
    try:
        index, count = (int(part) for part in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/N (e.g. 0/4), got {text!r}") from None
    if count < 1 or not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < N in I/N, got {text!r}")
    return index, count


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    return getattr(torch, name)


def _done_ids(path: str) -> set[str]:
    done = set()
    if os.path.isfile(path):
        for _, record in read_jsonl(path, skip_bad_lines=True):
            if isinstance(record, dict) and "id" in record:
                done.add(record["id"])
            else:
                logger.warning("Ignoring a line without an id in %s (an interrupted write?).", path)
    return done


class Stats:
    def __init__(self):
        self.answer_tokens = 0
        self.prompt_tokens_generated = 0
        self.dropped_synthesis = 0
        self.stopped_long_prompt = 0
        self.written = 0
        self.start = time.time()


def process_batch(model, tokenizer, items, args, stats: Stats, generator: torch.Generator) -> list[dict]:
    """Answer a batch of :class:`PromptItem`, turn by turn, and return the output records."""
    from .chat import ASSISTANT, SYSTEM, USER, end_of_turn_ids, render, user_end_ids, user_turn_prefix
    from .batch_generation import generate_batch
    from .prompts import clean_synthesized

    answer_stops = end_of_turn_ids(tokenizer)
    histories = [[{"role": SYSTEM, "content": item.system}] if item.system else [] for item in items]
    finished = [[] for _ in items]
    alive = list(range(len(items)))
    for turn in range(max(len(item.user_turns) for item in items)):
        alive = [i for i in alive if turn < len(items[i].user_turns)]
        need = [i for i in alive if items[i].user_turns[turn] is None]
        if need:
            texts = [user_turn_prefix(tokenizer, histories[i]) + items[i].seeds[turn] for i in need]
            outs = generate_batch(model, tokenizer, texts, args.prompt_max_tokens, user_end_ids(tokenizer),
                                  args.prompt_temperature, args.prompt_top_p, generator)
            for i, out in zip(need, outs):
                stats.prompt_tokens_generated += len(out.token_ids)
                text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
                cleaned = clean_synthesized(items[i].seeds[turn], text, out.finished)
                if cleaned is None and len(items[i].seeds[turn].split()) >= 3:
                    cleaned = items[i].seeds[turn]
                if cleaned is None:
                    stats.dropped_synthesis += 1
                    alive.remove(i)
                else:
                    items[i].user_turns[turn] = cleaned
        prompts, rows = [], []
        for i in alive:
            messages = histories[i] + [{"role": USER, "content": items[i].user_turns[turn]}]
            text = render(tokenizer, messages, add_generation_prompt=True)
            if len(tokenizer(text, add_special_tokens=False)["input_ids"]) > args.max_prompt_tokens:
                stats.stopped_long_prompt += 1
                continue
            prompts.append(text)
            rows.append(i)
        outs = generate_batch(model, tokenizer, prompts, args.max_new_tokens, answer_stops, args.temperature,
                              args.top_p, generator)
        for i, out in zip(rows, outs):
            stats.answer_tokens += len(out.token_ids)
            answer = tokenizer.decode(out.token_ids, skip_special_tokens=True)
            histories[i] += [{"role": USER, "content": items[i].user_turns[turn]}, {"role": ASSISTANT, "content": answer}]
            finished[i].append(out.finished)
        alive = rows
    records = []
    role_names = {USER: "human", ASSISTANT: "gpt", SYSTEM: "system"}
    for item, history, done in zip(items, histories, finished):
        if not done:
            continue
        conversation = [{"from": role_names[m["role"]], "value": m["content"]} for m in history]
        records.append({"id": item.id, "source": item.source, "conversations": conversation, "finished": done})
    return records


def _pending_items(args) -> tuple[list, set]:
    """The conversations this shard still has to write, and the ids already in ``--output``."""
    from .prompts import question_prompts, sharegpt_prompts, synthesized_items

    items = []
    for path in args.sharegpt:
        items += sharegpt_prompts(path, args.turns)
    for path in args.questions:
        items += question_prompts(path, args.turns)
    if args.limit is not None:
        items = items[: args.limit]
    if args.synthesize:
        items += synthesized_items(args.synthesize, args.turns, args.seed)
    if not items:
        raise SystemExit("No prompts: give --sharegpt and/or --questions files with at least one user turn, or "
                         "--synthesize N.")
    shard, shards = args.shard
    items = items[shard::shards]
    done = _done_ids(args.output)
    pending = [item for item in items if item.id not in done]
    print(f"{len(items)} conversations, {len(items) - len(pending)} already in {args.output}, {len(pending)} to go.")
    return pending, done


def _write_batches(model, tokenizer, pending: list, args, stats: Stats, generator) -> None:
    """Answer ``pending`` batch by batch, appending each batch's records to ``--output`` as it is done (within
    ``--time-budget``)."""
    from tqdm import tqdm

    batches_done = 0
    with open(args.output, "a", encoding="utf-8") as out, tqdm(total=len(pending), desc="conversations", unit="conv") as bar:
        for start in range(0, len(pending), args.batch_size):
            if args.time_budget is not None and batches_done:
                elapsed = time.time() - stats.start
                if elapsed + elapsed / batches_done > args.time_budget * 60:
                    print(f"--time-budget {args.time_budget:g} min: stopped after {batches_done} batches "
                          f"({elapsed:.0f}s); {len(pending) - start} conversations left for a rerun.")
                    break
            batch = pending[start : start + args.batch_size]
            records = process_batch(model, tokenizer, batch, args, stats, generator)
            for record in records:
                out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            stats.written += len(records)
            batches_done += 1
            bar.update(len(batch))
            elapsed = time.time() - stats.start
            bar.set_postfix(answer_tok_s=f"{stats.answer_tokens / max(elapsed, 1e-6):.1f}", written=stats.written)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .chat import require_chat_template
    from .frozen_target import load_target

    if args.turns < 1 or args.batch_size < 1 or args.max_new_tokens < 1:
        raise SystemExit("--turns, --batch-size and --max-new-tokens must be at least 1.")
    pending, done = _pending_items(args)
    if not pending:
        return 0
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model, tokenizer = load_target(args.basepath, _dtype(args.dtype, device), device)
    require_chat_template(tokenizer)
    torch.manual_seed(args.seed)
    generator = torch.Generator(device=device).manual_seed(args.seed + len(done))
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    stats = Stats()
    _write_batches(model, tokenizer, pending, args, stats, generator)
    elapsed = time.time() - stats.start
    print(
        f"Wrote {stats.written} conversations to {args.output} in {elapsed:.0f}s: {stats.answer_tokens} answer tokens "
        f"({stats.answer_tokens / max(elapsed, 1e-6):.1f} tokens/s), {stats.prompt_tokens_generated} synthesized prompt "
        f"tokens; {stats.dropped_synthesis} unusable synthesized prompts dropped; {stats.stopped_long_prompt} turns "
        f"stopped at --max-prompt-tokens."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
