"""Malformed GGUF files: every one is named in one sentence (file, tensor, what was expected) before anything reads
its blocks, or it loads correctly.

A small Llama GGUF (random Q4_1 / Q8_0 / F32 tensors, the embedded model's tokenizer) loads through ``EaModel`` as
the control case; each mutant changes a header field, a tensor-table entry or the data (magic, version, counts,
lengths, dimension counts, dims, type ids, data offsets, truncation, NaN and infinite block scales and weights,
random bytes). Each mutant is checked in this process with :func:`check_gguf_file`, and all of them go through the
whole loader in a child process that reports one line per mutant, so a crash or a hang names the mutant it met.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from eagle import kernels
from eagle.kernels.gguf_check import GGUFFileError, check_gguf_file, read_gguf_header

HIDDEN, FF, HEADS, KV_HEADS, LAYERS = 64, 128, 4, 2, 2
QUERY = "blk.0.attn_q.weight"
CHILD_TIMEOUT = 300


def write_small_gguf(path: Path, seed: int = 0) -> None:
    """A 2-layer Llama of width 64 in Q4_1 (Q8_0 embedding, F32 norms) with the embedded model's tokenizer."""
    import gguf
    from gguf import GGMLQuantizationType, quants

    from eagle.defaults import default_base_model_path
    from eagle.export import TargetGGUF

    target = TargetGGUF(default_base_model_path())
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((writer.add_block_count, LAYERS), (writer.add_context_length, 256),
                       (writer.add_embedding_length, HIDDEN), (writer.add_feed_forward_length, FF),
                       (writer.add_head_count, HEADS), (writer.add_head_count_kv, KV_HEADS),
                       (writer.add_rope_dimension_count, HIDDEN // HEADS), (writer.add_rope_freq_base, 10000.0),
                       (writer.add_layer_norm_rms_eps, 1e-5), (writer.add_vocab_size, target.vocab_size)):
        add(value)
    for key, value, vtype, sub_type in target.tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)

    def quantized(name, rows, cols, type_name="Q4_1"):
        values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        kind = GGMLQuantizationType[type_name]
        writer.add_tensor(name, quants.quantize(values, kind), raw_dtype=kind)

    quantized("token_embd.weight", target.vocab_size, HIDDEN, "Q8_0")
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    head_dim = HIDDEN // HEADS
    for i in range(LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", 1 + 0.1 * rng.standard_normal(HIDDEN).astype(np.float32))
        for name, rows, cols in (("attn_q", HIDDEN, HIDDEN), ("attn_k", KV_HEADS * head_dim, HIDDEN),
                                 ("attn_v", KV_HEADS * head_dim, HIDDEN), ("attn_output", HIDDEN, HIDDEN),
                                 ("ffn_gate", FF, HIDDEN), ("ffn_up", FF, HIDDEN), ("ffn_down", HIDDEN, FF)):
            quantized(f"blk.{i}.{name}.weight", rows, cols)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------------------------------------ the mutants
def _entry(data: bytes, name: str) -> int:
    """Byte offset of tensor ``name``'s n_dims field in the tensor table."""
    encoded = name.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def _put(data: bytes, at: int, fmt: str, value) -> bytes:
    return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


def _field(data: bytes, name: str, field: str) -> int:
    """Byte offset of ``field`` ('dim0', 'dim1', 'type', 'offset') of a 2-D tensor's table entry."""
    return _entry(data, name) + {"dim0": 4, "dim1": 12, "type": 20, "offset": 24}[field]


def _data_at(header, name: str, byte: int) -> int:
    info = next(t for t in header.tensors if t.name == name)
    return header.data_start + info.offset + byte


def _metadata_value(data: bytes, key: str) -> int:
    """Byte offset of the value of metadata ``key`` (after its type field)."""
    encoded = key.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded) + 4


def _scramble(data: bytes, seed: int, start: int, end: int) -> bytes:
    rng = np.random.default_rng(seed)
    at = int(rng.integers(start, end - 8))
    return data[:at] + rng.integers(0, 256, 8, dtype=np.uint8).tobytes() + data[at + 8:]


