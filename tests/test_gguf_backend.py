"""The GGUF backend on the embedded pair (SmolLM2-135M-Instruct Q4_1 + the EAGLE-3 head): its layers compute over the
file's blocks, the weights are exactly transformers' float32 weights, and greedy EAGLE's logits at every accepted
position are bit-equal to plain decoding's, at batch 1 and in a left-padded batch, in both numerics."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch
from torch import nn

from chat_helpers import chat_template_ids
from eagle import defaults, kernels
from eagle.kernels.linear import QuantEmbedding, QuantLinear
from eagle.model import pretrained
from eagle.model.base.logits import TreeLogits
from eagle.model.ea_model import EaModel
from eagle.model.engine import loop
from eagle.model.backends import attention, gguf

pytestmark = [pytest.mark.skipif(not kernels.available(), reason="eagle's native kernels are not built here"),
              pytest.mark.e2e]  # the embedded SmolLM2 pair through the kernels

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers and explain why they are prime.",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def loaded_base():
    """The float32 model transformers builds from the embedded GGUF, loaded once; each model below gets a copy."""
    return pretrained.load_base_model(defaults.default_base_model_path())


@pytest.fixture(scope="module")
def load(loaded_base):
    """``load(gguf_kernels)``: an EaModel of the embedded pair, its base a copy of :func:`loaded_base`."""
    patch, real = pytest.MonkeyPatch(), pretrained.load_base_model
    embedded = defaults.default_base_model_path()

    def load_base_model(path, **kwargs):
        if path != embedded or kwargs:
            return real(path, **kwargs)
        return copy.deepcopy(loaded_base[0]), loaded_base[1]

    patch.setattr(pretrained, "load_base_model", load_base_model)
    models = {}

    def make(gguf_kernels):
        """``"default"``: from_pretrained without the option, as a user calls it."""
        if gguf_kernels not in models:
            option = {} if gguf_kernels == "default" else {"gguf_kernels": gguf_kernels}
            models[gguf_kernels] = EaModel.from_pretrained(**option)
        return models[gguf_kernels]

    yield make
    patch.undo()


class _Recorder:
    """One row's logits as verification reads them: every read is kept (greedy verification reads exactly the
    logits that choose each emitted token: the accepted nodes', in order)."""

    def __init__(self, inner, sink: list):
        self.inner, self.sink = inner, sink

    def __getitem__(self, node):
        value = self.inner[node]
        self.sink.append(value.detach().clone())
        return value


class _RecordedLogits(TreeLogits):
    """A verification's logits, each row's reads kept by a :class:`_Recorder`."""

    def __init__(self, inner: TreeLogits, sinks: list[list]):
        self.inner, self.rows = inner, [_Recorder(inner.row(b), sink) for b, sink in enumerate(sinks)]

    def row(self, batch_row: int):
        return self.rows[batch_row]

    def fetch(self, wanted):
        self.inner.fetch(wanted)


def _generate_recording(monkeypatch, generate, prompts) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """Run ``generate`` (eagenerate / naivegenerate) on ``prompts`` (one prompt: batch 1; several: a left-padded
    batch); returns each row's new tokens and the logits that chose them."""
    sinks: dict[int, list] = {}
    original = loop.verify_trees

    def recording(target, trees, cache, rows, *args, **kwargs):
        verified = original(target, trees, cache, rows, *args, **kwargs)
        wrapped = _RecordedLogits(verified.logits, [sinks.setdefault(row, []) for row in rows.index])
        return dataclasses.replace(verified, logits=wrapped)

    monkeypatch.setattr(loop, "verify_trees", recording)
    try:
        ids = prompts[0] if len(prompts) == 1 else [p[0] for p in prompts]
        out = generate(ids, max_new_tokens=NEW_TOKENS)
    finally:
        monkeypatch.setattr(loop, "verify_trees", original)
    start = max(prompt.shape[1] for prompt in prompts)  # a batch is left-padded to its longest prompt
    return [out[b, start:].tolist() for b in range(len(prompts))], [sinks[b] for b in range(len(prompts))]


