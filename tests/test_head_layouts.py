"""Every published EAGLE-3 head layout loads and computes what its publisher's engine computes (the reference in
tests/head_layouts.py restates vLLM's llama_eagle3.py), or is refused with a message naming the layout and what it
lacks. Each case names the source of its layout."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from eagle.model import EaModel
from eagle.model.heads.loading import load_ea_layer
from head_layouts import Semantics, publish, publisher_forward
from tiny_models import make_target

# case -> (layout, publish() options, what the publisher's engine computes)
CASES = {
    # SafeAILab EAGLE's trainer: midlayer.*, d2t and t2d, a reduced draft vocabulary
    "EAGLE reference": ("EAGLE", {}, Semantics()),
    # SpecForge writes LlamaForCausalLMEagle3 + eagle_config; SGLang's llama_eagle3.py gives fc the bias
    # `config.bias` asks for
    "SpecForge with an fc bias": ("SpecForge", dict(fc_bias=True), Semantics()),
    # ModelOpt's hf_spec_export.py: layers.0.* (newer exports), no t2d (vLLM and SGLang skip it)
    "ModelOpt": ("ModelOpt", {}, Semantics()),
    # ModelOpt's older export of several layers: midlayer.0.*, midlayer.1.* (vLLM: layers.1 a LLaMA layer)
    "ModelOpt, two layers as midlayer.<i>": ("ModelOpt", dict(old_modelopt_names=True), Semantics(layers=2)),
    # NVIDIA's GPT-OSS heads: draft_vocab_size null and no lm_head of their own; SGLang's llama_eagle3.py then
    # loads the target's LM head (load_lm_head_from_target)
    "ModelOpt, null draft vocabulary, the target's LM head": (
        "ModelOpt, null draft vocabulary", dict(draft_vocab=None), Semantics(lm_head_from_target=True)),
    # ... and with the LM head hf_spec_export.py copies from the base model when the draft has none
    "ModelOpt, null draft vocabulary, its own LM head": (
        "ModelOpt, null draft vocabulary", dict(draft_vocab=None), Semantics()),
    # ModelOpt's use_aux_hidden_state: false: no fc, no hidden_norm; vLLM's llama_eagle3.py then builds no fc and
    # feeds the target's hidden state, its hidden_norm at the RMSNorm's unit initial weight
    "ModelOpt without aux hidden states": ("ModelOpt", {}, Semantics(aux=False)),
    # speculators (vLLM's trainer): transformer_layer_config nested, layers.0.*, norm_before_residual, fc bias
    # (speculators' Eagle3Speculator builds fc with bias=True)
    "speculators, norm_before_residual, fc bias": ("speculators", dict(fc_bias=True),
                                                   Semantics(norm_before_residual=True)),
    # speculators' Eagle3DraftModel: layers 1.. are LlamaDecoderLayers (vLLM: layers.<i> with H-wide q/k/v)
    "speculators, two layers": ("speculators", {}, Semantics(layers=2)),
    # speculators' norm_before_fc (gpt-oss drafts): an RMSNorm input_norm over the fused features before fc
    "speculators, norm_before_fc": ("speculators", {}, Semantics(norm_before_fc=True)),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    return root, make_target(root / "base", "llama", seed=5, layers=6)


def published_layer_config(directory) -> dict:
    config = json.loads((directory / "config.json").read_text())
    return config.get("transformer_layer_config", config)


def compare(directory, model, state, semantics):
    """Our loaded head vs the publisher's computation on random features: pre-norm states and logits."""
    head = load_ea_layer(str(directory), model, use_eagle3=True, draft_dtype=torch.float32)
    torch.manual_seed(0)
    text = model.config.get_text_config()
    features = torch.randn(1, 7, (3 if semantics.aux else 1) * text.hidden_size)
    tokens = torch.randint(6, text.vocab_size, (1, 7))
    with torch.no_grad():
        ours = head(features, tokens)
        logits = head.compute_logits(ours)
        expected, expected_logits = publisher_forward(state, published_layer_config(directory), semantics, features[0],
                                                      tokens[0], model.get_input_embeddings().weight,
                                                      model.get_output_embeddings())
    torch.testing.assert_close(ours[0], expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[0], expected_logits, rtol=1e-4, atol=1e-4)
    return head, ours


