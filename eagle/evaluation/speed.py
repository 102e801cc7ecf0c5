"""Speed of EAGLE against a baseline, from two answer files.

    python -m eagle.evaluation.speed --ea-file mt_bench/ea.jsonl --baseline-file mt_bench/baseline.jsonl

For the questions present in both files it prints, per category and overall: tokens/s of each (total new
tokens / total wall time, i.e. a ratio of totals, not a mean of per-question speeds), the speed-up (EAGLE
tokens/s ÷ baseline tokens/s), and EAGLE's acceptance: the mean accepted draft tokens per step and tau, the
mean tokens per draft/verify step (accepted drafts + 1). Token counts are the ``new_tokens`` the files
record; for old baseline files whose counts are all 0 (a reference bug) pass ``--tokenizer`` to count the
tokens of the answer texts instead.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from .answers import AnswerStats, answer_stats, read_answer_file
from .questions import load_questions

logger = logging.getLogger(__name__)

OVERALL = "overall"


def _group(stats: list[AnswerStats], categories: dict) -> dict[str, list[AnswerStats]]:
    groups: dict[str, list[AnswerStats]] = {}
    for item in stats:
        category = item.category or categories.get(item.question_id) or "all"
        groups.setdefault(str(category), []).append(item)
    return groups


def acceptance(stats: list[AnswerStats]) -> dict:
    """``mean_accept_length`` (accepted drafts per step) and ``tau`` (tokens per step = accepted + 1) from
    per-step accepted lengths; without them, tau = Σ new_tokens / Σ (idxs + 1) (exact for reference files)."""
    accepts = [a for item in stats for a in item.accept_lengths]
    if accepts:
        mean = sum(accepts) / len(accepts)
        return {"steps": len(accepts), "mean_accept_length": mean, "tau": mean + 1.0}
    passes = sum(item.forward_passes for item in stats)
    tokens = sum(item.new_tokens for item in stats)
    return {"steps": passes, "mean_accept_length": None, "tau": tokens / passes if passes else None}


def _rate(stats: list[AnswerStats]) -> tuple[int, float, float | None]:
    tokens = sum(item.new_tokens for item in stats)
    seconds = sum(item.wall_time for item in stats)
    return tokens, seconds, (tokens / seconds if seconds > 0 else None)


def compare(ea_records: dict, baseline_records: dict, categories: dict | None = None) -> dict:
    """Speed comparison of two ``read_answer_file`` results over their common questions.

    Returns ``{"questions": n, "only_in_ea": [...], "only_in_baseline": [...], "rows": {category: row}}``
    where ``rows[OVERALL]`` is the total and each row has ``ea_tokens``, ``ea_seconds``,
    ``ea_tokens_per_s``, the same three for the baseline, ``speedup`` and the EAGLE ``acceptance``.
    """
    categories = dict(categories or {})
    for qid, record in baseline_records.items():  # a category only the baseline file records still counts
        if record.get("category") is not None:
            categories.setdefault(qid, record["category"])
    common = [qid for qid in ea_records if qid in baseline_records]
    if not common:
        raise ValueError("The two answer files have no question_id in common.")
    ea = [answer_stats(ea_records[qid], "EAGLE file") for qid in common]
    base = {qid: answer_stats(baseline_records[qid], "baseline file") for qid in common}
    rows = {}
    groups = _group(ea, categories)  # one category per question: what the EAGLE file (or question file) says
    for category in sorted(groups) + [OVERALL]:
        ea_group = ea if category == OVERALL else groups[category]
        base_group = [base[item.question_id] for item in ea_group]
        ea_tokens, ea_seconds, ea_rate = _rate(ea_group)
        base_tokens, base_seconds, base_rate = _rate(base_group)
        rows[category] = {
            "questions": len(ea_group),
            "ea_tokens": ea_tokens, "ea_seconds": ea_seconds, "ea_tokens_per_s": ea_rate,
            "baseline_tokens": base_tokens, "baseline_seconds": base_seconds, "baseline_tokens_per_s": base_rate,
            "speedup": ea_rate / base_rate if ea_rate is not None and base_rate else None,
            "acceptance": acceptance(ea_group),
        }
    return {
        "questions": len(common),
        "only_in_ea": [qid for qid in ea_records if qid not in baseline_records],
        "only_in_baseline": [qid for qid in baseline_records if qid not in ea_records],
        "rows": rows,
    }


def recount_tokens(records: dict, tokenizer_path: str) -> None:
    """Replace every ``new_tokens`` entry with the token count of the answer text (no special tokens)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    for record in records.values():
        for choice in record["choices"]:
            choice["new_tokens"] = [len(tokenizer(text, add_special_tokens=False).input_ids) for text in choice["turns"]]


