"""The families of the published checkpoints (README "Published checkpoints"): tree verification gives every node
the logits the model gives its path alone, across each family's boundaries (Llama 4's chunks and query
temperature, GPT-OSS's sliding windows and sinks, MLA, MoE, muP remote code); each loads with defaults; what the
engine cannot serve losslessly is refused with a message."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from eagle.model.engine.commit import Rows
from eagle.model.base import kv_cache
from eagle.model.backends.attention import QueryTemperature, base_attention
from eagle.model.base.families import attention_problems
from eagle.model.base.model_call import ModelCall, keep_logits
from eagle.model.base.target import Target
from tiny_models import CHECKPOINT_FAMILIES, make_head, make_remote_target, make_target

FAMILY_NAMES = sorted(CHECKPOINT_FAMILIES) + ["qwen3", "minicpm"]
# Row 0's prompt crosses Llama 4's 8-token chunks and its temperature steps (every 4 positions) and GPT-OSS's
# 8-token windows several times; row 1 is shorter and left-padded.
PROMPTS = [[1] + list(range(40, 58)), [1, 70, 71, 72, 73, 74]]
# A tree after each row: root 0, its children 1 and 2, and 3 below 1 (siblings share a position, not a slot).
PARENTS = [-1, 0, 0, 1]
NODES = [[60, 61, 62, 63], [80, 81, 82, 83]]


def build(directory, family):
    if family == "minicpm":
        return make_remote_target(directory, seed=3)
    return make_target(directory, family, seed=3, layers=4)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    """family -> (directory, model), built once per module."""
    root, built = tmp_path_factory.mktemp("families"), {}

    def get(family):
        if family not in built:
            built[family] = (root / family, build(root / family, family))
        return built[family]

    return get


def paths_of(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root (node ids)."""
    paths = []
    for node, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [node])
    return paths


def tree_logits(target: Target, prompts, nodes, parents):
    """Prefill the left-padded prompts, then verify one tree per row as the engine does: (B, N, V) logits."""
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts)])
    slots = torch.arange(width)
    valid = slots[None] >= torch.tensor(pads)[:, None]
    cache = target.new_cache(width + len(parents))
    target.prefill(ids, cache, valid=valid, features=False, logits_to_keep=0)
    rows = Rows(list(range(len(prompts))), pads, [width] * len(prompts))
    committed, key_positions = rows.masks(width, target.device)
    depths = torch.tensor([len(path) - 1 for path in paths_of(parents)])
    ancestors = torch.zeros(len(parents), len(parents), dtype=torch.bool)
    for node, path in enumerate(paths_of(parents)):
        ancestors[node, path] = True
    positions = depths[None] + torch.tensor([len(p) for p in prompts])[:, None]
    out = target.verify(torch.tensor(nodes), cache, positions, ancestors,
                        valid=torch.cat([committed, torch.ones(len(prompts), len(parents), dtype=torch.bool)], 1),
                        key_positions=key_positions, features=False)
    return out.logits


def alone_logits(model, tokens: list[int]) -> torch.Tensor:
    """The model's own last-position logits for ``tokens``, no cache, no mask (as its forward builds them)."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1].float()


def worst_path_error(target, model) -> float:
    logits = tree_logits(target, PROMPTS, NODES, PARENTS)
    worst = 0.0
    for row, (prompt, nodes) in enumerate(zip(PROMPTS, NODES)):
        for node, path in enumerate(paths_of(PARENTS)):
            expected = alone_logits(model, prompt + [nodes[i] for i in path])
            worst = max(worst, float((logits[row, node] - expected).abs().max()) / float(expected.abs().max()))
    return worst


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_tree_verification_gives_each_path_its_own_logits(family, targets):
    _, model = targets(family)
    assert worst_path_error(Target(model, feature_layers=None), model) < 1e-4


def test_llama4_under_eager_attention_takes_the_temperature_of_the_position(targets):
    """Asked for eager attention, Llama 4's NoPE layers go through our eager entry point, with the same result."""
    from eagle.model.base.loading import load_base_model

    directory, _ = targets("llama4_text")
    model, _ = load_base_model(str(directory), attn_implementation="eager")
    assert model.config._attn_implementation == "eager" and QueryTemperature(model)
    assert worst_path_error(Target(model, feature_layers=None), model) < 1e-4


@pytest.mark.parametrize("family,undo", [
    ("llama4_text", "chunks"), ("llama4_text", "temperature"), ("gpt_oss", "windows")])
def test_the_tiny_families_do_cross_their_boundaries(family, undo, targets):
    """The same check fails when the engine forgets a boundary: the tiny configs exercise each fix."""
    _, model = targets(family)
    target = Target(model, feature_layers=None)
    if undo == "temperature":
        target.forward_plan = dataclasses.replace(target.forward_plan, temperature=())
    else:
        target.layer_types = ["full_attention"] * target.num_layers
    assert worst_path_error(target, model) > 1e-3


