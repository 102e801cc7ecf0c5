"""Validation of a GGUF file before anything else reads it: one sentence naming the file, the tensor and the fault.

:func:`check_gguf_file` parses the header, the metadata and the tensor table with explicit bounds (every count and
length is checked against the bytes left in the file before anything is allocated from it), then checks each
tensor's dimension count, dims, type id, block size, alignment and data extent, that the tensors lie one after the
other as llama.cpp requires, that their dims agree with the model's sizes (the file's metadata, or a transformers
config), and that no block scale of a quantized tensor and no value of a float tensor is NaN or infinite. Every
fault is a :class:`GGUFFileError` (a ValueError). The scan of scales reads the file through a memory map, a few
strided bytes per block, with numpy.
"""

from __future__ import annotations

import math
import os
import re
import struct
from dataclasses import dataclass, field

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
# Byte offsets, inside one block, of each type's fp16 scale fields (d, and dmin / m where the type has one).
SCALE_FIELDS = {"Q4_0": {"d": 0}, "Q4_1": {"d": 0, "m": 2}, "Q5_0": {"d": 0}, "Q5_1": {"d": 0, "m": 2},
                "Q8_0": {"d": 0}, "Q2_K": {"d": 80, "dmin": 82}, "Q3_K": {"d": 108}, "Q4_K": {"d": 0, "dmin": 2},
                "Q5_K": {"d": 0, "dmin": 2}, "Q6_K": {"d": 208}, "IQ4_NL": {"d": 0}, "IQ4_XS": {"d": 0}}
# Float types: the unsigned view of one value and the exponent mask that marks NaN and infinity.
FLOAT_MASKS = {"F16": (np.dtype("<u2"), 0x7C00), "BF16": (np.dtype("<u2"), 0x7F80), "F32": (np.dtype("<u4"), 0x7F800000)}
SCAN_CHUNK = 1 << 22  # values or blocks scanned at a time (bounded temporaries on a multi-GB file)
# Metadata value types: struct format of the scalars; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
# Architectures whose tensors of these names have the plain shapes of :func:`_expected_dims`.
PLAIN_ARCHS = {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "granite"}
# What every file of those architectures holds: metadata sizes and, in every block, the attention projections.
PLAIN_KEYS = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
PLAIN_BLOCK = ("attn_q", "attn_k", "attn_v", "attn_output")


class GGUFFileError(ValueError):
    """A malformed GGUF file: the message is one sentence naming the file and, where one is at fault, the tensor."""


