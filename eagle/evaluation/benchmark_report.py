"""Writing the benchmark's results: ``results.json``, ``report.md`` and PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import json
import os

from .llamacpp import report_lines as llamacpp_report_lines
from .load import POLICY, split_variant, variant_label

RESULTS_FILE = "results.json"
REPORT_FILE = "report.md"
LABELS_BY_METHOD = {"hf_generate": "HF generate", "hf_generate_unpacked": "HF generate, unpacked weights",
                    "plain": "plain decoding"}
PLOTS = {
    "speedup_by_category": "speedup_by_category.png",
    "accept_lengths": "accept_lengths.png",
    "tokens_per_second": "tokens_per_second.png",
}


def _reference_label(key: str) -> str:
    method, setting = split_variant(key)
    return variant_label(LABELS_BY_METHOD.get(method, method), setting)


def _f(value, digits=2, suffix="") -> str:
    return "-" if value is None else f"{value:.{digits}f}{suffix}"


def write_outputs(results: dict, output_dir: str) -> dict:
    """Write the JSON, the plots and the Markdown report into ``output_dir``; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    files = {"results": os.path.join(output_dir, RESULTS_FILE), "report": os.path.join(output_dir, REPORT_FILE)}
    files.update(write_plots(results, output_dir))
    # the saved results name their files relative to the output directory (no path of this machine)
    results["files"] = {k: os.path.basename(v) for k, v in files.items()}
    with open(files["results"], "w", encoding="utf-8") as f:
        json.dump(results, f, indent=2, ensure_ascii=False)
    results["files"] = files
    with open(files["report"], "w", encoding="utf-8") as f:
        f.write(markdown_report(results, {k: os.path.basename(v) for k, v in files.items()}))
    return files


def write_plots(results: dict, output_dir: str) -> dict:
    """The three plots; returns ``{name: path}`` of the ones written (none needs EAGLE but the histogram)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display; set here, never at import time
    import matplotlib.pyplot as plt

    written = {}
    for name, draw in (("speedup_by_category", _plot_speedups), ("accept_lengths", _plot_accept_lengths),
                       ("tokens_per_second", _plot_tokens_per_second)):
        fig = draw(plt, results)
        if fig is None:
            continue
        fig.tight_layout()
        written[name] = os.path.join(output_dir, PLOTS[name])
        fig.savefig(written[name], dpi=120)
        plt.close(fig)
    return written


def _plot_speedups(plt, results: dict):
    """Speed-up of each method over the reference method, per category (None with no other method)."""
    methods, reference = list(results["methods"]), results["reference_method"]
    categories = list(results["per_category"])
    others = [m for m in methods if m != reference]
    if not others:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(categories) + 2), 4.2))
    width = 0.8 / len(others)
    for i, method in enumerate(others):
        values = [results["per_category"][c]["speedup"][method] or 0.0 for c in categories]
        positions = [c + (i - (len(others) - 1) / 2) * width for c in range(len(categories))]
        ax.bar(positions, values, width, label=results["methods"][method]["label"])
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(categories)), categories, rotation=30, ha="right")
    ax.set_ylabel(f"speed-up over {results['methods'][reference]['label']}")
    ax.set_title("Speed-up per category (ratio of total tokens/s)")
    ax.legend(fontsize=8)
    return fig


def _plot_accept_lengths(plt, results: dict):
    """Distribution of EAGLE's accepted lengths per draft/verify step (None without EAGLE)."""
    acceptance = results.get("acceptance")
    if not acceptance or not acceptance["histogram"]:
        return None
    lengths = [int(a) for a in acceptance["histogram"]]
    counts = [acceptance["histogram"][str(a)] for a in lengths]
    total = sum(counts)
    fig, ax = plt.subplots(figsize=(6.0, 4.0))
    ax.bar(lengths, [c / total for c in counts], color="tab:orange")
    ax.axvline(acceptance["mean_accept_length"], color="black", linestyle="--",
               label=f"mean {acceptance['mean_accept_length']:.2f} (tau {acceptance['tau']:.2f})")
    ax.set_xticks(range(min(lengths), max(lengths) + 1))
    ax.set_xlabel("accepted draft tokens per step")
    ax.set_ylabel("fraction of steps")
    ax.set_title(f"EAGLE accepted lengths ({total} steps)")
    ax.legend()
    return fig


