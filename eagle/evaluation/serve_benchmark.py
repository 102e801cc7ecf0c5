"""``python -m eagle.evaluation.serve_benchmark``: the HTTP server under load, EAGLE against plain decoding.

Loads the model once, then for each number of concurrent clients serves it on 127.0.0.1 (in this process, uvicorn in
a thread) with EAGLE and with plain decoding, ``--repeats`` times each (the two modes' order alternating), and lets
that many clients send streamed greedy chat requests (MT-bench first turns, round robin) until each has sent
``--requests-per-client`` (more when there are fewer clients than ``--min-requests``). The clients are asyncio tasks
of one separate process (:class:`ClientProcess`), so their HTTP and JSON work does not hold the server's interpreter
lock, as with real clients elsewhere. Per run: requests/s, generated tokens/s over the wall time, p50/p99 latency
and time to first token, EAGLE's accepted tokens per step; per number of clients, the median EAGLE / plain ratio;
and the share of the engine's time spent prefilling the prompts of joining requests (from the server's
``/metrics``), during which every running row waits. ``--engine-alone`` also runs each load on the engine directly,
to show what the serving path costs. Writes ``serve_benchmark.json``, ``serve_benchmark.md`` (the tables) and
``serve_benchmark.png`` to ``--output-dir``, and prints the tables. Greedy answers of the two modes are compared
prompt by prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import itertools
import json
import logging
import multiprocessing
import os
import platform
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
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="max_tokens of every request (default 64; MT-bench answers end by themselves at about "
                        "380 tokens on average with 512: short caps make the joining prompts' prefill, the same cost "
                        "in both modes, a larger share of the run)")
    parser.add_argument("--num-prompts", type=int, default=16,
                        help="MT-bench first turns used, spread over categories, sent round robin (default 16)")
    parser.add_argument("--eagle-max-batch-size", type=int, default=DEFAULT_EAGLE_MAX_BATCH_SIZE,
                        help="the EAGLE server runs plain decoding when more requests than this run or wait (0 = "
                        f"never; default {DEFAULT_EAGLE_MAX_BATCH_SIZE}, the server's)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="the servers' --max-batch-size: rows of the running batch (default 8, the server's)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs of each (clients, mode) pair, the two modes' order alternating; the table gives "
                        "each run and the median ratio (default 1; more on a loaded machine)")
    parser.add_argument("--engine-alone", action="store_true",
                        help="after each server run, run the same load on the engine directly (no HTTP, no "
                        "scheduler thread) and report the server's tokens/s against it")
    parser.add_argument("--output-dir", default="serve_benchmark",
                        help="where the JSON, Markdown table and plot go (default ./serve_benchmark)")
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or min(args.requests_per_client, args.max_tokens, args.num_prompts, args.repeats,
                                    args.max_batch_size) < 1:
        parser.error("--clients, --requests-per-client, --max-tokens, --num-prompts, --repeats and --max-batch-size "
                     "must be at least 1")
    return args


def load_prompts(count: int) -> list[str]:
    from .questions import load_questions, spread_over_categories

    return [q["turns"][0] for q in spread_over_categories(load_questions("mt_bench"), count)]


async def one_request(http, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    """Send one streamed greedy chat request; its latency, time to first token, tokens, text and EAGLE stats."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft, parts, usage, eagle = None, [], {}, {}
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
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


async def _load(url: str, model: str, prompts: list[str], clients: int, requests_per_client: int,
                max_tokens: int) -> tuple[list[dict], float]:
    import httpx

    next_prompt = itertools.cycle(prompts).__next__
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:

        async def client():
            return [await one_request(http, url, model, next_prompt(), max_tokens)
                    for _ in range(requests_per_client)]

        start = time.perf_counter()
        per_client = await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - start
    return [r for records in per_client for r in records], wall


def client_load(url: str, model: str, prompts: list[str], clients: int, requests_per_client: int,
                max_tokens: int) -> tuple[list[dict], float]:
    """``clients`` concurrent clients (asyncio tasks of this process), each sending ``requests_per_client``
    requests one after the other (prompts round robin). Returns the per-request records and the wall time."""
    return asyncio.run(_load(url, model, prompts, clients, requests_per_client, max_tokens))


