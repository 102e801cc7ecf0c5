"""Losslessness and smoke checks of the engine on an accelerator (CI has none; run this on a machine that has one).

    python scripts/gpu_check.py --device cuda [--gguf PATH] [--head eagle/default_head]

1. Tiny random targets of several families (built here, as in tests/tiny_models.py) with EAGLE-3 / EAGLE-1 heads:
   greedy ``eagenerate`` must equal transformers' ``generate(do_sample=False)`` on the device, in float32.
2. With ``--gguf``: the embedded default (SmolLM2-135M + its head) on the device, float32 and bfloat16: greedy
   EAGLE vs plain decoding (equal tokens expected in float32; bfloat16 differences are reported, not failed:
   tree verification and one-token decoding round differently), tokens per target forward, tokens/s.
3. Sampling (temperature 0.7, top-p 0.9) runs on the device.
Exit status 1 when a float32 greedy check differs.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]  # the package (also when not installed) and tests/tiny_models.py

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain how a hash table works, with an example.",
    "Give me three tips for a job interview.",
]


def tiny_checks(device: str, report: dict) -> bool:
    from transformers import AutoModelForCausalLM

    from eagle.model.ea_model import EaModel
    from tiny_models import make_head, make_target, train_head_quickly

    ok = True
    prompts = [[1, 40, 41, 42], [1, 70, 71, 72, 73, 74, 75, 76, 77, 20]]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for family in ["llama", "qwen2", "qwen3", "mixtral", "gemma"]:
            base = root / family
            target = make_target(base, family, seed=3)
            heads = {"eagle3-trained": (True, root / f"{family}-e3")}
            make_head(heads["eagle3-trained"][1], target, eagle3=True, seed=4)
            extra = train_head_quickly(base, heads["eagle3-trained"][1], eagle3=True, steps=100)
            prompts_here = prompts + [extra[0].tolist()]
            heads["eagle1"] = (False, root / f"{family}-e1")
            make_head(heads["eagle1"][1], target, eagle3=False, seed=5)
            reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device).eval()
            expected = [reference.generate(torch.tensor([p], device=device), max_new_tokens=24, do_sample=False)
                        for p in prompts_here]
            for kind, (eagle3, head_dir) in heads.items():
                model = EaModel.from_pretrained(use_eagle3=eagle3, base_model_path=str(base), ea_model_path=str(head_dir),
                                                dtype=torch.float32, device_map=device)
                for tree in [(16, 3, 4), (7, 5, 2)]:
                    model.set_tree(*tree)
                    for prompt, want in zip(prompts_here, expected):
                        got, new, idx = model.eagenerate(torch.tensor([prompt], device=device), max_new_tokens=24,
                                                            log=True)
                        same = torch.equal(got.cpu(), want.cpu()[:, : got.shape[1]]) and got.shape == want.shape
                        report.setdefault("tiny", []).append({"family": family, "head": kind, "tree": tree,
                                                               "equal": same, "tokens_per_cycle": int(new) / (int(idx) + 1)})
                        ok &= same
                sampled = model.eagenerate(torch.tensor([prompts_here[0]], device=device), temperature=0.7, top_p=0.9,
                                           max_new_tokens=16)
                report.setdefault("tiny_sampling_ok", []).append([family, kind, list(sampled.shape)])
    return ok


def default_checks(device: str, gguf: str, head: str, report: dict) -> bool:
    from eagle.model.ea_model import EaModel

    ok = True
    for dtype in [torch.float32, torch.bfloat16]:
        model = EaModel.from_pretrained(use_eagle3=True, base_model_path=gguf, ea_model_path=head, dtype=dtype,
                                        device_map=device, total_token=12, depth=5, top_k=4)
        tokenizer = model.get_tokenizer()
        rows = []
        for prompt in PROMPTS:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                 add_generation_prompt=True)
            ids = tokenizer([text], return_tensors="pt", add_special_tokens=False).input_ids.to(device)
            model.eagenerate(ids, max_new_tokens=8)  # warm-up
            t0 = time.perf_counter()
            ea, new, idx = model.eagenerate(ids, max_new_tokens=128, log=True)
            t1 = time.perf_counter()
            plain, plain_new, _ = model.naivegenerate(ids, max_new_tokens=128, log=True)
            t2 = time.perf_counter()
            same = torch.equal(ea.cpu(), plain.cpu())
            if dtype == torch.float32:
                ok &= same
            rows.append({"equal": same, "tokens_per_forward": int(new) / (int(idx) + 1),
                         "eagle_tok_s": int(new) / (t1 - t0), "plain_tok_s": int(plain_new) / (t2 - t1)})
        sampled = model.eagenerate(ids, temperature=0.7, top_p=0.9, max_new_tokens=32)
        report[f"default_{str(dtype).split('.')[-1]}"] = {"rows": rows, "sampling_shape": list(sampled.shape)}
        del model
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="Device to check (cuda, cuda:1, cpu...).")
    parser.add_argument("--gguf", default=None, help="SmolLM2 GGUF file: also check the embedded default pair.")
    parser.add_argument("--head", default=str(Path(__file__).resolve().parent.parent / "eagle" / "default_head"),
                        help="Head for the --gguf check.")
    parser.add_argument("--skip-tiny", action="store_true", help="Only the --gguf check.")
    parser.add_argument("--output", default=None, help="Also write the report as JSON here.")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    report: dict = {"device": args.device, "torch": torch.__version__}
    if args.device.startswith("cuda"):
        report["name"] = torch.cuda.get_device_name(args.device)
    ok = True
    if not args.skip_tiny:
        ok &= tiny_checks(args.device, report)
    if args.gguf:
        ok &= default_checks(args.device, args.gguf, args.head, report)
    report["ok"] = ok
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.output:
        Path(args.output).write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
