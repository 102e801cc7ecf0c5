"""Batched throughput, side by side: batched EAGLE, Hugging Face batched ``generate`` and batch-1 EAGLE run one
prompt after the other, on the same left-padded batches of MT-bench first turns (greedy).

    python -m eagle.evaluation.benchmark --batch-size 1,4,8,16          # the embedded default pair
    python -m eagle.evaluation.batch_benchmark --batch-size 1,4 --num-questions 8 --max-new-tokens 64

For each batch size B the questions (``--num-questions``, spread over the categories) are cut into batches of B
(a last, smaller batch is left out), each rendered with the tokenizer's chat template and left-padded. For every
batch the methods run one after the other, in an order rotated from batch to batch, so drifts of the machine
hit them alike:

- ``eagle_batched``: ``EaModel.eagenerate(ids, attention_mask=mask)``, all rows in one call;
- ``hf_batched``: Hugging Face ``generate`` of the base model on the same ids and mask (a complete greedy
  ``GenerationConfig``, the engine's stop tokens; the same packed CPU weights as the engine);
- ``hf_batched_unpacked`` (only when the model has packed CPU weights): the same ``generate`` call on the linear
  layers as transformers loads them (the packing undone before the call and redone after it, outside the timed
  region), i.e. what a user of transformers alone gets;
- ``eagle_sequential``: ``EaModel.eagenerate`` of each prompt alone, one after the other.

Throughput is total new tokens (up to and including each row's stop token) / total seconds, per method and batch
size. It also counts the rows of the batched EAGLE output that equal the same prompt's batch-1 EAGLE output (they
all should: each row is lossless). Writes ``batch_results.json``, ``batch_report.md`` and ``batch_throughput.png``
into ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time

import torch
from tqdm import tqdm

from eagle.cli import HelpFormatter, add_model_arguments, load_model_from_args, resolve_model_args
from eagle.model.backends.onednn import pack_linear_layers, packed_layer_count, unpack_linear_layers
from eagle.templates import encode_prompt, get_template
from eagle.utils.device import synchronize

from .methods import engine_stop_ids, hf_generation_config
from .questions import load_questions, spread_over_categories

logger = logging.getLogger(__name__)

METHODS = ("eagle_batched", "hf_batched", "hf_batched_unpacked", "eagle_sequential")
LABELS = {"eagle_batched": "batched EAGLE", "hf_batched": "HF batched generate",
          "hf_batched_unpacked": "HF batched generate, unpacked weights",
          "eagle_sequential": "batch-1 EAGLE, one prompt after the other"}


def methods_for(model) -> tuple[str, ...]:
    """The methods timed for ``model``: ``hf_batched_unpacked`` only where the engine's CPU weights are packed
    (otherwise ``hf_batched`` already runs the weights as transformers loads them)."""
    if packed_layer_count(model.base_model):
        return METHODS
    return tuple(m for m in METHODS if m != "hf_batched_unpacked")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eagle.evaluation.benchmark --batch-size",
        description="Throughput of batched EAGLE against Hugging Face batched generate and batch-1 EAGLE, side by "
                    "side on the same left-padded batches of MT-bench first turns (greedy); writes "
                    "batch_results.json, batch_report.md and a plot of tokens/s against batch size.",
        formatter_class=HelpFormatter,
    )
    add_model_arguments(parser, quantization=False)
    parser.add_argument("--batch-size", required=True, help="Comma-separated batch sizes, e.g. 1,4,8,16.")
    parser.add_argument("--num-questions", type=int, default=None,
                        help="Questions cut into batches (default: the largest batch size).")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="New tokens per answer at most.")
    parser.add_argument("--warmup", type=int, default=1, help="Untimed runs of every method on the first batch.")
    parser.add_argument("--seed", type=int, default=0, help="torch.manual_seed before every timed call.")
    parser.add_argument("--output-dir", default="batch_benchmark", help="Where the results and the plot go.")
    return parser


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--batch-size takes comma-separated positive integers, got {text!r}.") from None
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-size takes comma-separated positive integers, got {text!r}.")
    return sizes


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def new_tokens_of(row: list[int], stop_ids: set[int]) -> list[int]:
    """A row's new tokens up to and including its first stop token."""
    for i, token in enumerate(row):
        if token in stop_ids:
            return row[: i + 1]
    return row


def run_method(method: str, model, ids, mask, max_new_tokens: int, stop_ids: list[int]):
    """Run ``method`` on one batch. Returns (each row's new tokens, seconds)."""
    if method == "hf_batched_unpacked":  # only the base model's layers: the head is not used here
        unpack_linear_layers(model.base_model)
        try:
            return run_method("hf_batched", model, ids, mask, max_new_tokens, stop_ids)
        finally:
            pack_linear_layers(model.base_model)
    width, stops = ids.shape[1], set(stop_ids)
    synchronize(model.device)
    start = time.perf_counter()
    if method == "eagle_batched":
        out = model.eagenerate(ids, attention_mask=mask, max_new_tokens=max_new_tokens)
        rows = [new_tokens_of(row[width:], stops) for row in out.tolist()]
    elif method == "hf_batched":
        config = hf_generation_config(max_new_tokens=max_new_tokens, stop_ids=stop_ids)
        out = model.base_model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        rows = [new_tokens_of(row[width:], stops) for row in out.tolist()]
    elif method == "eagle_sequential":
        rows = []
        for row_ids, row_mask in zip(ids, mask):
            prompt = row_ids[row_mask.bool()][None]
            rows.append(model.eagenerate(prompt, max_new_tokens=max_new_tokens)[0, prompt.shape[1]:].tolist())
    else:
        raise ValueError(f"Unknown method {method!r}; expected one of {', '.join(METHODS)}.")
    synchronize(model.device)
    return rows, time.perf_counter() - start