class ClientProcess:
    """Runs :func:`client_load` in a process of its own (a context manager), so that the clients' HTTP and JSON
    work shares neither the server's interpreter lock nor its event loop, as with clients on other machines; they
    still share this machine's cores."""

    def __enter__(self) -> ClientProcess:
        self.pool = concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown()

    def run(self, *args) -> tuple[list[dict], float]:
        return self.pool.submit(client_load, *args).result()


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
    """Every (clients, mode) run, EAGLE and plain side by side per level (``--repeats`` times, the order of the two
    modes alternating); and the greedy answers per mode. The clients run in a process of their own."""
    rows, answers = [], {mode: {} for mode in MODES}
    with ClientProcess() as clients_process:
        for clients in args.clients:
            for repeat in range(args.repeats):
                for mode in MODES if repeat % 2 == 0 else MODES[::-1]:
                    records, wall, prefill_share = _serve_run(model, args, prompts, clients, mode, clients_process)
                    rows.append(dict(summarise(records, wall, clients, mode), repeat=repeat,
                                     prefill_share=round(prefill_share, 3)))
                    if args.engine_alone:
                        tokens, seconds = engine_alone(model, args, prompts, clients, mode)
                        rows[-1]["engine_alone_tokens_per_s"] = round(tokens / seconds, 3)
                    answers[mode].update({r["prompt"]: r["text"] for r in records})
                    logger.info("%2d clients, %-5s: %.2f tokens/s, p50 latency %.2f s", clients, mode,
                                rows[-1]["tokens_per_s"], rows[-1]["latency_p50_s"])
    return rows, answers


def _serve_run(model, args, prompts: list[str], clients: int, mode: str, clients_process: ClientProcess):
    """One server (EAGLE or plain decoding) under ``clients`` clients: (records, wall seconds, the share of the
    engine's time spent prefilling joining prompts, every running row waiting meanwhile)."""
    from ..application.server import BackgroundServer, create_app

    app = create_app(model, served_model_name="bench", use_eagle=mode == "eagle", model_type=args.model_type,
                     max_queue=max(64, clients), default_max_tokens=args.max_tokens,
                     eagle_max_batch_size=args.eagle_max_batch_size, max_batch_size=args.max_batch_size)
    with BackgroundServer(app) as server:
        clients_process.run(server.url, "bench", prompts[:1], 1, 1, 8)  # warm-up
        before = engine_seconds(server.url)
        records, wall = clients_process.run(server.url, "bench", prompts, clients, requests_per_client(args, clients),
                                            args.max_tokens)
        after = engine_seconds(server.url)
    prefill, decode = (b - a for a, b in zip(before, after))
    return records, wall, prefill / (prefill + decode) if prefill + decode > 0 else 0.0