def _has_zero_counts(records: dict) -> bool:
    return all(sum(choice.get("new_tokens", [0])) == 0 for record in records.values() for choice in record["choices"])


def _format(value, digits=2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(result: dict) -> str:
    """The comparison as a fixed-width text table."""
    header = f"{'category':<14}{'questions':>10}{'EAGLE tok/s':>13}{'base tok/s':>12}{'speed-up':>10}{'accepted':>10}{'tau':>7}"
    lines = [header, "-" * len(header)]
    for category, row in result["rows"].items():
        acc = row["acceptance"]
        lines.append(
            f"{category:<14}{row['questions']:>10}{_format(row['ea_tokens_per_s']):>13}"
            f"{_format(row['baseline_tokens_per_s']):>12}{_format(row['speedup'], 3) + 'x':>10}"
            f"{_format(acc['mean_accept_length']):>10}{_format(acc['tau']):>7}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eagle.evaluation.speed",
        description="Speed-up of EAGLE over a baseline from two answer files (ratio of total tokens/s), "
        "per category, with EAGLE's mean accepted length.",
    )
    parser.add_argument("--ea-file", required=True, help="Answers written by a gen_ea_answer_* script.")
    parser.add_argument("--baseline-file", required=True, help="Answers written by a gen_baseline_answer_* script.")
    parser.add_argument("--question-file", default=None,
                        help="Questions giving each question's category, for answer files without 'category'.")
    parser.add_argument("--bench-name", default=None,
                        help="Read categories from this benchmark's installed questions (e.g. mt_bench).")
    parser.add_argument("--tokenizer", default=None,
                        help="Recount tokens from the answer texts of a file whose new_tokens are all 0.")
    parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        ea_records = read_answer_file(args.ea_file)
        baseline_records = read_answer_file(args.baseline_file)
    except (OSError, ValueError) as err:
        raise SystemExit(str(err)) from None
    for name, records in (("--ea-file", ea_records), ("--baseline-file", baseline_records)):
        if _has_zero_counts(records):
            if not args.tokenizer:
                raise SystemExit(
                    f"{name} records 0 new tokens everywhere (written by the reference's baseline scripts?). "
                    "Regenerate it with ours, or pass --tokenizer BASE_MODEL to count the answer texts' tokens."
                )
            recount_tokens(records, args.tokenizer)
    categories = {}
    if args.question_file or args.bench_name:
        questions = load_questions(args.bench_name or "mt_bench", args.question_file)
        categories = {q["question_id"]: q.get("category") for q in questions}
    try:
        result = compare(ea_records, baseline_records, categories)
    except ValueError as err:
        raise SystemExit(str(err)) from None
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
    else:
        print(f"EAGLE: {args.ea_file}\nbaseline: {args.baseline_file}\nquestions in both: {result['questions']}")
        for label, key in (("only in the EAGLE file", "only_in_ea"), ("only in the baseline file", "only_in_baseline")):
            if result[key]:
                print(f"ignored, {label}: {result[key]}")
        print(format_table(result))
        print("accepted = mean accepted draft tokens per step; tau = mean tokens per step (accepted + 1)")
    return result


if __name__ == "__main__":
    main()