def _plot_tokens_per_second(plt, results: dict):
    """Tokens/s per method: the overall rate (bar) and every question's rate (dots)."""
    methods = list(results["methods"])
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(methods)), 4.0))
    for i, method in enumerate(methods):
        ax.bar(i, results["methods"][method]["tokens_per_s"] or 0.0, color=f"C{i}", alpha=0.8)
        rates = [q["methods"][method]["tokens_per_s"] for q in results["per_question"]]
        rates = [r for r in rates if r is not None]
        ax.scatter([i] * len(rates), rates, color="black", s=8, zorder=3)
    ax.set_xticks(range(len(methods)), [results["methods"][m]["label"] for m in methods], rotation=15, ha="right")
    ax.set_ylabel("tokens/s")
    ax.set_title("Tokens per second (bars: all tokens / all seconds; dots: questions)")
    return fig


def markdown_report(results: dict, files: dict) -> str:
    """The benchmark as Markdown: settings, overall table, per-category table, acceptance, greedy check, plots and
    how it was measured. ``files``: name -> file name (relative to the report) of each plot."""
    lines = _settings_lines(results) + _load_lines(results["settings"]) + _overall_lines(results)
    lines += _thread_lines(results.get("threads")) + _category_lines(results)
    lines += _acceptance_lines(results.get("acceptance")) + _greedy_check_lines(results.get("greedy_check"))
    lines += llamacpp_report_lines(results.get("llamacpp"), results["settings"]["temperature"])
    lines += _plot_lines(files) + _method_lines(results["settings"])
    return "\n".join(lines)


def _settings_lines(results: dict) -> list[str]:
    s = results["settings"]
    lines = [
        "# EAGLE benchmark",
        "",
        f"{s['num_questions']} questions of `{s['bench_name'] if not s['question_file'] else s['question_file']}` "
        f"(first turns), up to {s['max_new_tokens']} new tokens, temperature {s['temperature']}, on "
        f"{s['device']} ({s['processor']}, {s['torch_threads']} threads), {s['dtype']}, {s['date']}.",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    for key in ("base_model_path", "ea_model_path", "use_eagle3", "total_token", "depth", "top_k", "lookup_tokens",
                "prompt_lookup_num_tokens", "template", "warmup", "seed", "torch_version", "transformers_version",
                "packed_cpu_linear_layers", "draft_dtype", "thread_settings", "thread_policy", "policy_threads",
                "policy_changes"):
        if key in s:
            lines.append(f"| {key} | `{s.get(key)}` |")
    return lines


def _load_lines(s: dict) -> list[str]:
    """What ran beside the benchmark (``--busy``)."""
    busy = s.get("busy") or {}
    if not busy.get("processes"):
        return []
    shares = ", ".join("-" if share is None else f"{share:.2f}" for share in busy.get("cpu_share") or [])
    return ["", f"**Under load:** {busy['processes']} busy process{'es' * (busy['processes'] != 1)} of the "
            "benchmark's own (Python busy loops at normal priority) ran through the warm-up and every timed call "
            f"({_f(busy.get('seconds'), 0)} s; CPU share each: {shares or '-'}; load average before "
            f"{busy.get('load_average_before')}, after {busy.get('load_average_after')})."]


def _thread_lines(threads: dict | None) -> list[str]:
    """``--threads``: each method's tokens/s at every setting, and the policy against the best fixed count."""
    if not threads:
        return []
    settings = list(dict.fromkeys(s for row in threads.values() for s in row["tokens_per_s"]))
    names = [variant_label("", s).lstrip(", ") for s in settings]
    lines = ["", "## Thread counts under the same load (tokens/s)", "",
             "| method | " + " | ".join(names) + " | best fixed | policy / best fixed |",
             "|---|" + "---:|" * (len(settings) + 2)]
    for method, row in threads.items():
        cells = [_f(row["tokens_per_s"].get(s)) for s in settings]
        best = row["best_fixed"]
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {best or '-'} | "
                     f"{_f(row['policy_vs_best_fixed'], 2, 'x')} |")
    if POLICY in settings:
        lines += ["", "'thread policy' is every default: the engine's methods choose their thread count as they run "
                  "(eagle.utils.threads); the Hugging Face methods run at torch's default count."]
    return lines


