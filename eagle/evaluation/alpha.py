"""Acceptance rate at each draft depth, from answer files.

    python -m eagle.evaluation.alpha mt_bench/ea.jsonl [more.jsonl ...]

The n-alpha of the EAGLE papers: ``alpha_k = P(accept >= k + 1 | accept >= k)``, the chance that the draft
token at depth k is accepted given the k before it were, computed from the accepted length of every
draft/verify step that the answer scripts record (``accept_lengths``). Files written by the reference's
``gen_ea_alpha_*`` scripts (per-choice ``alpha`` / ``alpha_num`` counts) are read too.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Iterable

from .answers import read_answer_file


def alpha_from_accept_lengths(accept_lengths: Iterable[int], max_depth: int | None = None) -> list[dict]:
    """Rows ``{"depth": k, "reached": #(a >= k), "accepted": #(a >= k + 1), "alpha": ratio or None}`` for
    k = 0 .. K - 1, K being ``max_depth`` or the longest accepted length observed."""
    counts = Counter(int(a) for a in accept_lengths)
    if any(a < 0 for a in counts):
        raise ValueError("Accepted lengths cannot be negative.")
    longest = max(counts, default=0)
    depth_count = longest if max_depth is None else max_depth
    rows = []
    for k in range(depth_count):
        reached = sum(n for a, n in counts.items() if a >= k)
        accepted = sum(n for a, n in counts.items() if a >= k + 1)
        rows.append({"depth": k, "reached": reached, "accepted": accepted,
                     "alpha": accepted / reached if reached else None})
    return rows


def alpha_from_counts(alpha: list[float], alpha_num: list[float]) -> list[dict]:
    """The same rows from the reference's summed ``alpha`` (accepted) / ``alpha_num`` (reached) counts."""
    return [
        {"depth": k, "reached": reached, "accepted": accepted, "alpha": accepted / reached if reached else None}
        for k, (accepted, reached) in enumerate(zip(alpha, alpha_num))
    ]


def analyse(paths: list[str], max_depth: int | None = None) -> dict:
    """Accepted-length histogram and alpha rows of one or more answer files."""
    accepts: list[int] = []
    alpha_sum: list[float] = []
    alpha_num_sum: list[float] = []
    for path in paths:
        for record in read_answer_file(path).values():
            for choice in record["choices"]:
                for per_turn in choice.get("accept_lengths", []):
                    accepts.extend(int(a) for a in per_turn)
                if "alpha" in choice and "alpha_num" in choice:
                    for target, values in ((alpha_sum, choice["alpha"]), (alpha_num_sum, choice["alpha_num"])):
                        target.extend([0] * (len(values) - len(target)))
                        for k, value in enumerate(values):
                            target[k] += value
    if accepts:
        rows = alpha_from_accept_lengths(accepts, max_depth)
        histogram = {str(a): n for a, n in sorted(Counter(accepts).items())}
        mean = sum(accepts) / len(accepts)
        return {"steps": len(accepts), "mean_accept_length": mean, "tau": mean + 1, "histogram": histogram,
                "alpha": rows}
    if alpha_num_sum:
        return {"steps": None, "mean_accept_length": None, "tau": None, "histogram": {},
                "alpha": alpha_from_counts(alpha_sum, alpha_num_sum)[:max_depth]}
    raise ValueError(
        f"{', '.join(paths)}: no accepted lengths found (expected 'accept_lengths' in the choices, as written by "
        "the gen_ea_answer_* scripts, or the reference's 'alpha'/'alpha_num')."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eagle.evaluation.alpha",
        description="Acceptance rate at each draft depth: alpha_k = P(accept >= k+1 | accept >= k), from the "
        "per-step accepted lengths in EAGLE answer files.",
    )
    parser.add_argument("files", nargs="+", help="Answer files written by gen_ea_answer_* / gen_answer.")
    parser.add_argument("--max-depth", type=int, default=None,
                        help="Report depths 0 .. N-1 (default: up to the longest accepted length).")
    parser.add_argument("--json", action="store_true", help="Print the result as JSON.")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    try:
        result = analyse(args.files, args.max_depth)
    except (OSError, ValueError) as err:
        raise SystemExit(str(err)) from None
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        print()
        return result
    if result["steps"]:
        print(f"steps: {result['steps']}  mean accepted length: {result['mean_accept_length']:.3f}  "
              f"tau (tokens per step): {result['tau']:.3f}")
        print("accepted length histogram: " + ", ".join(f"{a}: {n}" for a, n in result["histogram"].items()))
    print(f"{'depth':>5}{'reached':>10}{'accepted':>10}{'alpha':>8}")
    for row in result["alpha"]:
        alpha = "-" if row["alpha"] is None else f"{row['alpha']:.3f}"
        print(f"{row['depth']:>5}{row['reached']:>10}{row['accepted']:>10}{alpha:>8}")
    return result


if __name__ == "__main__":
    main()