def mutants(data: bytes, header) -> dict[str, tuple[bytes, str | None, str | None]]:
    """name -> (the mutated file, a fragment its error must hold or None when loading is also fine, the tensor the
    error must name or None)."""
    q, embd, norm = _field, "token_embd.weight", "blk.1.ffn_norm.weight"
    table = _entry(data, embd) - 8 - len(embd)
    fp16_nan, fp16_inf = struct.pack("<e", float("nan")), struct.pack("<e", float("inf"))

    def at_data(name, byte, raw):
        at = _data_at(header, name, byte)
        return data[:at] + raw + data[at + len(raw):]

    cases = {
        "magic": (b"GGUX" + data[4:], "expected the GGUF magic", None),
        "version": (_put(data, 4, "<I", 7), "GGUF version 7", None),
        "tensor count": (_put(data, 8, "<Q", 1 << 40), "declares 1099511627776 tensors", None),
        "kv count": (_put(data, 16, "<Q", 1 << 61), "metadata entries", None),
        "kv string length": (_put(data, _metadata_value(data, "general.architecture"), "<Q", 1 << 62),
                             "'general.architecture'", None),
        "block count": (_put(data, _metadata_value(data, "llama.block_count"), "<I", 3), "declares 3 blocks", None),
        "n_dims 0": (_put(data, _entry(data, QUERY), "<I", 0), "declares 0 dimensions", QUERY),
        "n_dims 7": (_put(data, _entry(data, QUERY), "<I", 7), "declares 7 dimensions", QUERY),
        "dim 0": (_put(data, q(data, QUERY, "dim1"), "<Q", 0), "every dim to be positive", QUERY),
        "dim off the block size": (_put(data, q(data, QUERY, "dim0"), "<Q", 48), "multiple of the Q4_1 block", QUERY),
        "dim off the config": (_put(data, q(data, QUERY, "dim1"), "<Q", 32), "expected [64, 64]", QUERY),
        "dim huge": (_put(data, q(data, QUERY, "dim1"), "<Q", 1 << 50), "expected [64, 64]", QUERY),
        "unknown type": (_put(data, q(data, QUERY, "type"), "<I", 99), "type id 99", QUERY),
        "smaller known type": (_put(data, q(data, QUERY, "type"), "<I", 2), "'blk.0.attn_q.weight' (Q4_0", None),
        "larger known type": (_put(data, q(data, QUERY, "type"), "<I", 0), "'blk.0.attn_q.weight' (F32", None),
        "misaligned offset": (_put(data, q(data, QUERY, "offset"), "<Q", header.tensors[5].offset + 1),
                              "expected a multiple of the alignment", None),
        "offset past the end": (_put(data, q(data, QUERY, "offset"), "<Q", 1 << 40), "past the end", QUERY),
        "cut in the header": (data[:100], "the 100 bytes of the file", None),
        "cut in the tensor table": (data[:table + 40], "the file ends at byte", None),
        "cut in the data": (data[:-1000], "past the end of the file", "blk.1.ffn_down.weight"),
        "nan scale d": (at_data(QUERY, 20 * 3, fp16_nan), "block 3 has a NaN or infinite scale d", QUERY),
        "inf scale m": (at_data("blk.1.ffn_up.weight", 20 * 7 + 2, fp16_inf), "infinite scale m",
                        "blk.1.ffn_up.weight"),
        "nan embedding scale": (at_data(embd, 34 * 100, fp16_nan), "block 100", embd),
        "nan norm weight": (at_data(norm, 4 * 5, struct.pack("<f", float("nan"))), "at element 5", norm),
        "random header bytes": (_scramble(data, 0, 4, 24), None, None),
    }
    for seed in range(1, 4):  # random bytes in the tensor table
        cases[f"random table bytes {seed}"] = (_scramble(data, seed, table, header.data_start), None, None)
    return cases


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "small.gguf"
    write_small_gguf(path)
    return path


