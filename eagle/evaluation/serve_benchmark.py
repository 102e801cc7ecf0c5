"""``python -m eagle.evaluation.serve_benchmark``: the HTTP server under load, EAGLE against plain decoding.

Loads the model once, then for each number of concurrent clients serves it on 127.0.0.1 (in this process,
uvicorn in a thread) with EAGLE and then with plain decoding, and lets that many client threads send streamed
greedy chat requests (MT-bench first turns, round robin) until each has sent ``--requests-per-client`` (more when
there are fewer clients than ``--min-requests``). Per run:
requests/s, generated tokens/s over the wall time, p50/p99 latency and time to first token, EAGLE's accepted
tokens per step. Writes ``serve_benchmark.json``, ``serve_benchmark.md`` (the table) and ``serve_benchmark.png``
to ``--output-dir``, and prints the table. Greedy answers of the two modes are compared prompt by prompt.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import json
import logging
import os
import platform
import threading
import time

import numpy as np

logger = logging.getLogger(__name__)

MODES = ("eagle", "plain")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from ..application.server import DEFAULT_EAGLE_MAX_BATCH_SIZE, add_model_arguments

    parser = argparse.ArgumentParser(
        prog="python -m eagle.evaluation.serve_benchmark",
        description="Benchmark the OpenAI-compatible server (python -m eagle.application.server) with EAGLE and "
        "with plain decoding side by side, at several numbers of concurrent clients: requests/s, tokens/s, "
        "p50/p99 latency and time to first token. Without model flags it uses the embedded default pair.")
    add_model_arguments(parser)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8, 16],
                        help="numbers of concurrent clients to measure (default: 1 4 8 16)")
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="requests each client sends per run (default 2)")
    parser.add_argument("--min-requests", type=int, default=8,
                        help="at least this many requests per run: clients send more when there are few of them "
                        "(default 8)")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request (default 64)")
    parser.add_argument("--num-prompts", type=int, default=16,
                        help="MT-bench first turns used, spread over categories, sent round robin (default 16)")
    parser.add_argument("--eagle-max-batch-size", type=int, default=DEFAULT_EAGLE_MAX_BATCH_SIZE,
                        help="the EAGLE server runs plain decoding when more requests than this run or wait (0 = "
                        f"never; default {DEFAULT_EAGLE_MAX_BATCH_SIZE}, the server's)")
    parser.add_argument("--output-dir", default="serve_benchmark",
                        help="where the JSON, Markdown table and plot go (default ./serve_benchmark)")
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or args.requests_per_client < 1 or args.max_tokens < 1 or args.num_prompts < 1:
        parser.error("--clients, --requests-per-client, --max-tokens and --num-prompts must be at least 1")
    return args


def load_prompts(count: int) -> list[str]:
    from .questions import load_questions, spread_over_categories

    return [q["turns"][0] for q in spread_over_categories(load_questions("mt_bench"), count)]


def one_request(http, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """Send one streamed greedy chat request; its latency, time to first token, tokens, text and EAGLE stats."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, parts, usage, eagle = None, [], {}, {}
    with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise RuntimeError(f"the server answered an error: {chunk['error']['message']}")
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    parts.append(choice["delta"]["content"])
            usage, eagle = chunk.get("usage") or usage, chunk.get("eagle") or eagle
    latency = time.perf_counter() - start
    return {"prompt": prompt, "latency": latency, "ttft": latency if ttft is None else ttft, "text": "".join(parts),
            "tokens": usage.get("completion_tokens", 0), "steps": eagle.get("steps", 0),
            "accepted": eagle.get("accepted_tokens", 0)}


def run_load(url: str, model: str, prompts: list[str], clients: int, requests_per_client: int,
             max_tokens: int) -> tuple[list[dict], float]:
    """``clients`` threads, each sending ``requests_per_client`` requests one after the other. Returns the
    per-request records and the wall time."""
    import httpx

    next_prompt = itertools.cycle(prompts).__next__
    lock = threading.Lock()

    def client(_):
        records = []
        with httpx.Client(timeout=None) as http:
            for _ in range(requests_per_client):
                with lock:
                    prompt = next_prompt()
                records.append(one_request(http, url, model, prompt, max_tokens))
        return records

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
        records = [r for batch in pool.map(client, range(clients)) for r in batch]
    return records, time.perf_counter() - start


def summarise(records: list[dict], wall: float, clients: int, mode: str) -> dict:
    latency = np.array([r["latency"] for r in records])
    ttft = np.array([r["ttft"] for r in records])
    tokens, steps = sum(r["tokens"] for r in records), sum(r["steps"] for r in records)
    verify_steps = steps - len(records)
    return {"clients": clients, "mode": mode, "requests": len(records), "wall_s": round(wall, 3),
            "tokens": tokens, "requests_per_s": round(len(records) / wall, 4),
            "tokens_per_s": round(tokens / wall, 3),
            "latency_p50_s": round(float(np.percentile(latency, 50)), 3),
            "latency_p99_s": round(float(np.percentile(latency, 99)), 3),
            "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3),
            "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3),
            "accepted_per_step": round(sum(r["accepted"] for r in records) / verify_steps, 3) if verify_steps > 0
            else 0.0}


