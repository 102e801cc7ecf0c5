"""Write a float copy (F32 or F16) of a quantized GGUF model, every tensor dequantized in its stored layout and
every metadata field kept, so llama.cpp runs the same weights as this project's engine (which dequantizes the
GGUF to float32 when it loads it). Used to measure what the target's quantization costs in llama.cpp:

    python scripts/gguf_to_float.py --output target.f32.gguf                       # the embedded SmolLM2 Q4_1
    python scripts/gguf_to_float.py --input model.Q4_1.gguf --type f16 --output model.f16.gguf
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np

logger = logging.getLogger("gguf_to_float")

FILE_TYPES = {"f32": 0, "f16": 1}  # gguf.LlamaFileType.ALL_F32, MOSTLY_F16
SKIPPED_FIELDS = ("GGUF.", "general.architecture", "general.file_type")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default=None, help="Quantized GGUF (default: the embedded SmolLM2-135M-Instruct).")
    parser.add_argument("--type", choices=sorted(FILE_TYPES), default="f32",
                        help="f32 (default), or f16 for the 2-D weights (1-D tensors stay f32, as llama.cpp's "
                             "converter writes them).")
    parser.add_argument("--output", required=True, help="GGUF file to write.")
    return parser


def convert(source: str, output: str, kind: str = "f32") -> str:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(output + ".part", arch)
    for key, field in reader.fields.items():
        if key.startswith(SKIPPED_FIELDS):
            continue
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_file_type(FILE_TYPES[kind])
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        # GGUF shapes list the fastest dimension first; numpy's are the other way round.
        array = array.reshape([int(n) for n in reversed(tensor.shape)])
        if kind == "f16" and array.ndim > 1:
            array = array.astype(np.float16)
        writer.add_tensor(tensor.name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(output + ".part", output)
    return output


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    source = args.input
    if source is None:
        from eagle.defaults import default_base_model_path

        source = default_base_model_path()
    if not os.path.isfile(source):
        raise SystemExit(f"error: {source} does not exist (expected a .gguf file)")
    logger.info("Wrote %s", convert(source, args.output, args.type))
    return 0


if __name__ == "__main__":
    sys.exit(main())