def measure(model, prompts: list[list[int]], sizes: list[int], args, stop_ids: list[int], pad_id: int) -> dict:
    """{batch size: {method: {"tokens", "seconds", "tokens_per_s"}, "rows_equal": n, "rows": n}}."""
    results: dict = {}
    methods = methods_for(model)
    first = prompts[: max(sizes)]
    for _ in range(args.warmup):
        ids, mask = left_pad(first[: min(4, len(first))], pad_id)
        for method in methods:
            run_method(method, model, ids, mask, min(16, args.max_new_tokens), stop_ids)
    for size in sizes:
        batches = [prompts[i : i + size] for i in range(0, len(prompts) - size + 1, size)]
        totals = {m: {"tokens": 0, "seconds": 0.0} for m in methods}
        equal = rows = 0
        for index, batch in enumerate(tqdm(batches, desc=f"batch size {size}")):
            ids, mask = left_pad(batch, pad_id)
            shift = index % len(methods)
            order = methods[shift:] + methods[:shift]
            outputs = {}
            for method in order:
                torch.manual_seed(args.seed + index)
                outputs[method], seconds = run_method(method, model, ids, mask, args.max_new_tokens, stop_ids)
                totals[method]["tokens"] += sum(len(r) for r in outputs[method])
                totals[method]["seconds"] += seconds
            equal += sum(a == b for a, b in zip(outputs["eagle_batched"], outputs["eagle_sequential"]))
            rows += len(batch)
        for method in methods:
            totals[method]["tokens_per_s"] = totals[method]["tokens"] / max(totals[method]["seconds"], 1e-9)
        results[size] = {**totals, "rows_equal": equal, "rows": rows}
        logger.info("batch size %d: %s", size, ", ".join(f"{m} {totals[m]['tokens_per_s']:.1f} tok/s" for m in methods))
    return results


def report_lines(results: dict) -> list[str]:
    unpacked = all("hf_batched_unpacked" in item for item in results.values())
    head = "| batch | batched EAGLE tok/s | HF batched generate tok/s | "
    rule = "|---|---|---|"
    if unpacked:
        head += "HF batched generate, unpacked weights tok/s | "
        rule += "---|"
    head += "batch-1 EAGLE tok/s | EAGLE / HF | "
    rule += "---|---|"
    if unpacked:
        head += "EAGLE / HF unpacked | "
        rule += "---|"
    lines = [head + "EAGLE / batch-1 EAGLE | rows equal to batch-1 |", rule + "---|---|"]
    for size, item in results.items():
        eagle, hf, one = (item[m]["tokens_per_s"] for m in ("eagle_batched", "hf_batched", "eagle_sequential"))
        plain = item["hf_batched_unpacked"]["tokens_per_s"] if unpacked else None
        cells = [str(size), f"{eagle:.1f}", f"{hf:.1f}"] + ([f"{plain:.1f}"] if unpacked else [])
        cells += [f"{one:.1f}", f"{eagle / hf:.2f}x"] + ([f"{eagle / plain:.2f}x"] if unpacked else [])
        cells += [f"{eagle / one:.2f}x", f"{item['rows_equal']}/{item['rows']}"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results)
    figure, axes = plt.subplots(figsize=(6, 4))
    for method in METHODS:
        if all(method in results[s] for s in sizes):
            axes.plot(sizes, [results[s][method]["tokens_per_s"] for s in sizes], marker="o", label=LABELS[method])
    axes.set_xlabel("batch size")
    axes.set_ylabel("total new tokens / s")
    axes.set_xticks(sizes)
    axes.legend()
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def first_turn_prompts(tokenizer, count: int) -> list[list[int]]:
    """The ids of ``count`` MT-bench first turns, taken round-robin over categories, in the model's template."""
    template = get_template("auto")
    questions = spread_over_categories(load_questions("mt_bench"), count)
    return [encode_prompt(template, tokenizer, [(q["turns"][0], None)]) for q in questions]


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    sizes = parse_batch_sizes(args.batch_size)
    if args.num_questions and args.num_questions < max(sizes):
        raise SystemExit(f"--num-questions {args.num_questions} cannot fill a batch of {max(sizes)}: give at least "
                         f"{max(sizes)} questions (or leave --num-questions out).")
    resolve_model_args(args)
    model = load_model_from_args(args)
    tokenizer = model.tokenizer
    stop_ids = engine_stop_ids(tokenizer, model.base_model, model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    prompts = first_turn_prompts(tokenizer, args.num_questions or max(sizes))
    results = measure(model, prompts, sizes, args, stop_ids, pad_id)
    os.makedirs(args.output_dir, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "max_new_tokens": args.max_new_tokens,
            "questions": len(prompts), "tree": dict(vars(model.tree_settings)),
            "batch_trees": {str(size): dict(vars(tree)) for size, tree in model.batch_trees.items()},
            "models": [os.path.basename(str(args.base_model_path)), os.path.basename(str(args.ea_model_path))]}
    with open(os.path.join(args.output_dir, "batch_results.json"), "w") as handle:
        json.dump({"meta": meta, "results": {str(k): v for k, v in results.items()}}, handle, indent=2)
    lines = report_lines(results)
    with open(os.path.join(args.output_dir, "batch_report.md"), "w") as handle:
        handle.write("# Batched throughput\n\n" + json.dumps(meta) + "\n\n" + "\n".join(lines) + "\n")
    plot(results, os.path.join(args.output_dir, "batch_throughput.png"))
    print("\n".join(lines))
    return results


if __name__ == "__main__":
    main()