def measure(model, args: argparse.Namespace, prompts: list[str]) -> tuple[list[dict], dict]:
    """Every (clients, mode) run, EAGLE and plain side by side per level; and the greedy answers per mode."""
    from ..application.server import BackgroundServer, create_app

    rows, answers = [], {mode: {} for mode in MODES}
    for clients in args.clients:
        for mode in MODES:
            app = create_app(model, served_model_name="bench", use_eagle=mode == "eagle", model_type=args.model_type,
                             max_queue=max(64, clients), default_max_tokens=args.max_tokens,
                             eagle_max_batch_size=args.eagle_max_batch_size)
            with BackgroundServer(app) as server:
                run_load(server.url, "bench", prompts[:1], 1, 1, 8)  # warm-up
                per_client = max(args.requests_per_client, -(-args.min_requests // clients))
                records, wall = run_load(server.url, "bench", prompts, clients, per_client, args.max_tokens)
            rows.append(summarise(records, wall, clients, mode))
            answers[mode].update({r["prompt"]: r["text"] for r in records})
            logger.info("%2d clients, %-5s: %.2f tokens/s, p50 latency %.2f s", clients, mode,
                        rows[-1]["tokens_per_s"], rows[-1]["latency_p50_s"])
    return rows, answers


def markdown_table(rows: list[dict]) -> str:
    by_level = {(r["clients"], r["mode"]): r for r in rows}
    lines = ["| clients | mode | requests | requests/s | tokens/s | EAGLE / plain tokens/s | p50 latency (s) | "
             "p99 latency (s) | p50 TTFT (s) | p99 TTFT (s) | accepted / step |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        plain = by_level.get((r["clients"], "plain"))
        ratio = f"{r['tokens_per_s'] / plain['tokens_per_s']:.2f}x" if r["mode"] == "eagle" and plain else ""
        lines.append(f"| {r['clients']} | {r['mode']} | {r['requests']} | {r['requests_per_s']:.3f} | "
                     f"{r['tokens_per_s']:.2f} | {ratio} | {r['latency_p50_s']:.2f} | {r['latency_p99_s']:.2f} | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['accepted_per_step']:.2f} |")
    return "\n".join(lines) + "\n"


def write_plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, color in zip(MODES, ("C0", "C1")):
        mine = [r for r in rows if r["mode"] == mode]
        clients = [r["clients"] for r in mine]
        throughput.plot(clients, [r["tokens_per_s"] for r in mine], marker="o", color=color, label=mode)
        latency.plot(clients, [r["latency_p50_s"] for r in mine], marker="o", color=color, label=f"{mode} p50")
        latency.plot(clients, [r["ttft_p50_s"] for r in mine], marker="x", linestyle="--", color=color,
                     label=f"{mode} TTFT p50")
    throughput.set(xlabel="concurrent clients", ylabel="generated tokens/s", title="Server throughput")
    latency.set(xlabel="concurrent clients", ylabel="seconds", title="Latency")
    for axis in (throughput, latency):
        axis.set_xscale("log", base=2)
        axis.legend()
        axis.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    from ..application.server import default_served_name, load_model

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    prompts = load_prompts(args.num_prompts)
    model = load_model(args)
    settings = dict(vars(args), model=default_served_name(args.base_model_path))
    for key in ("base_model_path", "ea_model_path"):  # the model's name, not where this machine keeps it
        settings[key] = settings[key] and os.path.basename(os.path.normpath(settings[key]))
    rows, answers = measure(model, args, prompts)
    same = sum(answers["eagle"][p] == answers["plain"].get(p) for p in answers["eagle"])
    results = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
               platform.machine(), "cpus": os.cpu_count(), "settings": settings,
               "rows": rows, "greedy_identical": f"{same} of {len(answers['eagle'])}"}
    os.makedirs(args.output_dir, exist_ok=True)
    table = markdown_table(rows)
    with open(os.path.join(args.output_dir, "serve_benchmark.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.path.join(args.output_dir, "serve_benchmark.md"), "w") as f:
        f.write(f"Serving benchmark, {results['date']}; greedy answers identical: {results['greedy_identical']}\n\n")
        f.write(table)
    write_plot(rows, os.path.join(args.output_dir, "serve_benchmark.png"))
    print(table)
    print(f"Greedy answers identical between EAGLE and plain decoding: {results['greedy_identical']}")
    return results


if __name__ == "__main__":
    main()
