"""``python -m eagle.evaluation.scale``: build widened pairs of the embedded model and head (see the package)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from eagle.evaluation.scale.widen import SHAPES

CACHE = Path("~/.cache/eagle/scale")


def parser() -> argparse.ArgumentParser:
    shapes = "; ".join(f"{name}: hidden {s.hidden_size}, {s.num_attention_heads} query / {s.num_key_value_heads} "
                       f"KV heads of {s.head_dim}, intermediate {s.intermediate_size}, {s.num_hidden_layers} layers"
                       for name, s in SHAPES.items())
    p = argparse.ArgumentParser(
        prog="python -m eagle.evaluation.scale",
        description="Widen the embedded SmolLM2-135M-Instruct and its EAGLE-3 head into a bigger Llama shape that "
                    "computes the same function (the same greedy tokens, the same acceptance) at the big shape's "
                    "cost. The model directory is the input of llama.cpp's convert_hf_to_gguf.py.")
    sub = p.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="write the widened pair: DIR/model (Hugging Face) and DIR/head (EAGLE-3)",
                           description="Write the widened pair tensor by tensor: DIR/model, a Hugging Face Llama "
                                       "directory (safetensors shards), and DIR/head, its EAGLE-3 head. Shapes: "
                                       f"{shapes}.")
    build.add_argument("--shape", choices=sorted(SHAPES), required=True, help="the shape to widen into")
    build.add_argument("--out", type=Path, default=None,
                       help=f"output directory (default: {CACHE}/<shape>); a pair already built there with the same "
                            "settings is kept")
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
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from eagle.evaluation.scale.build import DTYPES, build_pair

    out = args.out if args.out is not None else CACHE / args.shape
    model_dir, head_dir = build_pair(SHAPES[args.shape], out, args.base_model_path, args.ea_model_path,
                                     DTYPES[args.dtype], args.seed, int(args.shard_gb * 2**30), args.force)
    print(f"model: {model_dir}\nhead: {head_dir}")


if __name__ == "__main__":
    main()
