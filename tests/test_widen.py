"""The function-preserving widening of a Llama model and its EAGLE-3 head (eagle.evaluation.scale): the widened
model gives the source's logits and greedy tokens, the widened pair drafts and accepts exactly as the source pair,
and a shape that cannot hold the source is refused with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle.evaluation.scale.build import build_pair
from eagle.evaluation.scale.widen import SHAPES, Shape, check_widening, query_head_positions
from tiny_models import make_head, make_target

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2 = Shape("smollm2", 576, 9, 3, 1536, 30)
# From the tiny Llama of tests/tiny_models.py (hidden 64, 4 query / 2 KV heads of 16, intermediate 128, 6 layers):
# 3 KV heads with a group of 4 instead of 2, 2 extra layers.
WIDER = Shape("wider", 192, 12, 3, 200, 8, head_dim=16)


def eagle_steps(model, ids, max_new_tokens):
    """The ids EAGLE emits and the tokens it emits at each draft/verify step (accepted drafts + 1)."""
    lengths, out = [ids.shape[1]], None
    for out in model.ea_generate(ids, max_new_tokens=max_new_tokens):
        lengths.append(out.shape[1])
    return out[0].tolist(), [b - a for a, b in zip(lengths, lengths[1:])]


def load_pair(base, head):
    from eagle.model.ea_model import EaModel

    return EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), use_eagle3=True,
                                   dtype=torch.float32, draft_dtype=torch.float32, gguf_kernels=False)


def assert_same_function(source, wide):
    """``wide`` gives ``source``'s logits (to float32 rounding) and greedy tokens on random prompts."""
    generator = torch.Generator().manual_seed(0)
    for length in (1, 7, 23):
        ids = torch.randint(6, 128, (1, length), generator=generator)
        with torch.no_grad():
            expected, got = source(ids).logits, wide(ids).logits
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
            greedy = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert wide.generate(ids, **greedy).tolist() == source.generate(ids, **greedy).tolist()


@pytest.mark.parametrize("tied", [False, True])
def test_widened_tiny_llama_gives_the_same_logits_and_greedy_tokens(tmp_path, tied):
    source = make_target(tmp_path / "base", "llama", layers=6, tie_word_embeddings=tied)
    make_head(tmp_path / "head", source)
    model_dir, _ = build_pair(WIDER, tmp_path / "wide", str(tmp_path / "base"), str(tmp_path / "head"),
                              dtype=torch.float32, shard_bytes=2**20)
    assert len(list(model_dir.glob("model-*-of-*.safetensors"))) > 1  # sharded as asked
    wide = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert wide.config.hidden_size == 192 and wide.config.num_hidden_layers == 8
    assert wide.config.tie_word_embeddings == tied
    layer, extra = wide.model.layers[0], wide.model.layers[7]  # a source layer and an appended one
    assert (wide.model.embed_tokens.weight[:, 64:] == 0).all() and (layer.self_attn.o_proj.weight[64:] == 0).all()
    assert (layer.mlp.down_proj.weight[:, 128:] == 0).all() and (extra.mlp.down_proj.weight == 0).all()
    assert (layer.self_attn.q_proj.weight[:, 64:] != 0).all() and (layer.mlp.up_proj.weight[128:] != 0).all()
    assert_same_function(source, wide)


def test_widened_tiny_pair_drafts_and_accepts_as_the_source_pair(tmp_path):
    make_target(tmp_path / "base", "llama", layers=6)
    make_head(tmp_path / "head", AutoModelForCausalLM.from_pretrained(tmp_path / "base"), draft_vocab_size=64)
    model_dir, head_dir = build_pair(WIDER, tmp_path / "wide", str(tmp_path / "base"), str(tmp_path / "head"),
                                     dtype=torch.float32)
    ids = torch.tensor([[1, 40, 41, 42, 43, 44, 45, 46]])
    expected = eagle_steps(load_pair(tmp_path / "base", tmp_path / "head"), ids, 24)
    assert eagle_steps(load_pair(model_dir, head_dir), ids, 24) == expected


@pytest.mark.e2e  # the embedded SmolLM2 pair
def test_build_command_widens_the_embedded_pair_losslessly(tmp_path):
    """`build --shape tiny` in float32: the widened SmolLM2 pair emits the source pair's tokens with the same
    accepted lengths at every step; a second run keeps the built pair."""
    from eagle.defaults import default_base_model_path, default_ea_model_path

    out = tmp_path / "tiny"
    command = [sys.executable, "-m", "eagle.evaluation.scale", "build", "--shape", "tiny", "--out", str(out),
               "--dtype", "float32"]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, timeout=900)
    head_config = json.loads((out / "head" / "config.json").read_text())
    assert head_config["hidden_size"] == head_config["target_hidden_size"] == SHAPES["tiny"].hidden_size
    assert "quantization_config" not in json.loads((out / "model" / "config.json").read_text())
    again = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=300)
    assert "already built" in again.stderr
    source = load_pair(default_base_model_path(), default_ea_model_path())
    ids = source.tokenizer.apply_chat_template([{"role": "user", "content": "Write a short poem about autumn."}],
                                               add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)["input_ids"]
    expected = eagle_steps(source, ids, 16)
    del source
    tokens, steps = eagle_steps(load_pair(out / "model", out / "head"), ids, 16)
    assert (tokens, steps) == expected and max(steps) > 1  # the same tokens, and the head really accepts