def requests_per_client(args, clients: int) -> int:
    """``--requests-per-client``, more when fewer clients than ``--min-requests`` would send too few in all."""
    return max(args.requests_per_client, -(-args.min_requests // clients))


def engine_seconds(url: str) -> tuple[float, float]:
    """The server's prefill and decoding seconds so far (its ``/metrics``)."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        name, _, value = line.partition(" ")
        values[name] = value
    return float(values["eagle_prefill_seconds_total"]), float(values["eagle_decode_seconds_total"])


def engine_alone(model, args, prompts: list[str], clients: int, mode: str) -> tuple[int, float]:
    """The same load without the server: ``clients`` closed-loop clients on the engine's running batch
    (``EaModel.continuous_batch``) directly, a finished request's client adding its next prompt at the next step
    boundary, at most min(clients, ``--max-batch-size``) rows (see :func:`closed_loop`). Returns (generated tokens,
    wall seconds)."""
    import torch

    from ..application.openai_schema import ChatMessage
    from ..application.server_app import chat_prompt_ids

    ids = [torch.tensor(chat_prompt_ids(model.tokenizer, [ChatMessage(role="user", content=p)], args.model_type))
           for p in prompts]
    running = model.continuous_batch(use_eagle=mode == "eagle")
    start = time.perf_counter()
    tokens = closed_loop(running, ids, clients, requests_per_client(args, clients) * clients, args.max_batch_size,
                         args.max_tokens)
    return tokens, time.perf_counter() - start


def closed_loop(running, ids: list, clients: int, requests: int, max_batch_size: int, max_tokens: int) -> int:
    """Drive ``running`` (a continuous batch) as ``clients`` closed-loop clients would a server of
    ``max_batch_size`` rows: ``requests`` prompts in all (``ids`` round robin), at most min(clients,
    max_batch_size) generating at once, a finished one's successor added at the next step boundary. Returns the
    tokens generated."""
    order = itertools.cycle(ids)
    waiting, tokens = requests, 0
    for _ in range(min(waiting, clients, max_batch_size)):
        running.add(next(order), max_new_tokens=max_tokens)
        waiting -= 1
    for update in running:
        for part in update.values():
            tokens += part.tokens.numel()
            if part.finished and waiting:
                running.add(next(order), max_new_tokens=max_tokens)
                waiting -= 1
    return tokens


def ratios(rows: list[dict]) -> dict[int, list[float]]:
    """EAGLE / plain tokens/s of each repeat, per number of clients."""
    plain = {(r["clients"], r.get("repeat", 0)): r["tokens_per_s"] for r in rows if r["mode"] == "plain"}
    found: dict[int, list[float]] = {}
    for r in rows:
        key = (r["clients"], r.get("repeat", 0))
        if r["mode"] == "eagle" and plain.get(key):
            found.setdefault(r["clients"], []).append(r["tokens_per_s"] / plain[key])
    return found


def markdown_table(rows: list[dict]) -> str:
    plain = {(r["clients"], r.get("repeat", 0)): r for r in rows if r["mode"] == "plain"}
    lines = ["| clients | repeat | mode | requests | requests/s | tokens/s | EAGLE / plain tokens/s | "
             "p50 latency (s) | p99 latency (s) | p50 TTFT (s) | p99 TTFT (s) | accepted / step | prefill share | "
             "server / engine alone |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        other = plain.get((r["clients"], r.get("repeat", 0)))
        ratio = f"{r['tokens_per_s'] / other['tokens_per_s']:.2f}x" if r["mode"] == "eagle" and other else ""
        lines.append(f"| {r['clients']} | {r.get('repeat', 0) + 1} | {r['mode']} | {r['requests']} | "
                     f"{r['requests_per_s']:.3f} | {r['tokens_per_s']:.2f} | {ratio} | {r['latency_p50_s']:.2f} | "
                     f"{r['latency_p99_s']:.2f} | {r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | "
                     f"{r['accepted_per_step']:.2f} | {r.get('prefill_share', 0.0):.0%} | {_versus_engine(r)} |")
    lines += ["", "| clients | median EAGLE / plain tokens/s | each repeat |", "|---:|---:|---|"]
    for clients, found in ratios(rows).items():
        lines.append(f"| {clients} | {float(np.median(found)):.2f}x | {', '.join(f'{x:.2f}x' for x in found)} |")
    return "\n".join(lines) + "\n"


def _versus_engine(row: dict) -> str:
    alone = row.get("engine_alone_tokens_per_s")
    return f"{row['tokens_per_s'] / alone:.2f}x" if alone else ""


def write_plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (throughput, latency) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, color in zip(MODES, ("C0", "C1")):
        clients = sorted({r["clients"] for r in rows if r["mode"] == mode})

        def median(key, mode=mode):  # over the repeats of each level
            return [float(np.median([r[key] for r in rows if r["mode"] == mode and r["clients"] == c]))
                    for c in clients]

        throughput.plot(clients, median("tokens_per_s"), marker="o", color=color, label=mode)
        latency.plot(clients, median("latency_p50_s"), marker="o", color=color, label=f"{mode} p50")
        latency.plot(clients, median("ttft_p50_s"), marker="x", linestyle="--", color=color,
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
