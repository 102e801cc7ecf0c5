"""A GGUF file's tensors as they are stored: their blocks, memory-mapped, with the torch-layout shape.

:func:`read_gguf_weights` reads a file through gguf-py's ``GGUFReader`` (memory-mapped, copy-on-write: nothing is
read until used, nothing is written back) into :class:`GGUFWeight` objects. Every tensor's byte count is checked
against its declared type and shape before anything reads it: a corrupted or truncated tensor is a ValueError that
names it, never a crash later in native code. The blocks stay a view of the file until a consumer repacks them
(:class:`eagle.kernels.linear.QuantLinear`), so resident memory is the file's blocks, not a float32 copy.

:class:`GGUFTensorFile` reads the same tensors one at a time, each into memory of its own that is freed once its
consumer has repacked it: a loader that repacks a whole model holds one tensor's bytes besides the packed layout,
never the file's pages mapped and the packed copy at once.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType


@dataclass(frozen=True)
class GGUFWeight:
    """One tensor of a GGUF file.

    ``shape`` is torch's layout (a linear weight is (out_features N, in_features K), the reverse of GGUF's dims);
    ``blocks`` is a uint8 tensor (rows, row_bytes) of the file's bytes for it, one row per row of ``shape``
    (rows = prod(shape[:-1])), each row ``shape[-1] / block_size`` blocks of the type."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    blocks: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[-1]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def permute_rows(self, order: torch.Tensor) -> GGUFWeight:
        """A copy whose row ``i`` is row ``order[i]`` of this one (whole rows of blocks move; ``order`` a
        permutation of range(rows)). Row ``i`` of its dequantized weight is row ``order[i]`` of this one's."""
        rows = self.blocks.shape[0]
        order = torch.as_tensor(order, dtype=torch.long)
        if order.shape != (rows,) or not torch.equal(torch.sort(order).values, torch.arange(rows)):
            raise ValueError(f"permute_rows({self.name!r}): expected a permutation of range({rows}), got a tensor "
                             f"of shape {tuple(order.shape)} that is not one")
        return GGUFWeight(self.name, self.type_name, self.shape, self.blocks.index_select(0, order).contiguous())

    @staticmethod
    def concat_rows(weights: list[GGUFWeight], name: str) -> GGUFWeight:
        """One weight whose rows are those of ``weights`` in order (2-D weights of one type and in_features): a
        fused projection (query, key and value; gate and up) computed by one kernel call instead of several. Each
        output of the fused layer has the bits it has in its own layer (an output depends only on its row)."""
        first = weights[0]
        if any(len(w.shape) != 2 or w.type_name != first.type_name or w.in_features != first.in_features
               for w in weights):
            raise ValueError(f"concat_rows({name!r}): expected 2-D weights of one type and in_features, got "
                             f"{[(w.type_name, w.shape) for w in weights]}")
        rows = sum(w.out_features for w in weights)
        return GGUFWeight(name, first.type_name, (rows, first.in_features), torch.cat([w.blocks for w in weights]))

    def dequantize(self) -> torch.Tensor:
        """The float32 tensor of ``shape`` that gguf-py's ``dequantize`` (and transformers) builds from it."""
        from eagle.kernels.reference import dequantize

        return dequantize(self.type_name, self.blocks, self.shape)


