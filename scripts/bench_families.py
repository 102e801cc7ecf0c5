"""Per-family speed of the native decoder against the path each family took before it.

For every family the native decoder takes (``eagle.model.base.layer_spec.FAMILIES``: Llama, Mistral, Qwen2, Qwen3,
SmolLM3, Gemma 3, Qwen2-MoE, Qwen3-MoE) a small random model is built (``--hidden``, ``--layers``; heads of 64, a
quarter as many KV heads) whose every linear layer, mixture-of-experts router and expert computes on the GGUF
kernels over ``--type`` blocks quantized in memory (gguf-py's quantizer, as a GGUF file's blocks), as the GGUF
backend leaves a model loaded from a file. Its target then runs, after a prompt of ``--context`` tokens:

- ``native``: its forward plan as built: the native decoder (``eagle::spec_layers``; a mixture of experts through
  the decoder's own modules);
- ``before``: the same plan without the native decoder: transformers' per-layer Python over the same kernels and
  the same attention kernel, the path a family took before the native decoder described it.

Each is timed for 1 row (a plain decoding step) and an 8-node tree (a verification), the two paths interleaved over
``--repeats`` rounds (their order alternating); the median milliseconds and ``before / native`` (above 1: the native
path is faster) are printed per family, and the largest logit difference between the paths as a check.

    python scripts/bench_families.py                              # every family, hidden 768, 6 layers, Q8_0
    python scripts/bench_families.py --families llama,qwen2_moe --hidden 1024 --layers 8 --threads 2 --repeats 30
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import statistics
import time

import torch
from torch import nn
from tqdm import tqdm

logger = logging.getLogger("bench_families")

# family: (transformers model type, config fields beyond the common ones)
FAMILIES = {
    "llama": ("llama", {}),
    "mistral": ("mistral", dict(sliding_window=None)),
    "qwen2": ("qwen2", dict(use_sliding_window=False)),
    "qwen3": ("qwen3", dict(head_dim=64, use_sliding_window=False)),
    "smollm3": ("smollm3", dict(use_sliding_window=False)),  # transformers' default: every 4th layer without rotary
    "gemma3": ("gemma3_text", dict(head_dim=64, sliding_window=64)),  # 5 local layers of 64 positions, 1 global
    "qwen2_moe": ("qwen2_moe", dict(use_sliding_window=False, num_experts=16, num_experts_per_tok=4)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=64, num_experts=16, num_experts_per_tok=4)),
}
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")  # what gguf-py quantizes and the kernels compute on
TREE = 8
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def family_config(family: str, hidden: int, layers: int, vocab: int):
    """A random model's config of ``family``: heads of 64, a quarter as many KV heads, MLP 4 x hidden (experts of
    hidden / 2 units, a Qwen2-MoE shared expert of 2 x hidden)."""
    from transformers import AutoConfig

    model_type, extra = FAMILIES[family]
    heads = hidden // 64
    fields = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=max(heads // 4, 1), intermediate_size=4 * hidden, max_position_embeddings=4096,
                  tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2, **extra)
    if "num_experts" in extra:
        fields["moe_intermediate_size"] = hidden // 2
        if model_type == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = 2 * hidden
    return AutoConfig.for_model(model_type, **fields)


def quantized(name: str, weight: torch.Tensor, type_name: str):
    """``weight`` (out, in) as a :class:`~eagle.kernels.gguf_weights.GGUFWeight` of ``type_name`` blocks."""
    import gguf
    import numpy as np

    from eagle.kernels.gguf_weights import GGUFWeight

    kind = getattr(gguf.GGMLQuantizationType, type_name)
    blocks = gguf.quants.quantize(weight.detach().float().contiguous().numpy(), kind)
    return GGUFWeight(name, type_name, tuple(weight.shape), torch.from_numpy(np.ascontiguousarray(blocks)))


def to_kernels(model: nn.Module, type_name: str, numerics: str) -> None:
    """Every ``nn.Linear`` of ``model``, and each mixture-of-experts layer's router and stacked experts, onto the
    kernels over ``type_name`` blocks of their weights (in place)."""
    from eagle.kernels.linear import QuantLinear
    from eagle.model.backends.gguf import GGUFQuantLinear, set_module
    from eagle.model.backends.gguf_experts import SOFTMAX_ROUTERS, KernelExperts, KernelRouter

    for name, layer in list(model.named_modules()):
        if type(layer) is nn.Linear:
            set_module(model, name, GGUFQuantLinear(quantized(name, layer.weight, type_name), layer.bias, numerics))
    for index, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        gate_up = [QuantLinear(quantized(f"{index}.gate_up[{e}]", experts.gate_up_proj[e], type_name), None, numerics)
                   for e in range(experts.num_experts)]
        down = [QuantLinear(quantized(f"{index}.down[{e}]", experts.down_proj[e], type_name), None, numerics)
                for e in range(experts.num_experts)]
        layer.mlp.experts = KernelExperts(gate_up, down, experts.act_fn)
        if type(layer.mlp.gate).__name__ in SOFTMAX_ROUTERS:
            router = quantized(f"{index}.router", layer.mlp.gate.weight, type_name)
            layer.mlp.gate = KernelRouter(layer.mlp.gate, QuantLinear(router, None, numerics))


def build_target(family: str, args):
    """The family's random model on the kernels, as a target; raises a RuntimeError if the native decoder is not
    taken (the comparison would be meaningless)."""
    from transformers import AutoModelForCausalLM

    from eagle.model.base.native_decoder import native_problem
    from eagle.model.base.target import Target

    torch.manual_seed(0)
    config = family_config(family, args.hidden, args.layers, args.vocab)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()
    to_kernels(model, args.type, args.numerics)
    target = Target(model, feature_layers=None)
    if target.forward_plan.native is None:
        raise RuntimeError(f"The {family} model does not take the native decoder: "
                           f"{native_problem(model, target.forward_plan.kernel_attention)}.")
    return target


@dataclasses.dataclass
class Route:
    """One way to run the target's passes: its plan, its cache after the prompt, its timings (seconds per pass)."""

    plan: object
    cache: object
    times: dict = dataclasses.field(default_factory=lambda: {"1 row": [], f"{TREE}-node tree": []})