@pytest.mark.parametrize("case", list(CASES))
def test_layout_computes_what_its_publisher_computes(case, target, tmp_path):
    root, model = target
    layout, options, semantics = CASES[case]
    state = publish(tmp_path / "head", model, layout, semantics=semantics, **options)
    if case.endswith("its own LM head"):  # the exporter's copy of the base model's LM head
        state["lm_head.weight"] = model.get_output_embeddings().weight.detach().clone()
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "head" / "model.safetensors"))
    head, _ = compare(tmp_path / "head", model, state, semantics)
    if "d2t" in state:  # the draft vocabulary maps as published; t2d rebuilt where the layout has none
        ids = torch.arange(head.draft_vocab_size)
        assert torch.equal(head.draft_to_target(ids), ids + state["d2t"])
        assert head.t2d.nonzero().flatten().tolist() == (ids + state["d2t"]).tolist()
    prompt = torch.tensor([[1, 50, 51, 52, 53]])
    loaded = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(tmp_path / "head"),
                                     total_token=8, depth=3, top_k=3)
    assert loaded.eagenerate(prompt, max_new_tokens=12).tolist() == \
        model.generate(prompt, max_new_tokens=12, do_sample=False).tolist()


def test_norm_before_residual_is_computed_not_ignored(target, tmp_path):
    """The reference tells the two apart on these weights: a head ignoring the flag fails the comparison."""
    _, model = target
    semantics = Semantics(norm_before_residual=True)
    state = publish(tmp_path / "head", model, "speculators", semantics=semantics)
    _, ours = compare(tmp_path / "head", model, state, semantics)
    torch.manual_seed(0)
    features, tokens = torch.randn(7, 3 * 64), torch.randint(6, 128, (7,))
    ignored, _ = publisher_forward(state, published_layer_config(tmp_path / "head"), Semantics(), features, tokens,
                                   model.get_input_embeddings().weight)
    assert (ignored - ours[0]).abs().max() > 1e-2


def test_speculators_config_reads_the_nested_vocabulary(target, tmp_path):
    """The vocabulary is the nested transformer_layer_config's (the target's), not a top-level default."""
    _, model = target
    publish(tmp_path / "head", model, "speculators")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert "vocab_size" not in config and config["transformer_layer_config"]["vocab_size"] == 128
    head = load_ea_layer(str(tmp_path / "head"), model, use_eagle3=True)
    assert head.vocab_size == 128 and head.draft_vocab_size == 48 and head.config.norm_before_residual is False


def test_speculators_norm_before_residual_defaults_as_vllm_reads_it(target, tmp_path):
    """vLLM's speculators config reader defaults norm_before_residual to true when the field is absent."""
    _, model = target
    state = publish(tmp_path / "head", model, "speculators", semantics=Semantics(norm_before_residual=True))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    del config["norm_before_residual"]
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    compare(tmp_path / "head", model, state, Semantics(norm_before_residual=True))


REFUSED = {
    # speculators' fc_norm (per-layer norms of the aux states) and norm_output: not implemented here
    "speculators fc_norm": ("speculators", lambda c: c.update(fc_norm=True), "speculators head sets fc_norm"),
    "speculators norm_output": ("speculators", lambda c: c.update(norm_output=True), "sets norm_output"),
    # speculators' Qwen3 draft layers have q/k norms
    "speculators qwen3 layer": ("speculators", lambda c: c["transformer_layer_config"].update(model_type="qwen3"),
                                "draft layer is a 'qwen3' layer"),
    "speculators without a layer config": ("speculators", lambda c: c.pop("transformer_layer_config"),
                                           "no transformer_layer_config"),
    # ModelOpt's eagle_config flags the heads here do not compute
    "ModelOpt without a last norm": ("ModelOpt", lambda c: c["eagle_config"].update(use_last_layernorm=False),
                                     "NVIDIA ModelOpt head sets eagle_config.use_last_layernorm=False"),
    "ModelOpt MTP norm": ("ModelOpt", lambda c: c["eagle_config"].update(use_mtp_layernorm=True),
                          "use_mtp_layernorm=True"),
    "ModelOpt parallel draft": ("ModelOpt", lambda c: c["eagle_config"].update(parallel_draft_step=3),
                                "parallel draft heads"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_layout_fields_are_refused_by_name(case, target, tmp_path):
    _, model = target
    layout, edit, message = REFUSED[case]
    publish(tmp_path / "head", model, layout)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    edit(config)
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        load_ea_layer(str(tmp_path / "head"), model, use_eagle3=True)


def test_a_missing_tensor_names_the_layout(target, tmp_path):
    _, model = target
    state = publish(tmp_path / "head", model, "ModelOpt", semantics=Semantics(layers=2))
    del state["layers.1.mlp.up_proj.weight"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ValueError, match=r"NVIDIA ModelOpt layout.*missing tensors: layers\.1\.mlp\.up_proj\.weight"):
        load_ea_layer(str(tmp_path / "head"), model, use_eagle3=True)


def test_a_head_without_aux_states_reads_the_final_hidden_state(target, tmp_path):
    root, model = target
    publish(tmp_path / "head", model, "ModelOpt", semantics=Semantics(aux=False))
    loaded = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(tmp_path / "head"))
    assert loaded.engine.target.feature_layers == [-1] and loaded.ea_layer.feature_size == 64
    assert loaded.ea_layer.fc is None