def llama_qk_row_order(rows: int, n_head: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's permutation of a Llama-family Q or K projection (``n_head``: the
    attention heads for Q, the key/value heads for K), as transformers applies it when it dequantizes a GGUF:
    ``weight.permute_rows(llama_qk_row_order(...))`` gives the rows transformers' model holds."""
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"{rows} rows cannot be split into {n_head} heads of rotary pairs")
    return torch.arange(rows).reshape(n_head, rows // n_head // 2, 2).transpose(1, 2).reshape(-1)


def _expected_bytes(name: str, type_name: str, shape: tuple[int, ...]) -> int:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if not shape or shape[-1] % block:
        raise ValueError(f"GGUF tensor {name!r}: its last dimension ({shape[-1] if shape else None}) is not a "
                         f"multiple of the {type_name} block size ({block})")
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * type_size


class _TensorReader(GGUFReader):
    """gguf-py's reader for the tensors: it checks that every tensor lies inside the file before viewing it (the
    stock reader fails on a truncated file with a reshape error that names no tensor), and it skips the contents of
    metadata arrays of strings (a tokenizer's vocabulary: the stock reader builds one numpy view per string, tens
    of seconds for a 262,144-token vocabulary); their fields keep only their type and length."""

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype, count = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item_type, offs = GGUFValueType(int(raw_itype[0])), orig_offs + 12
        scalar = self.gguf_scalar_to_np.get(item_type)
        if scalar is not None:
            values = self._get(offs, scalar, int(count[0]))
            return 12 + int(values.nbytes), [raw_itype, count, values], [2], [GGUFValueType.ARRAY, item_type]
        if item_type != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        for _ in range(int(count[0])):  # walk the strings' lengths, keep nothing
            offs += 8 + struct.unpack_from("<Q", self.data, offs)[0]
        return offs - orig_offs, [raw_itype, count], [], [GGUFValueType.ARRAY, item_type]

    def _build_tensors(self, start_offs: int, fields: list) -> None:
        size = len(self.data)
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                type_name = GGMLQuantizationType(int(raw_dtype[0])).name
            except ValueError:
                raise ValueError(f"GGUF tensor {name!r} has an unknown type id {int(raw_dtype[0])}") from None
            shape = tuple(int(d) for d in reversed(dims.tolist()))
            start = int(start_offs + offset_tensor[0])
            end = start + _expected_bytes(name, type_name, shape)
            if end > size:
                raise ValueError(f"GGUF tensor {name!r} ({type_name}, shape {shape}) needs bytes {start}..{end} of "
                                 f"the file, which holds {size}: the file is truncated or corrupted")
        super()._build_tensors(start_offs, fields)


def read_gguf_weights(path: str | os.PathLike, names: set[str] | None = None) -> dict[str, GGUFWeight]:
    """Every tensor of the GGUF file at ``path`` (or those in ``names``), by GGUF name, as :class:`GGUFWeight`
    views of the memory-mapped file. Raises ValueError naming the tensor when one is truncated or its byte count
    does not match its type and shape."""
    reader = _TensorReader(path, "c")
    weights = {}
    for tensor in reader.tensors:
        if names is not None and tensor.name not in names:
            continue
        type_name = tensor.tensor_type.name
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        expected = _expected_bytes(tensor.name, type_name, shape)
        data = np.asarray(tensor.data)
        if data.nbytes != expected:
            raise ValueError(f"GGUF tensor {tensor.name!r} ({type_name}, shape {shape}) holds {data.nbytes} bytes, "
                             f"its type and shape need {expected}")
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        blocks = torch.from_numpy(data.reshape(-1).view(np.uint8)).reshape(rows, expected // max(rows, 1))
        weights[tensor.name] = GGUFWeight(tensor.name, type_name, shape, blocks)
    if names is not None and (missing := set(names) - set(weights)):
        raise KeyError(f"{path} has no tensor named {sorted(missing)}")
    return weights


class GGUFTensorFile:
    """A GGUF file's tensors by name, each read from the file when asked for (``file[name]`` -> :class:`GGUFWeight`
    whose blocks are a fresh copy of its bytes, not a view of a mapping). The header and the tensor table are read
    once, by the bounded parser that checks files (:func:`eagle.kernels.gguf_check.read_gguf_header`), which also
    gives :attr:`metadata` (its vocabulary strings only counted); a tensor whose bytes the file does not hold is
    an error when it is read."""

    def __init__(self, path: str | os.PathLike):
        from eagle.kernels.gguf_check import read_gguf_header

        self.path = os.fspath(path)
        header = read_gguf_header(self.path)
        self.metadata = header.metadata
        self._data_start = header.data_start
        self._entries = {info.name: info for info in header.tensors}

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def type_name(self, name: str) -> str:
        return self._entries[name].type_name

    def get(self, name: str | None, default=None) -> GGUFWeight | None:
        return self[name] if name in self._entries else default

    def __getitem__(self, name: str) -> GGUFWeight:
        entry = self._entries.get(name)
        if entry is None:
            raise KeyError(f"{self.path} has no tensor named {name!r}")
        data = np.fromfile(self.path, dtype=np.uint8, count=entry.nbytes, offset=self._data_start + entry.offset)
        if data.nbytes != entry.nbytes:
            raise ValueError(f"GGUF tensor {name!r} of {self.path}: read {data.nbytes} of its {entry.nbytes} bytes "
                             "(the file changed or is truncated)")
        shape = tuple(reversed(entry.dims))  # (rows, ..., inputs), as GGUFWeight holds it
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        blocks = torch.from_numpy(data).reshape(rows, entry.nbytes // max(rows, 1))
        return GGUFWeight(name, entry.type_name, shape, blocks)
