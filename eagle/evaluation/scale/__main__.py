"""``python -m eagle.evaluation.scale``: build widened pairs of the embedded model and head, convert and quantize
them with the pinned llama.cpp, tune their trees, and benchmark them against llama.cpp (see the package)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from eagle.evaluation.scale.widen import FAMILIES, SHAPES

CACHE = Path("~/.cache/eagle/scale")
NUMERICS = ("auto", "float32", "int8")


def add_out(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), required=True, help="the shape")
    p.add_argument("--family", choices=FAMILIES, default="llama",
                   help="architecture of the widened model (default llama; qwen2 adds q/k/v biases; qwen2_moe "
                        "needs a mixture-of-experts shape such as moe-2b)")
    p.add_argument("--out", type=Path, default=None,
                   help=f"the pair's directory (default: {CACHE}/<shape>, {CACHE}/<family>-<shape> for another "
                        "family than llama)")


def default_out(args) -> Path:
    """The pair's directory: ``--out``, or the cache's directory of the shape (and family)."""
    if args.out is not None:
        return args.out.expanduser()
    return (CACHE / (args.shape if args.family == "llama" else f"{args.family}-{args.shape}")).expanduser()


def add_quant_numerics(p: argparse.ArgumentParser, numerics_help: str,
                       quant_help: str = "which converted model GGUF (default Q4_K_M)") -> None:
    """``--quant`` (the model GGUF's quantization type) and ``--numerics`` (the GGUF kernels' activations)."""
    p.add_argument("--quant", default="Q4_K_M", help=quant_help)
    p.add_argument("--numerics", choices=NUMERICS, default="auto", help=numerics_help)


def add_conversion(p: argparse.ArgumentParser) -> None:
    add_quant_numerics(p, "activations of the GGUF kernels the tree is tuned for (as --gguf-kernels; default auto)",
                       "llama-quantize type of the model GGUF (default Q4_K_M)")
    p.add_argument("--outtype", choices=["f16", "bf16"], default="f16",
                   help="type of convert_hf_to_gguf.py's intermediate GGUF (default f16)")
    p.add_argument("--keep-intermediate", action="store_true",
                   help="keep the f16/bf16 intermediate GGUF (deleted by default; ~16 GB at 8b)")
    p.add_argument("--skip-tune", action="store_true",
                   help="keep the source head's trees instead of tuning one on the widened model (minutes at 2b/8b)")


def add_bench(sub) -> None:
    bench = sub.add_parser("bench", help="this project's EAGLE and plain decoding against llama.cpp on a converted "
                                         "pair", description="Side by side, interleaved: EAGLE and plain decoding on "
                           "the GGUF kernels, llama.cpp plain and llama.cpp with the widened head as its EAGLE-3 "
                           "draft (tokens/s, tau, resident memory), load times, the cost of a forward over k = 1..32 "
                           "tokens after 256 as a multiple of k = 1, the read bandwidth and the GB/s one plain token "
                           "streams. Prints a table and writes OUTPUT_DIR/scale-bench.json.")
    add_out(bench)
    add_quant_numerics(bench, "--gguf-kernels of our methods")
    bench.add_argument("--threads", type=int, default=2, help="threads of every method (default 2)")
    bench.add_argument("--num-questions", type=int, default=8, help="MT-bench questions (default 8)")
    bench.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per answer (default 128)")
    bench.add_argument("--skip-llamacpp-curve", action="store_true",
                       help="leave out llama.cpp's cost curve (llama-batched-bench)")
    bench.add_argument("--output-dir", type=Path, default=None,
                       help="where scale-bench.json and the benchmark's report go (default: the pair's bench/)")


def parser() -> argparse.ArgumentParser:
    shapes = "; ".join(f"{name}: hidden {s.hidden_size}, {s.num_attention_heads} query / {s.num_key_value_heads} "
                       f"KV heads of {s.head_dim}, " + (
                           f"{s.experts} experts of {s.expert_size} (top-{s.experts_per_token}) and a shared expert "
                           f"of {s.intermediate_size}" if s.experts else f"intermediate {s.intermediate_size}") +
                       f", {s.num_hidden_layers} layers" for name, s in SHAPES.items())
    p = argparse.ArgumentParser(
        prog="python -m eagle.evaluation.scale",
        description="Widen the embedded SmolLM2-135M-Instruct and its EAGLE-3 head into a bigger Llama, Qwen2 or "
                    "Qwen2-MoE shape (--family) that computes the same function (the same greedy tokens, the same "
                    "acceptance) at the big shape's cost. The model directory is the input of llama.cpp's "
                    "convert_hf_to_gguf.py.")
    sub = p.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write the widened pair: DIR/model (Hugging Face) and DIR/head (EAGLE-3)",
                           description="Write the widened pair tensor by tensor: DIR/model, a Hugging Face Llama "
                                       "directory (safetensors shards), and DIR/head, its EAGLE-3 head. Shapes: "
                                       f"{shapes}.")
    add_out(build)
    build.add_argument("--base-model-path", default=None,
                       help="source Llama model (directory or .gguf; default: the embedded SmolLM2-135M-Instruct)")
    build.add_argument("--ea-model-path", default=None,
                       help="its EAGLE-3 head directory (default: the embedded head)")
    build.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16",
                       help="dtype of the written weights (default float16, what convert_hf_to_gguf.py keeps as f16; "
                            "float32 for exact comparisons)")
    build.add_argument("--seed", type=int, default=0, help="seed of the random values of the extra weights")
    build.add_argument("--shard-gb", type=float, default=2.0, help="largest safetensors shard in GB (default 2)")
    build.add_argument("--force", action="store_true", help="rebuild even if the pair is already there")
    build.add_argument("--convert", action="store_true", help="then convert it as the convert command does")
    add_conversion(build)
    convert = sub.add_parser("convert", help="GGUF files of a built pair: model (Q4_K_M) and EAGLE-3 draft head",
                             description="Convert DIR/model with the pinned llama.cpp's convert_hf_to_gguf.py to an "
                                         "f16 GGUF, quantize it with llama-quantize (Q4_K_M), delete the f16 file, "
                                         "export DIR/head to llama.cpp's EAGLE-3 draft GGUF, then tune the head's "
                                         "tree on the quantized model (--skip-tune to keep the source head's). "
                                         "Needs scripts/build_llama_cpp.sh and pip install -r "
                                         "requirements-scale.txt.")
    add_out(convert)
    add_conversion(convert)
    convert.add_argument("--force", action="store_true", help="convert again even if the files are there")
    tune = sub.add_parser("tune", help="tune the widened head's tree on its converted model",
                          description="Tune the tree of DIR/head on the converted model on the GGUF kernels and "
                                      "write it into the head (python -m eagle.evaluation.simulate --write-tree).")
    add_out(tune)
    add_quant_numerics(tune, "activations to tune for")
    add_bench(sub)
    return p


def convert(args, out: Path) -> None:
    from eagle.evaluation.scale.convert import convert_pair
    from eagle.evaluation.scale.tune import tune_head_tree

    files = convert_pair(out, args.outtype, args.quant, args.keep_intermediate, force=args.force)
    print("\n".join(f"{role}: {path}" for role, path in files.items() if path.exists()))
    if not args.skip_tune:
        tune_head_tree(out, args.quant, args.numerics)


def bench(args, out: Path) -> None:
    from eagle.evaluation.scale.bench import bench as run_bench, table

    args.out, args.output_dir = out, args.output_dir or out / "bench"
    result = run_bench(args)
    print("\n".join(table(result)))
    print(f"results: {result['json']}")


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = default_out(args)
    try:
        if args.command == "build":
            build(args, out)
        elif args.command == "convert":
            convert(args, out)
        elif args.command == "tune":
            from eagle.evaluation.scale.tune import tune_head_tree

            tune_head_tree(out, args.quant, args.numerics)
        else:
            bench(args, out)
    except (FileNotFoundError, RuntimeError, ValueError) as err:
        raise SystemExit(str(err)) from None


def build(args, out: Path) -> None:
    from eagle.evaluation.scale.build import DTYPES, build_pair

    model_dir, head_dir = build_pair(SHAPES[args.shape], out, args.base_model_path, args.ea_model_path,
                                     DTYPES[args.dtype], args.seed, int(args.shard_gb * 2**30), args.force,
                                     args.family)
    print(f"model: {model_dir}\nhead: {head_dir}")
    if args.convert:
        convert(args, out)


if __name__ == "__main__":
    main()