def test_llama4_nope_layers_are_found_and_use_the_position(targets):
    config = CHECKPOINT_FAMILIES["llama4_text"][1]
    _, tiny = targets("llama4_text")
    found = QueryTemperature(tiny).modules
    assert [m.layer_idx for m in found] == [i for i, rope in enumerate(tiny.config.no_rope_layers) if not rope]
    scales = QueryTemperature.scales(found[0], torch.tensor([[0, 3, 4, 7, 8]]))
    expected = 1 + config["attn_scale"] * torch.log1p(torch.tensor([0.0, 1, 1, 2, 2]))
    torch.testing.assert_close(scales.flatten(), expected)


def test_gpt_oss_loads_with_defaults_and_eager_attention(targets, tmp_path):
    from eagle.model import EaModel

    base, model = targets("gpt_oss")
    assert base_attention(model.config._attn_implementation) == "eager"  # (ours stands for eager once targeted)
    make_head(tmp_path / "head", model, eagle3=True, seed=4)
    loaded = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(tmp_path / "head"))
    assert base_attention(loaded.base_model.config._attn_implementation) == "eager"
    prompt = torch.tensor([PROMPTS[0]])
    assert loaded.eagenerate(prompt, max_new_tokens=10).tolist() == \
        model.generate(prompt, max_new_tokens=10, do_sample=False).tolist()


def test_default_attention_is_sdpa_where_transformers_supports_it_else_eager(targets, tmp_path):
    """Without attn_implementation, transformers' own choice: SDPA for Llama, eager for GPT-OSS (its
    _supports_sdpa is False: the sinks) and for nothing else; an explicit 'eager' is kept; a kernel that ignores
    4-D masks is refused before loading."""
    from transformers import GptOssForCausalLM

    from eagle.model.base.loading import load_base_model

    assert GptOssForCausalLM._supports_sdpa is False
    gpt_oss, _ = targets("gpt_oss")
    llama = tmp_path / "llama"
    make_target(llama, "llama", seed=3, layers=2)
    assert load_base_model(str(gpt_oss))[0].config._attn_implementation == "eager"
    assert load_base_model(str(llama))[0].config._attn_implementation == "sdpa"
    assert load_base_model(str(llama), attn_implementation="eager")[0].config._attn_implementation == "eager"
    with pytest.raises(ValueError, match="flash_attention_2.*cannot apply EAGLE's tree attention mask"):
        load_base_model(str(llama), attn_implementation="flash_attention_2")