def tree_inputs(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An 8-node tree after ``length`` committed tokens: a chain of 4 and branches; (positions, mask)."""
    parents = [-1, 0, 1, 2, 0, 4, 1, 0]
    mask = torch.eye(TREE, dtype=torch.bool)
    depth = torch.zeros(TREE, dtype=torch.long)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] |= mask[parent]
            depth[node] = depth[parent] + 1
    return (length + depth).view(1, TREE), mask


def timed_passes(target, path: Route, prompt_length: int, clock) -> torch.Tensor:
    """Time one decode and one tree verification on ``path``, each after the prompt alone (the cache is cropped back
    to it); returns the decode's logits."""
    target.forward_plan = path.plan
    token = torch.tensor([[17]])
    start = clock()
    logits = target.decode(token, path.cache, torch.tensor([[prompt_length]]), features=False).logits
    path.times["1 row"].append(clock() - start)
    path.cache.crop(prompt_length)
    positions, mask = tree_inputs(prompt_length)
    nodes = torch.arange(20, 20 + TREE).view(1, TREE)
    start = clock()
    target.verify(nodes, path.cache, positions, mask, features=False)
    path.times[f"{TREE}-node tree"].append(clock() - start)
    path.cache.crop(prompt_length)
    return logits[0, -1]


def bench_family(family: str, args) -> dict:
    """Median milliseconds of both paths for 1 row and the tree, their ratio, and the largest logit difference."""
    target = build_target(family, args)
    native = target.forward_plan
    prompt = torch.randint(6, args.vocab, (1, args.context), generator=torch.Generator().manual_seed(1))
    paths = {}
    with torch.no_grad():
        for name, plan in (("native", native), ("before", dataclasses.replace(native, native=None))):
            target.forward_plan = plan
            cache = target.new_cache(args.context + 2 * TREE)
            target.prefill(prompt, cache, features=False)
            paths[name] = Route(plan, cache)
        logits = {name: timed_passes(target, path, args.context, CLOCKS[args.clock]) for name, path in paths.items()}
        for path in paths.values():  # the warm-up round is not counted
            path.times = {shape: [] for shape in path.times}
        for round_ in range(args.repeats):
            for name in (("native", "before") if round_ % 2 == 0 else ("before", "native")):
                timed_passes(target, paths[name], args.context, CLOCKS[args.clock])
    target.forward_plan = native
    result = {"max_logit_difference": float((logits["native"] - logits["before"]).abs().max())}
    for shape in paths["native"].times:
        ms = {name: 1000 * statistics.median(path.times[shape]) for name, path in paths.items()}
        result[shape] = {**{f"{name}_ms": round(value, 3) for name, value in ms.items()},
                         "before_over_native": round(ms["before"] / ms["native"], 3)}
    return result


def table(results: dict) -> list[str]:
    """The results as a text table: per family and pass, the median ms of both paths and before / native."""
    shapes = ["1 row", f"{TREE}-node tree"]
    lines = [f"{'family':<10}" + "".join(f" | {shape + ': native / before ms':<28} {'x':>6}" for shape in shapes)
             + " | max |dlogit|"]
    for family, result in results.items():
        cells = "".join(f" | {r['native_ms']:>12.2f} / {r['before_ms']:<13.2f} {r['before_over_native']:>5.2f}x"
                        for r in (result[shape] for shape in shapes))
        lines.append(f"{family:<10}{cells} | {result['max_logit_difference']:.1e}")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated families to time (default: all of {', '.join(FAMILIES)})")
    p.add_argument("--hidden", type=int, default=768, help="hidden size, a multiple of 64 (default 768)")
    p.add_argument("--layers", type=int, default=6, help="decoder layers (default 6)")
    p.add_argument("--vocab", type=int, default=32768, help="vocabulary size (default 32768)")
    p.add_argument("--type", choices=TYPES, default="Q8_0", help="GGUF type of every matrix (default Q8_0)")
    p.add_argument("--numerics", choices=["float32", "int8"], default="float32",
                   help="activations of the kernels (as --gguf-kernels; default float32)")
    p.add_argument("--context", type=int, default=128, help="prompt tokens before the timed passes (default 128)")
    p.add_argument("--repeats", type=int, default=20, help="interleaved rounds per family (default 20)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall (default; for an idle machine) or cpu (process CPU time, summed over threads)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    unknown = [f for f in args.families.split(",") if f not in FAMILIES]
    if unknown:
        p.error(f"unknown families {', '.join(unknown)}; expected some of {', '.join(FAMILIES)}")
    if args.hidden % 64 or args.hidden < 256:
        p.error(f"--hidden {args.hidden}: expected a multiple of 64 of at least 256 (heads of 64, 4 or more)")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from eagle import kernels

    if not kernels.available():
        raise SystemExit("eagle's native kernels are not built here: python setup.py build_ext --inplace")
    if args.threads:
        torch.set_num_threads(args.threads)
    logger.info("threads %d, hidden %d, %d layers, %s, context %d, %d rounds, %s clock", torch.get_num_threads(),
                args.hidden, args.layers, args.type, args.context, args.repeats, args.clock)
    results = {}
    for family in tqdm(args.families.split(","), desc="families", unit="family"):
        results[family] = bench_family(family, args)
        logger.info("%s: %s", family, results[family])
    print("\n".join(table(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