def test_query_heads_keep_their_kv_head():
    positions = query_head_positions(SMOLLM2, SHAPES["8b"])  # group 3 -> 4
    assert positions == [0, 1, 2, 4, 5, 6, 8, 9, 10]
    assert [p // SHAPES["8b"].group for p in positions] == [i // 3 for i in range(9)]


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=4), "hidden_size 512, fewer"),
    (dict(head_dim=128), "head_dim 128"),
    (dict(num_key_value_heads=2, num_attention_heads=32), "num_key_value_heads 2, fewer"),
    (dict(num_key_value_heads=16, num_attention_heads=32), "groups 2 query heads per KV head"),
    (dict(num_attention_heads=36, num_key_value_heads=8), "not a multiple of its 8 KV heads"),
    (dict(num_hidden_layers=24), "num_hidden_layers 24, fewer"),
    (dict(intermediate_size=1024), "intermediate_size 1024, fewer"),
    (dict(num_attention_heads=24, num_key_value_heads=8), "not a multiple of its 24 query heads"),
])
def test_a_shape_that_cannot_hold_the_source_is_refused(change, message):
    import dataclasses

    shape = dataclasses.replace(SHAPES["2b"], name="bad", **change)
    with pytest.raises(ValueError, match=message):
        check_widening(SMOLLM2, shape)
    for preset in SHAPES.values():
        check_widening(SMOLLM2, preset)


def test_a_head_that_does_not_match_its_config_is_refused(tmp_path):
    from eagle.evaluation.scale.widen import Widener, widened_head_tensors

    source = make_target(tmp_path / "base", "llama", layers=6)
    state = make_head(tmp_path / "head", source, draft_vocab_size=64)
    widener = Widener(Shape.of_config(source.config), WIDER, origin="HEAD_DIR")
    with pytest.raises(ValueError, match=r"Tensor fc.weight of HEAD_DIR has shape \(192, 64\), but its config "
                                         r"implies \(64, 192\)"):
        dict(widened_head_tensors({**state, "fc.weight": state["fc.weight"].T}, widener))
    bias = {**state, "midlayer.self_attn.q_proj.bias": torch.zeros(64)}
    with pytest.raises(ValueError, match=r"HEAD_DIR has tensors a widening does not handle "
                                         r"\(midlayer.self_attn.q_proj.bias\)"):
        dict(widened_head_tensors(bias, widener))


# The tiny Llama widened as Qwen2-MoE: 6 routed experts of 48 units (top-2) and a shared expert of 200 units.
WIDER_MOE = Shape("wider-moe", 192, 12, 3, 200, 8, head_dim=16, experts=6, experts_per_token=2, expert_size=48)


@pytest.mark.parametrize("family, shape", [("qwen2", WIDER), ("qwen2_moe", WIDER_MOE)])
def test_widened_family_gives_the_same_logits_and_greedy_tokens(tmp_path, family, shape):
    """Tied source embeddings: Qwen2 keeps them tied, Qwen2-MoE (llama.cpp's needs an output matrix) unties them."""
    source = make_target(tmp_path / "base", "llama", layers=6, tie_word_embeddings=True)
    make_head(tmp_path / "head", source)
    model_dir, _ = build_pair(shape, tmp_path / "wide", str(tmp_path / "base"), str(tmp_path / "head"),
                              dtype=torch.float32, family=family)
    wide = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert wide.config.model_type == family and wide.config.num_hidden_layers == 8
    assert wide.config.tie_word_embeddings == (family == "qwen2")
    attention = wide.model.layers[0].self_attn
    real_q = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in query_head_positions(Shape.of_config(
        source.config), shape)])
    assert (attention.q_proj.bias[real_q] == 0).all() and (attention.k_proj.bias[:32] == 0).all()
    assert (attention.v_proj.bias[:32] == 0).all() and (attention.q_proj.bias != 0).sum() == 192 - 64
    assert_same_function(source, wide)


def test_widened_moe_routes_tokens_to_different_experts(tmp_path):
    """The routed experts are real work: every layer's router sends a prompt's tokens to more experts than one token
    chooses, and the experts' matrices are read although they add nothing."""
    source = make_target(tmp_path / "base", "llama", layers=6)
    make_head(tmp_path / "head", source)
    model_dir, _ = build_pair(WIDER_MOE, tmp_path / "wide", str(tmp_path / "base"), str(tmp_path / "head"),
                              dtype=torch.float32, family="qwen2_moe")
    wide = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert wide.config.norm_topk_prob is False and wide.config.num_experts == 6
    chosen = [set() for _ in wide.model.layers]
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _i, out, seen=seen: seen.update(out[2].flatten().tolist()))
             for layer, seen in zip(wide.model.layers, chosen)]
    with torch.no_grad():
        wide(torch.randint(6, 128, (1, 16), generator=torch.Generator().manual_seed(1)))
    for hook in hooks:
        hook.remove()
    assert all(len(seen) > WIDER_MOE.experts_per_token for seen in chosen), chosen
    mlp = wide.model.layers[0].mlp
    assert (mlp.experts.gate_up_proj != 0).all() and (mlp.experts.down_proj == 0).all()
    assert (mlp.shared_expert_gate.weight == 0).all()


@pytest.mark.parametrize("family, shape, message", [
    ("qwen2_moe", WIDER, "needs a mixture-of-experts shape"),
    ("llama", WIDER_MOE, "needs a dense shape"),
    ("qwen3", WIDER, "Unknown family 'qwen3'"),
])
def test_a_family_that_does_not_fit_the_shape_is_refused(tmp_path, family, shape, message):
    with pytest.raises(ValueError, match=message):
        build_pair(shape, tmp_path / "wide", str(tmp_path / "base"), str(tmp_path / "head"), family=family)