def test_llama4_conditional_generation_checkpoint_loads_text_only(tmp_path):
    """The published Llama 4 checkpoints are Llama4ForConditionalGeneration: they load as their text model."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from eagle.model import EaModel
    from tiny_models import make_tokenizer, target_config

    text = target_config("llama4_text", layers=4).to_dict()
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=16, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
    torch.manual_seed(3)
    full = Llama4ForConditionalGeneration(Llama4Config(text_config=text, vision_config=vision)).eval()
    full.save_pretrained(tmp_path / "base")
    make_tokenizer(tmp_path / "base")
    make_head(tmp_path / "head", full.language_model, eagle3=True, seed=4)
    loaded = EaModel.from_pretrained(base_model_path=str(tmp_path / "base"), ea_model_path=str(tmp_path / "head"))
    assert type(loaded.base_model).__name__ == "Llama4ForCausalLM"
    prompt = torch.tensor([PROMPTS[0]])
    expected = full.language_model.generate(prompt, max_new_tokens=12, do_sample=False)
    assert loaded.eagenerate(prompt, max_new_tokens=12).tolist() == expected.tolist()


def test_mla_cache_is_sized_from_the_latent_it_stores(targets, monkeypatch):
    """GLM-4.7-Flash caches its compressed latent (kv_lora_rank + qk_rope_head_dim per layer), not heads x
    head_dim keys and values: the memory check counts what the cache really allocates."""
    _, model = targets("glm4_moe_lite")
    config = model.config
    target = Target(model, feature_layers=None)
    latent = (config.kv_lora_rank + config.qk_rope_head_dim) * config.num_hidden_layers * 4  # float32
    assert target.slot_bytes() == latent
    heads_times_dims = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assert heads_times_dims > 2 * latent  # what a config-based estimate would have counted
    cache = target.new_cache(10)
    target.prefill(torch.tensor([[1, 2, 3]]), cache, features=False, logits_to_keep=0)
    allocated = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    assert allocated == kv_cache.cache_bytes(target.slot_bytes(), 1, 10)
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: int(kv_cache.cache_bytes(latent, 4, 1000) / 0.7))
    kv_cache.check_cache_fits(target.slot_bytes(), 4, 1000, torch.device("cpu"))  # fits once sized right
    with pytest.raises(ValueError, match="A batch of 8 rows needs a KV cache"):
        kv_cache.check_cache_fits(target.slot_bytes(), 8, 1000, torch.device("cpu"))


def test_layer_types_and_features_the_mask_cannot_express_are_refused(targets):
    _, model = targets("qwen3")
    model.config.layer_types = ["full_attention", "linear_attention", "full_attention", "full_attention"]
    try:
        assert attention_problems(model.config) == ["layers of type 'linear_attention' (a recurrent state (Mamba, "
                                                    "gated delta net, lightning attention) that every drafted token "
                                                    "updates, accepted or not)"]
        with pytest.raises(ValueError, match="linear_attention.*allow_unknown_attention=True"):
            Target(model, feature_layers=None)
        model.config.layer_types = ["full_attention", "mystery_attention"] + ["full_attention"] * 2
        with pytest.raises(ValueError, match="'mystery_attention' \\(a layer type this engine does not know\\)"):
            Target(model, feature_layers=None)
        Target(model, feature_layers=None, allow_unknown_attention=True)  # asked for: a warning, no error
    finally:
        model.config.layer_types = ["full_attention"] * 4


def test_minicpm4_sparse_attention_is_refused(tmp_path):
    from eagle.model import EaModel

    model = make_remote_target(tmp_path / "base", seed=3, sparse_config={"kernel_size": 32, "dense_len": 8192})
    make_head(tmp_path / "head", model, eagle3=True, seed=4)
    with pytest.raises(ValueError, match="sparse_config=.*InfLLM v2"):
        EaModel.from_pretrained(base_model_path=str(tmp_path / "base"), ea_model_path=str(tmp_path / "head"),
                                trust_remote_code=True)


def test_remote_code_is_called_the_transformers_4_way(targets):
    _, model = targets("minicpm")
    call = ModelCall(model)
    assert call.legacy and call.cache_argument == "past_key_values" and call.keep_argument is None
    native = ModelCall(targets("qwen3")[1])
    assert not native.legacy and native.keep_argument == "logits_to_keep"
    logits = torch.arange(24.0).view(1, 4, 6)
    assert torch.equal(keep_logits(logits, 0), logits) and torch.equal(keep_logits(logits, 1), logits[:, -1:])
    assert torch.equal(keep_logits(logits, torch.tensor([2, 0])), logits[:, [2, 0]])


def _remote_variant(tmp_path, source, name, edit):
    """A copy of ``source`` (a remote-code model directory) whose modeling file has ``edit`` (old, new) applied,
    in a directory of its own name (transformers keys the classes of local remote code by directory name and file
    content, and maps a config class to the model class first loaded with it)."""
    target = tmp_path / name
    shutil.copytree(source, target)
    modeling = target / "modeling_minicpm.py"
    old, new = edit
    assert old in modeling.read_text()
    modeling.write_text(modeling.read_text().replace(old, new))
    return target


def test_remote_code_reading_4d_masks_another_way_is_refused(targets, tmp_path):
    """transformers 4.38+'s _prepare_4d_causal_attention_mask read a 4-D mask as 1 = attend, 0 = masked and
    inverted it; code doing so would attend exactly what the engine masks. The load-time check refuses it."""
    from eagle.model.base.loading import load_base_model

    source, _ = targets("minicpm")
    variant = _remote_variant(tmp_path, source, "inverted-mask", (
        "        if attention_mask is None or attention_mask.dim() == 2:",
        "        if attention_mask is not None and attention_mask.dim() == 4:\n"
        "            inverted = 1.0 - attention_mask\n"
        "            attention_mask = inverted.masked_fill(inverted.bool(), torch.finfo(hidden.dtype).min)\n"
        "        elif attention_mask is None or attention_mask.dim() == 2:"))
    model, _ = load_base_model(str(variant), trust_remote_code=True)
    with pytest.raises(ValueError, match="does not compute under the engine's 4-D tree mask"):
        Target(model, feature_layers=None)
    Target(model, feature_layers=None, allow_unknown_attention=True)


def test_remote_code_that_cannot_import_is_explained(targets, tmp_path):
    from eagle.model.base.loading import load_base_model

    source, _ = targets("minicpm")
    variant = _remote_variant(tmp_path, source, "old-import", (
        "from transformers import GenerationMixin, PreTrainedModel",
        "from transformers import GenerationMixin, PreTrainedModel\n"
        "from transformers.modeling_attn_mask_utils import _prepare_4d_causal_attention_mask"))
    config = json.loads((variant / "config.json").read_text())
    assert config["auto_map"]
    with pytest.raises(ImportError, match="could not be imported.*transformers 4"):
        load_base_model(str(variant), trust_remote_code=True)


def test_remote_code_is_never_run_unless_asked(targets):
    from eagle.model.base.loading import load_base_model

    source, _ = targets("minicpm")
    with pytest.raises(ValueError, match="trust_remote_code"):
        load_base_model(str(source))