@dataclass(frozen=True)
class StringArray:
    """A metadata array of strings, kept as its length (a vocabulary's strings are not needed to check a file)."""

    count: int


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table: GGUF dims (fastest-varying first), type, data offset and byte count."""

    name: str
    dims: tuple[int, ...]
    type_name: str
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    """What :func:`read_gguf_header` parses: version, metadata, tensor table, alignment and data start."""

    path: str
    size: int
    version: int = 0
    metadata: dict = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    alignment: int = DEFAULT_ALIGNMENT
    data_start: int = 0


class _Cursor:
    """Reads little-endian fields of the mapped file at a moving position, never past its end."""

    def __init__(self, data: memoryview, path: str):
        self.data, self.path, self.pos = data, path, 0

    def fits(self, count: int, what: str) -> None:
        start, end = self.pos, self.pos + count
        if end > len(self.data):
            raise GGUFFileError(f"{self.path}: {what} needs bytes {start}..{end}, but the file ends at byte "
                                f"{len(self.data)} (truncated or corrupted)")

    def need(self, count: int, what: str) -> int:
        self.fits(count, what)
        self.pos += count
        return self.pos - count

    def skip_strings(self, count: int, what: str) -> None:
        """Step over ``count`` length-prefixed strings without decoding them."""
        unpack, data, pos, size = struct.unpack_from, self.data, self.pos, len(self.data)
        for index in range(count):
            end = pos + 8 + (unpack("<Q", data, pos)[0] if pos + 8 <= size else 0)
            if end > size:
                self.pos = pos
                self.fits(end - pos, f"string {index} of {what}")
            pos = end
        self.pos = pos

    def scalar(self, fmt: str, what: str):
        return struct.unpack_from(fmt, self.data, self.need(struct.calcsize(fmt), what))[0]

    def string(self, what: str, strict: bool = False) -> str:
        length = self.scalar("<Q", f"the length of {what}")
        start = self.need(length, f"{what} ({length} bytes long)")
        raw = bytes(self.data[start:start + length])
        try:
            return raw.decode("utf-8", errors="strict" if strict else "replace")
        except UnicodeDecodeError:
            raise GGUFFileError(f"{self.path}: {what} at byte {start} is not valid UTF-8 ({raw[:40]!r})") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY or depth > 1:
            raise GGUFFileError(f"{self.path}: {what} has an unknown value type {vtype} at byte {self.pos - 4}")
        item_type = self.scalar("<I", f"the item type of {what}")
        count = self.scalar("<Q", f"the length of {what}")
        if item_type in _SCALARS:
            fmt = _SCALARS[item_type]
            start = self.need(count * struct.calcsize(fmt), f"{what} ({count} items)")
            return np.frombuffer(self.data, dtype=np.dtype(fmt), count=count, offset=start)
        self.fits(8 * count, f"{what} ({count} items)")  # every string or array item holds 8 bytes at least
        if item_type == _STRING:
            self.skip_strings(count, what)
            return StringArray(count)
        return [self.value(item_type, f"item {i} of {what}", depth + 1) for i in range(count)]


def _tensor_info(cursor: _Cursor, index: int, count: int) -> TensorInfo:
    path = cursor.path
    name = cursor.string(f"the name of tensor {index} of {count}", strict=True)
    n_dims = cursor.scalar("<I", f"the dimension count of tensor {name!r}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise GGUFFileError(f"{path}: tensor {name!r} declares {n_dims} dimensions, expected 1 to {MAX_DIMS}")
    dims = tuple(cursor.scalar("<Q", f"dim {i} of tensor {name!r}") for i in range(n_dims))
    type_id = cursor.scalar("<I", f"the type of tensor {name!r}")
    offset = cursor.scalar("<Q", f"the data offset of tensor {name!r}")
    if min(dims) <= 0:
        raise GGUFFileError(f"{path}: tensor {name!r} has dims {list(dims)}, expected every dim to be positive")
    try:
        type_name = GGMLQuantizationType(type_id).name
    except ValueError:
        raise GGUFFileError(f"{path}: tensor {name!r} has type id {type_id}, which is no known GGML type") from None
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    if dims[0] % block:
        raise GGUFFileError(f"{path}: tensor {name!r} ({type_name}) has a first dim of {dims[0]}, expected a "
                            f"multiple of the {type_name} block size {block}")
    nbytes = math.prod(dims) // block * type_size
    return TensorInfo(name, dims, type_name, offset, nbytes)


def read_gguf_header(path: str | os.PathLike) -> GGUFHeader:
    """Parse the header, the metadata and the tensor table of the GGUF file at ``path`` (bounded by its size)."""
    path = os.fspath(path)
    size = os.path.getsize(path)
    if size < 24:
        raise GGUFFileError(f"{path}: {size} bytes is too short for a GGUF header (24 bytes at least)")
    cursor = _Cursor(memoryview(np.memmap(path, dtype=np.uint8, mode="r")), path)
    header = GGUFHeader(path, size)
    magic = bytes(cursor.data[cursor.need(4, "the magic"):][:4])
    if magic != GGUF_MAGIC:
        raise GGUFFileError(f"{path}: starts with {magic!r}, expected the GGUF magic {GGUF_MAGIC!r}")
    header.version = cursor.scalar("<I", "the version")
    if header.version not in VERSIONS:
        swapped = " (a big-endian file, which is not read here)" if header.version >> 24 in VERSIONS else ""
        raise GGUFFileError(f"{path}: GGUF version {header.version}{swapped}, expected one of {list(VERSIONS)}")
    n_tensors, n_kv = cursor.scalar("<Q", "the tensor count"), cursor.scalar("<Q", "the metadata count")
    for count, what, least in ((n_tensors, "tensors", 28), (n_kv, "metadata entries", 13)):
        if count * least > size - cursor.pos:
            raise GGUFFileError(f"{path}: the header declares {count} {what}, more than the {size} bytes of the "
                                "file can hold (truncated or corrupted)")
    for index in range(n_kv):
        key = cursor.string(f"the key of metadata entry {index}")
        header.metadata[key] = cursor.value(cursor.scalar("<I", f"the type of {key!r}"), f"metadata {key!r}")
    header.tensors = [_tensor_info(cursor, index, n_tensors) for index in range(n_tensors)]
    alignment = header.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFFileError(f"{path}: general.alignment is {alignment!r}, expected a positive power of two")
    header.alignment = alignment
    header.data_start = -(-cursor.pos // alignment) * alignment
    return header


def _check_layout(header: GGUFHeader) -> None:
    """Each tensor aligned, inside the file, right after the one before it (llama.cpp's layout), names unique."""
    path, expected, seen, before = header.path, 0, set(), None
    for info in header.tensors:
        if info.name in seen:
            raise GGUFFileError(f"{path}: tensor {info.name!r} appears twice in the tensor table")
        seen.add(info.name)
        start = header.data_start + info.offset
        if info.offset % header.alignment:
            raise GGUFFileError(f"{path}: tensor {info.name!r} has data offset {info.offset}, expected a multiple "
                                f"of the alignment {header.alignment}")
        if start + info.nbytes > header.size:
            raise GGUFFileError(f"{path}: tensor {info.name!r} ({info.type_name}, dims {list(info.dims)}) data runs "
                                f"past the end of the file (needs bytes {start}..{start + info.nbytes}, the file has "
                                f"{header.size})")
        if info.offset != expected:
            after = (f"the tensor before it, {before.name!r} ({before.type_name}, dims {list(before.dims)}), ends "
                     f"(padded) at {expected}" if before else "the first tensor's data starts at offset 0")
            raise GGUFFileError(f"{path}: tensor {info.name!r} has data offset {info.offset}, but {after}: a type, "
                                "dims or offset in the tensor table is wrong")
        expected, before = info.offset + -(-info.nbytes // header.alignment) * header.alignment, info


def _first_nonfinite(data: np.ndarray, start: int, count: int, stride: int, dtype: np.dtype, mask: int):
    """Index of the first of ``count`` values (``stride`` bytes apart from byte ``start``) whose exponent bits are
    all set (NaN or infinity), or None."""
    for first in range(0, count, SCAN_CHUNK):
        n = min(SCAN_CHUNK, count - first)
        values = np.ndarray((n,), dtype, buffer=data, offset=start + first * stride, strides=(stride,))
        bad = np.flatnonzero((values & mask) == mask)
        if bad.size:
            return first + int(bad[0])
    return None


def _check_values(header: GGUFHeader, data: np.ndarray) -> None:
    """No NaN or infinite scale in any block of a quantized tensor, no such value in a float tensor."""
    for info in header.tensors:
        start = header.data_start + info.offset
        if info.type_name in FLOAT_MASKS:
            dtype, mask = FLOAT_MASKS[info.type_name]
            index = _first_nonfinite(data, start, info.nbytes // dtype.itemsize, dtype.itemsize, dtype, mask)
            if index is not None:
                raise GGUFFileError(f"{header.path}: tensor {info.name!r} ({info.type_name}) holds a NaN or "
                                    f"infinite value at element {index}, expected finite weights")
            continue
        type_size = GGML_QUANT_SIZES[GGMLQuantizationType[info.type_name]][1]
        for scale, at in SCALE_FIELDS.get(info.type_name, {}).items():
            index = _first_nonfinite(data, start + at, info.nbytes // type_size, type_size, np.dtype("<u2"), 0x7C00)
            if index is not None:
                raise GGUFFileError(f"{header.path}: tensor {info.name!r} ({info.type_name}) block {index} has a NaN "
                                    f"or infinite scale {scale}, expected a finite fp16 scale")


def _sizes(header: GGUFHeader, config) -> dict:
    """The model's sizes, from ``config`` (a transformers config) where given, else from the file's metadata."""
    meta = header.metadata
    arch = meta.get("general.architecture")

    def get(key):
        value = meta.get(f"{arch}.{key}")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    tokens = meta.get("tokenizer.ggml.tokens")
    sizes = {"hidden": get("embedding_length"), "heads": get("attention.head_count"), "ff": get("feed_forward_length"),
             "layers": get("block_count"), "vocab": get("vocab_size") or getattr(tokens, "count", None)}
    sizes["kv_heads"] = get("attention.head_count_kv") or sizes["heads"]
    sizes["head_dim"] = get("attention.key_length") or (sizes["hidden"] // sizes["heads"]
                                                        if sizes["hidden"] and sizes["heads"] else None)
    sizes["value_dim"] = get("attention.value_length") or sizes["head_dim"]
    names = {"hidden": "hidden_size", "heads": "num_attention_heads", "ff": "intermediate_size",
             "layers": "num_hidden_layers", "vocab": "vocab_size", "kv_heads": "num_key_value_heads",
             "head_dim": "head_dim", "value_dim": "head_dim"}
    for key, attr in names.items():
        value = getattr(config, attr, None) if config is not None else None
        if isinstance(value, int):
            sizes[key] = value
    sizes["plain"] = arch in PLAIN_ARCHS
    return sizes


def _expected_dims(s: dict) -> dict[str, tuple]:
    """GGUF dims (input first) of each tensor the plain decoder architectures share, by name within a block."""
    hidden, ff, q, kv, v = s["hidden"], s["ff"], None, None, None
    if s["heads"] and s["head_dim"]:
        q, kv, v = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"], s["kv_heads"] * s["value_dim"]
    dims = {"token_embd.weight": (hidden, s["vocab"]), "output.weight": (hidden, s["vocab"])}
    if s["plain"]:
        dims.update({"output_norm.weight": (hidden,), "attn_norm.weight": (hidden,), "ffn_norm.weight": (hidden,),
                     "attn_q.weight": (hidden, q), "attn_k.weight": (hidden, kv), "attn_v.weight": (hidden, v),
                     "attn_output.weight": (s["heads"] * s["value_dim"] if q else None, hidden),
                     "ffn_gate.weight": (hidden, ff), "ffn_up.weight": (hidden, ff), "ffn_down.weight": (ff, hidden)})
    return {name: shape for name, shape in dims.items() if None not in shape}


def _check_dims(header: GGUFHeader, config) -> None:
    """Every tensor's dims agree with the model's sizes; block indices agree with the block count."""
    sizes = _sizes(header, config)
    expected, source = _expected_dims(sizes), "the config" if config is not None else "the file's metadata"
    layers = []
    for info in header.tensors:
        match = _LAYER.fullmatch(info.name)
        if match:
            layers.append(int(match.group(1)))
        want = expected.get(match.group(2) if match else info.name)
        if want is not None and tuple(info.dims) != want:
            raise GGUFFileError(f"{header.path}: tensor {info.name!r} has dims {list(info.dims)}, expected "
                                f"{list(want)} from {source}")
    declared = sizes["layers"]
    if declared is not None and layers and max(layers) + 1 != declared:
        raise GGUFFileError(f"{header.path}: {source} declares {declared} blocks, but the file's tensors are those of "
                            f"{max(layers) + 1} (blk.0 to blk.{max(layers)})")
    if sizes["plain"]:
        _check_complete(header, declared or 0)


def _check_complete(header: GGUFHeader, layers: int) -> None:
    """A plain decoder's file holds the sizes its loaders read and the embedding and attention of every block."""
    arch = header.metadata["general.architecture"]
    for key in PLAIN_KEYS:
        if not isinstance(header.metadata.get(f"{arch}.{key}"), int):
            raise GGUFFileError(f"{header.path}: the metadata has no integer {arch}.{key}, which a {arch} model needs")
    names = {info.name for info in header.tensors}
    wanted = ["token_embd.weight"] + [f"blk.{i}.{part}.weight" for i in range(layers) for part in PLAIN_BLOCK]
    missing = [name for name in wanted if name not in names]
    if missing:
        raise GGUFFileError(f"{header.path}: tensor {missing[0]!r} is missing ({len(missing)} tensors of a {arch} "
                            f"model with {layers} blocks are)")


def check_gguf_file(path: str | os.PathLike, config=None) -> GGUFHeader:
    """Check the GGUF file at ``path`` and return its parsed header; raise :class:`GGUFFileError` (one sentence
    naming the file and, where one is at fault, the tensor) on the first fault found: a bad magic or version, a
    count or length past the end of the file, an unknown tensor type, dims that disagree with the type's block size
    or with the model's sizes (``config``, a transformers config, or else the file's metadata), a misaligned or
    misplaced data offset, data past the end of the file, a NaN or infinite block scale or float value."""
    header = read_gguf_header(path)
    _check_dims(header, config)
    _check_layout(header)
    _check_values(header, np.memmap(header.path, dtype=np.uint8, mode="r"))
    return header