@pytest.fixture(scope="module")
def mutant_files(small_gguf) -> dict[str, tuple[Path, str | None, str | None]]:
    data = small_gguf.read_bytes()
    header = read_gguf_header(small_gguf)
    files = {}
    for index, (name, (mutated, fragment, tensor)) in enumerate(mutants(data, header).items()):
        path = small_gguf.parent / f"mutant{index:02d}.gguf"
        path.write_bytes(mutated)
        files[name] = (path, fragment, tensor)
    return files


def assert_names_the_fault(message: str, path: Path, fragment: str | None, tensor: str | None) -> None:
    assert "\n" not in message and message.startswith(f"{path}: "), message
    if fragment is not None:
        assert fragment in message, message
    if tensor is not None:
        assert f"tensor {tensor!r}" in message, message


def test_the_small_file_passes_the_check(small_gguf):
    header = check_gguf_file(small_gguf)
    assert len(header.tensors) == 2 + 9 * LAYERS and small_gguf.stat().st_size < 8 << 20


def test_every_mutant_is_named_in_one_sentence(mutant_files):
    for name, (path, fragment, tensor) in mutant_files.items():
        try:
            check_gguf_file(path)
        except GGUFFileError as err:
            assert_names_the_fault(str(err), path, fragment, tensor)
        else:
            assert fragment is None, f"mutant {name!r} passed the check"


CHILD = """
import json, sys, traceback
import torch
from eagle.model.backends.gguf import kernel_numerics
from eagle.model.ea_model import EaModel
for name, path in json.loads(sys.argv[1]):
    print(json.dumps({"start": name}), flush=True)
    try:
        model = EaModel.from_pretrained(base_model_path=path, load_head=False)
        ids = model.tokenizer("Hello, world", return_tensors="pt").input_ids
        with torch.inference_mode():
            logits = model.base_model(ids).logits
        result = {"loaded": list(logits.shape), "finite": bool(torch.isfinite(logits).all()),
                  "numerics": kernel_numerics(model.base_model)}
    except Exception as err:
        frames = traceback.extract_tb(err.__traceback__)
        result = {"error": type(err).__name__, "message": str(err), "raised_in": frames[-1].filename}
    print(json.dumps({"name": name, **result}), flush=True)
"""


def run_child(cases: list[tuple[str, str]]) -> dict[str, dict]:
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cases)], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT, env=env, cwd=Path(__file__).resolve().parents[1])
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    started = [line["start"] for line in lines if "start" in line]
    assert proc.returncode == 0, (f"the loader died (exit {proc.returncode}) on {started[-1] if started else None!r}: "
                                  f"{proc.stderr[-3000:]}")
    return {line["name"]: line for line in lines if "name" in line}


def test_the_control_and_every_mutant_through_the_loader(small_gguf, mutant_files):
    cases = [("control", str(small_gguf))] + [(name, str(path)) for name, (path, _, _) in mutant_files.items()]
    results = run_child(cases)
    control = results["control"]
    assert control.get("loaded", [])[-1:] == [49152] and control["finite"], control
    assert control["numerics"] is not None or not kernels.available(), control  # it computes over the blocks
    for name, (path, fragment, tensor) in mutant_files.items():
        result = results[name]
        if "loaded" in result:
            assert fragment is None and result["finite"], (name, result)
            continue
        assert result["error"] == "GGUFFileError" and result["raised_in"].endswith("gguf_check.py"), (name, result)
        assert_names_the_fault(result["message"], path, fragment, tensor)


def test_dims_that_disagree_with_a_transformers_config_are_named(small_gguf):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=FF, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, num_hidden_layers=LAYERS, vocab_size=49152)
    check_gguf_file(small_gguf, config)
    config.intermediate_size = 2 * FF
    with pytest.raises(GGUFFileError, match=r"tensor 'blk.0.ffn_gate.weight' has dims \[64, 128\], expected "
                                            r"\[64, 256\] from the config"):
        check_gguf_file(small_gguf, config)