def _overall_lines(results: dict) -> list[str]:
    methods = list(results["methods"])
    reference = results["reference_method"]
    unpacked = "hf_generate_unpacked" in methods
    versus_hf = reference != "hf_generate"  # a second speed-up column, unless HF generate is the reference itself
    lines = [
        "",
        "## Overall",
        "",
        f"| method | tokens | seconds | tokens/s | speed-up vs {results['methods'][reference]['label']} | "
        + ("speed-up vs HF generate | " if versus_hf else "")
        + ("speed-up vs HF generate, unpacked weights | " if unpacked else "")
        + "tokens per target forward | resident MB |",
        "|---|---:|---:|---:|---:|" + ("---:|" if versus_hf else "") + ("---:|" if unpacked else "") + "---:|---:|",
    ]
    for method in methods:
        row = results["methods"][method]
        lines.append(
            f"| {row['label']} | {row['new_tokens']} | {_f(row['wall_time'])} | {_f(row['tokens_per_s'])} | "
            f"{_f(row.get('speedup_vs_' + reference), 2, 'x')} | "
            + (f"{_f(row.get('speedup_vs_hf_generate'), 2, 'x')} | " if versus_hf else "")
            + (f"{_f(row.get('speedup_vs_hf_generate_unpacked'), 2, 'x')} | " if unpacked else "")
            + f"{_f(row['tokens_per_forward'])} | {_mb(row.get('resident_bytes'))} |"
        )
    lines += ["", "resident MB: the weights each method computes with (target and head, each storage once); for "
              "llama.cpp, its server process's resident set."]
    return lines


def _mb(value) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _category_lines(results: dict) -> list[str]:
    methods = list(results["methods"])
    reference = results["reference_method"]
    others = [m for m in methods if m != reference]
    lines = ["", f"## Per category (speed-up over {results['methods'][reference]['label']})", ""]
    header = "| category | questions | " + " | ".join(results["methods"][m]["label"] for m in others)
    tau = any("eagle_tau" in row for row in results["per_category"].values())
    header += " | EAGLE tau |" if tau else " |"
    lines += [header, "|---|---:|" + "---:|" * (len(others) + tau)]
    for category, row in results["per_category"].items():
        cells = [f"**{category}**" if category == "overall" else category, str(row["questions"])]
        cells += [_f(row["speedup"][m], 2, "x") for m in others]
        if tau:
            cells.append(_f(row.get("eagle_tau")))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _acceptance_lines(acceptance: dict | None) -> list[str]:
    if not acceptance:
        return []
    lines = [
        "",
        "## Acceptance (EAGLE)",
        "",
        f"{acceptance['steps']} draft/verify steps; mean accepted draft tokens per step "
        f"{_f(acceptance['mean_accept_length'], 3)}; tau (tokens per step, accepted + 1) {_f(acceptance['tau'], 3)}.",
        "",
        "| accepted length | steps |",
        "|---:|---:|",
    ]
    lines += [f"| {a} | {n} |" for a, n in acceptance["histogram"].items()]
    lines += ["", "alpha_k = P(accept >= k+1 | accept >= k):", "", "| depth k | reached | accepted | alpha |",
              "|---:|---:|---:|---:|"]
    lines += [f"| {r['depth']} | {r['reached']} | {r['accepted']} | {_f(r['alpha'], 3)} |" for r in acceptance["alpha"]]
    return lines