def _assert_bit_equal(eagle_logits: list[torch.Tensor], plain_logits: list[torch.Tensor], emitted: int,
                      what: str) -> None:
    """Every token after the prefill's was chosen by one recorded logits row: ``emitted - 1`` of them at least."""
    count = min(len(eagle_logits), len(plain_logits))
    assert count >= max(emitted - 1, 1), (what, len(eagle_logits), len(plain_logits), emitted)
    for position in range(count):
        assert torch.equal(eagle_logits[position], plain_logits[position]), (what, position)


# ------------------------------------------------------------------------------------------------ the layers
def test_every_weight_computes_over_the_gguf_blocks(load):
    model = load("float32")
    base = model.base_model
    assert not [name for name, m in base.named_modules() if type(m) is nn.Linear]  # no float linear left
    linears = [m for m in base.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 30 * 7 + 1 and all(m.uses_kernels and m.numerics == "float32" for m in linears)
    embedding, head = base.get_input_embeddings(), base.get_output_embeddings()
    assert isinstance(embedding, QuantEmbedding) and embedding.uses_kernels
    assert isinstance(head, QuantLinear) and head.type_name == "Q8_0"
    assert embedding.weight is head.weight  # the tied LM head shares the embedding's blocks
    assert model.ea_layer.embed_tokens is embedding  # the draft head reads the quantized embedding, no float copy
    packed = sum(m.weight.packed.numel() for m in linears)
    assert packed < 100 * 2**20  # about the file's size (98 MB), not 540 MB of float32
    assert model.engine.target.forward_plan.kernel_attention


def test_int8_numerics_reach_every_layer(load):
    model = load("int8")
    linears = [m for m in model.base_model.modules() if isinstance(m, QuantLinear)]
    assert linears and all(m.numerics == "int8" and m.uses_kernels for m in linears)
    assert gguf.kernel_numerics(model.base_model) == "int8" and gguf.kernel_numerics(load(False).base_model) is None


def test_the_default_is_int8_activations_with_the_heads_int8_tree(load):
    """Every default on a GGUF on the CPU: int8 activations (what llama.cpp computes), in the target and the draft
    head, drafting with the tree the head carries for int8 activations."""
    from eagle.model.tuning.head_tree import embedded_tree_settings

    model = load("default")
    assert gguf.AUTO_NUMERICS == "int8" and gguf.kernel_numerics(model.base_model) == "int8"
    linears = [m for m in model.base_model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 30 * 7 + 1 and all(m.numerics == "int8" and m.uses_kernels for m in linears)
    head_linears = [m for m in model.ea_layer.modules() if isinstance(m, QuantLinear)]
    assert head_linears and all(m.numerics == "int8" for m in head_linears)
    settings = model.tree_settings
    tree = embedded_tree_settings("cpu-gguf-int8")
    assert {key: getattr(settings, key) for key in tree} == tree


def test_float32_logits_are_the_float32_models_and_the_defaults_are_int8s(load, loaded_base):
    """``gguf_kernels="float32"``: transformers' float32 model to float rounding; the default: the int8 numerics'
    logits bit for bit, which are not the float32 ones."""
    ids = chat_template_ids(load("float32"), PROMPTS[2])
    with torch.no_grad():
        reference = loaded_base[0](ids).logits
        logits = {name: load(name).base_model(ids).logits for name in ("float32", "int8", "default")}
    torch.testing.assert_close(logits["float32"], reference, rtol=1e-4, atol=1e-3)
    assert torch.equal(logits["default"], logits["int8"])
    assert not torch.equal(logits["default"], logits["float32"])


def test_off_gives_the_float32_model(load):
    model = load(False)
    base = model.base_model
    assert not any(isinstance(m, (QuantLinear, QuantEmbedding)) for m in base.modules())
    assert isinstance(base.get_input_embeddings(), nn.Embedding)
    assert not model.engine.target.forward_plan.kernel_attention


def test_each_model_drafts_with_the_tree_the_head_carries_for_its_backend(load):
    """The kernels' costs differ from the float32 model's (several rows cost several times one): the embedded head
    carries a tree for each, and from_pretrained picks the one of the backend the model runs on."""
    from eagle.model.tuning.head_tree import embedded_tree_settings

    for gguf_kernels, kind in (("float32", "cpu-gguf"), ("int8", "cpu-gguf-int8"), (False, "cpu")):
        settings = load(gguf_kernels).tree_settings
        assert {key: getattr(settings, key) for key in embedded_tree_settings(kind)} == embedded_tree_settings(kind)
    assert embedded_tree_settings("cpu-gguf") != embedded_tree_settings("cpu")
    assert embedded_tree_settings("cpu-gguf-int8") != embedded_tree_settings("cpu-gguf")


@pytest.mark.parametrize("value", ["fast", True, "on", 8])
def test_bad_values_of_the_option_are_clear_errors(value):
    with pytest.raises(ValueError, match="gguf_kernels must be 'auto', 'float32', 'int8' or False"):
        EaModel.from_pretrained(gguf_kernels=value)


def test_explicit_kernels_on_a_model_that_is_not_gguf_are_refused(tiny_pair):
    base_dir, head_dir = tiny_pair
    with pytest.raises(ValueError, match="is not a GGUF file"):
        EaModel.from_pretrained(base_model_path=str(base_dir), ea_model_path=str(head_dir), gguf_kernels="int8")
    model = EaModel.from_pretrained(base_model_path=str(base_dir), ea_model_path=str(head_dir))  # auto: left alone
    assert not any(isinstance(m, QuantLinear) for m in model.base_model.modules())


def test_a_weight_that_differs_from_the_blocks_is_refused_by_name(loaded_base):
    base = copy.deepcopy(loaded_base[0])
    with torch.no_grad():
        base.model.layers[3].mlp.up_proj.weight[5, 7] += 1e-3
    with pytest.raises(ValueError, match=r"'blk\.3\.ffn_up\.weight'.*do not dequantize"):
        gguf.convert_gguf_model(base, defaults.default_base_model_path())


def test_a_type_the_kernels_do_not_handle_stays_float(loaded_base, monkeypatch, caplog):
    base = copy.deepcopy(loaded_base[0])
    monkeypatch.setattr(gguf, "kernel_handles", lambda type_name: type_name != "Q4_1")
    monkeypatch.setattr(gguf, "_logged", set())
    with caplog.at_level(logging.WARNING, logger=gguf.__name__):
        count = gguf.convert_gguf_model(base, defaults.default_base_model_path())
    assert count == 2  # the Q8_0 embedding and the LM head over it
    assert sum(type(m) is nn.Linear for m in base.modules()) == 30 * 7
    assert [r.getMessage() for r in caplog.records].count(
        "GGUF kernels: GGUF type Q4_1 (blk.0.attn_q.weight and any like it) stays a float32 layer.") == 1


def test_restore_gives_float_layers_with_the_same_weights(loaded_base):
    base = copy.deepcopy(loaded_base[0])
    gguf.convert_gguf_model(base, defaults.default_base_model_path())
    assert gguf.GGUFLinear(defaults.default_base_model_path()).restore(base) == 30 * 7 + 1
    assert torch.equal(base.model.layers[0].self_attn.q_proj.weight,
                       loaded_base[0].model.layers[0].self_attn.q_proj.weight)


# ------------------------------------------------------------------------------------------------ attention
def test_our_passes_run_the_position_ordered_kernel(load, monkeypatch):
    from eagle.kernels import attention as kernel_attention
    from eagle.model.base import native_decoder

    model = load("float32")
    target = model.engine.target
    plan = target.forward_plan
    assert plan.kernel_attention and plan.attend is kernel_attention.attention_forward
    config = model.base_model.config.get_text_config()
    # the model's own generate: ours without our pass, i.e. transformers' SDPA
    assert config._attn_implementation == attention.OUR_ATTENTION["sdpa"]
    native = []  # the engine's passes skip transformers' forward: every layer in one eagle::decoder_layers call,
    real_native = native_decoder.NativeDecoder._native_layers  # whose attention is the kernel's C++ function
    monkeypatch.setattr(native_decoder.NativeDecoder, "_native_layers",
                        lambda self, *a: native.append(real_native(self, *a)) or native[-1])
    assert plan.native is not None
    model.eagenerate(chat_template_ids(model, PROMPTS[0]), max_new_tokens=4)
    assert len(native) >= 2 and all(result is not None for result in native)  # prefill and a verification
    calls = []
    kernel = kernel_attention.tree_attention
    monkeypatch.setattr(kernel_attention, "tree_attention", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    arguments = plan.native.arguments
    monkeypatch.setattr(plan.native, "arguments", None)  # the layers through their modules
    model.eagenerate(chat_template_ids(model, PROMPTS[0]), max_new_tokens=4)
    monkeypatch.setattr(plan.native, "arguments", arguments)
    assert len(calls) >= 30 * 2  # prefill and at least one verification, every layer
    calls.clear()
    target.forward_plan = dataclasses.replace(plan, native=None)  # transformers' forward reaches the kernel
    try:
        model.eagenerate(chat_template_ids(model, PROMPTS[0]), max_new_tokens=4)
    finally:
        target.forward_plan = plan
    assert len(calls) >= 30 * 2


def test_the_native_decoder_gives_the_bits_of_transformers_forward_on_the_embedded_model(load, monkeypatch):
    """Through the modules: transformers' bits; the native layers: those of transformers' forward with the
    layers' norms in the native summation order (lane_rms_norm), and its values to float32 rounding."""
    from eagle.kernels.reference import lane_rms_norm

    for numerics in ("float32", "int8"):
        model = load(numerics)
        base, target = model.base_model, model.engine.target
        plan = target.forward_plan
        assert plan.native is not None and plan.native.arguments is not None
        ids = chat_template_ids(model, PROMPTS[2])
        outputs = {}
        for mode in ("native", "modules", "transformers", "transformers, lane norms"):
            with monkeypatch.context() as patch:
                if mode == "modules":
                    patch.setattr(plan.native, "arguments", None)
                if mode.startswith("transformers"):
                    patch.setattr(target, "forward_plan", dataclasses.replace(plan, native=None))
                if mode.endswith("lane norms"):
                    for layer in base.model.layers:
                        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                            patch.setattr(norm, "forward", lambda x, norm=norm: lane_rms_norm(
                                x, norm.weight, norm.variance_epsilon))
                cache = target.new_cache(ids.shape[1] + 8)
                first = target.prefill(ids, cache, logits_to_keep=0)
                tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
                second = target.verify(torch.tensor([[42, 7, 99]]), cache, ids.shape[1] + torch.tensor([0, 1, 1]),
                                       tree)
                outputs[mode] = [first.logits, first.features, second.logits, second.features]
        for mine, reference in zip(outputs["modules"], outputs["transformers"]):
            assert torch.equal(mine, reference), numerics
        for mine, lane, reference in zip(outputs["native"], outputs["transformers, lane norms"],
                                         outputs["transformers"]):
            assert torch.equal(mine, lane), numerics
            if numerics == "float32":  # (int8: a norm's last bit can move an activation to the next int8 step)
                torch.testing.assert_close(mine, reference, rtol=1e-4, atol=1e-3)


# ------------------------------------------------------------------------------------------------ exactness
@pytest.mark.parametrize("numerics", ["float32", "int8", "default"])
def test_eagle_logits_equal_plain_decoding_bit_for_bit(load, monkeypatch, numerics):
    model = load(numerics)
    prompts = [chat_template_ids(model, p) for p in PROMPTS]
    for prompt in prompts[:2]:  # batch 1
        eagle_tokens, eagle_logits = _generate_recording(monkeypatch, model.eagenerate, [prompt])
        plain_tokens, plain_logits = _generate_recording(monkeypatch, model.naivegenerate, [prompt])
        assert eagle_tokens == plain_tokens
        _assert_bit_equal(eagle_logits[0], plain_logits[0], len(plain_tokens[0]), f"{numerics}, batch 1")
    # a left-padded batch of three against each prompt decoded alone
    eagle_tokens, eagle_logits = _generate_recording(monkeypatch, model.eagenerate, prompts)
    for b, prompt in enumerate(prompts):
        plain_tokens, plain_logits = _generate_recording(monkeypatch, model.naivegenerate, [prompt])
        emitted = len(plain_tokens[0])
        assert eagle_tokens[b][:emitted] == plain_tokens[0], b
        _assert_bit_equal(eagle_logits[b], plain_logits[0], emitted, f"{numerics}, batch row {b}")


def test_an_eagle1_head_drafts_on_the_kernels_with_the_targets_quantized_lm_head(load, loaded_base, monkeypatch,
                                                                                  tmp_path):
    """An EAGLE-1 head (a random one for SmolLM2: it drafts with the target's LM head, here the kernels' layer over
    the file's Q8_0 blocks) on a target on the kernels: greedy EAGLE's logits equal plain decoding's bit for bit."""
    from tiny_models import make_head

    load("float32")  # the fixture's loader (a copy of the float32 model) is in place while it lives
    make_head(tmp_path / "eagle1", loaded_base[0], eagle3=False)
    model = EaModel.from_pretrained(base_model_path=defaults.default_base_model_path(),
                                    ea_model_path=str(tmp_path / "eagle1"), use_eagle3=False, gguf_kernels="float32",
                                    total_token=6, depth=2, top_k=3)
    lm_head = model.base_model.get_output_embeddings()
    assert model.ea_layer.eagle_version == 1 and isinstance(lm_head, QuantLinear) and lm_head.uses_kernels
    assert model.ea_layer._target_lm_head == [lm_head]  # not the float32 copy, which is freed
    assert not any(isinstance(m, QuantLinear) for m in model.ea_layer.modules())  # the head itself stays float32
    prompt = chat_template_ids(model, PROMPTS[0])
    eagle_tokens, eagle_logits = _generate_recording(monkeypatch, model.eagenerate, [prompt])
    plain_tokens, plain_logits = _generate_recording(monkeypatch, model.naivegenerate, [prompt])
    assert eagle_tokens == plain_tokens
    _assert_bit_equal(eagle_logits[0], plain_logits[0], len(plain_tokens[0]), "EAGLE-1 on the kernels")


def test_float32_kernels_decode_as_hugging_face_generate_on_the_float32_model(load, loaded_base):
    model = load("float32")
    reference = loaded_base[0]
    for prompt in PROMPTS[:2]:
        ids = chat_template_ids(model, prompt)
        expected = reference.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                      do_sample=False, eos_token_id=sorted(model.stop_token_ids()), pad_token_id=0)
        assert model.naivegenerate(ids, max_new_tokens=NEW_TOKENS).tolist() == expected.tolist(), prompt


def test_the_benchmark_counts_the_weights_each_model_holds(load):
    from eagle.evaluation.benchmark_memory import weight_bytes

    kernels_model, float_model = load("float32"), load(False)
    assert weight_bytes(kernels_model.base_model) < 100 * 2**20  # the file's blocks (98 MB file)
    assert weight_bytes(float_model.base_model) > 500 * 2**20  # transformers' float32 copy (540 MB)