def _greedy_check_lines(check: dict | None) -> list[str]:
    if check is None:
        return ["", "## Greedy check", "", "Not run (sampling, or a single method measured)."]
    reference = _reference_label(check["reference"])
    lines = ["", f"## Greedy check (every method vs {reference})", ""]
    if not check["mismatches"]:
        return lines + [f"Every method's tokens equal {reference}'s in all {check['checked']} runs "
                        "(questions x methods)."]
    lines.append(
        f"Of {check['checked']} runs (questions x methods), {check['identical']} are identical to {reference}, "
        f"{check['near_ties']} part at a numerical near-tie (logit gap of the two tokens at most "
        f"{check['tolerance']:g}) and {check['differences']} differ.")
    lines += ["", "| question | method | first different token | kind | logit gap | method tokens | reference tokens "
              "| method text | reference text |", "|---:|---|---:|---|---:|---:|---:|---|---|"]
    for m in check["mismatches"]:
        lines.append(f"| {m['question_id']} | {m['method']} | {m['first_difference']} | {m['kind']} | "
                     f"{_f(m['logit_gap'], 4)} | {m['method_tokens']} | {m['reference_tokens']} "
                     f"| {_md(m['method_text'])} | {_md(m['reference_text'])} |")
    return lines


def _plot_lines(files: dict) -> list[str]:
    lines = ["", "## Plots", ""]
    for name in PLOTS:
        if name in files:
            lines += [f"![{name}]({files[name]})", ""]
    return lines


def _method_lines(s: dict) -> list[str]:
    return [
        "## How this was measured",
        "",
        "Every question runs all methods before the next one starts, in an order rotated from question to question. "
        f"Each method first ran {s['warmup']} untimed warm-up generation(s) of the first question. The device is "
        "synchronised before and after each timed call. Speeds are all tokens / all seconds (ratios of totals). "
        "EAGLE is timed through its generation loop's steps (`generate_steps`, which `eagenerate` consumes), from "
        "which the accepted length of every step is read; Hugging Face methods are timed around `generate` (with a "
        "neutral generation config: no checkpoint default changes the decoding), and their target forward passes "
        "are counted with a forward hook.",
        "",
        "Reproduce: `python -m eagle.evaluation.benchmark` (see `--help`).",
        "",
    ]


def _md(text: str) -> str:
    return "`" + text.replace("`", "'").replace("|", "\\|").replace("\n", "\\n") + "`"


def summary_lines(results: dict) -> list[str]:
    """A short plain-text summary for the terminal."""
    reference = results["reference_method"]
    lines = [f"{'method':<36}{'tokens/s':>10}{'speed-up':>10}"]
    for method, row in results["methods"].items():
        lines.append(f"{row['label']:<36}{_f(row['tokens_per_s']):>10}{_f(row.get('speedup_vs_' + reference), 2, 'x'):>10}")
    for method, row in (results.get("threads") or {}).items():
        lines.append(f"{method}: policy {_f(row['policy_vs_best_fixed'], 2, 'x')} the speed of the best fixed thread "
                     f"count ({row['best_fixed']})")
    acceptance = results.get("acceptance")
    if acceptance and acceptance["steps"]:
        lines.append(f"EAGLE mean accepted length {acceptance['mean_accept_length']:.3f}, tau {acceptance['tau']:.3f}")
    check = results.get("greedy_check")
    if check is not None:
        reference = _reference_label(check["reference"])
        lines.append(
            f"greedy check: {check['identical']}/{check['checked']} answers identical to {reference}"
            + ("" if not check["mismatches"] else
               f"; {check['near_ties']} near-ties, {check['differences']} real differences on "
               f"{sorted({m['question_id'] for m in check['mismatches'] if m['kind'] != 'near-tie'})}")
        )
    llama = results.get("llamacpp") or {}
    lines += llama.get("notes", [])
    if llama.get("acceptance"):
        lines.append(f"llama.cpp + our head: {llama['acceptance']['accepted_fraction']:.3f} of drafted tokens accepted")
    if llama.get("greedy_check"):
        check, threads = llama["greedy_check"], llama.get("threads")
        rows = (check.get("one_thread") or {}).get("questions", [])
        lines.append(f"llama.cpp greedy check: {check['identical']}/{check['checked']} answers with our head identical "
                     f"to its plain decoding ({threads} thread{'s' * (threads != 1)})"
                     + (f"; of the other {len(rows)}, {sum(r['equals_one_thread_plain'] for r in rows)} identical to "
                        "its plain decoding with 1 thread" if rows else ""))
    lines.append("wrote " + ", ".join(results["files"].values()))
    return lines
