"""Checkpoints in the published layouts load; broken ones and bad requests fail with clear errors."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle.model import EaModel
from eagle.model.configs import EConfig
from eagle.model.backends.onednn import native_bfloat16
from eagle.model.heads.loading import resolve_draft_dtype
from tiny_models import make_head, make_target


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    model = make_target(root / "base", "llama", seed=31)
    return root, model


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
@pytest.mark.parametrize("eagle3,vocab", [(True, None), (True, 40), (False, None)])
def test_official_layouts_load_from_both_formats(base, fmt, eagle3, vocab):
    root, model = base
    head_dir = root / f"head-{fmt}-{eagle3}-{vocab}"
    state = make_head(head_dir, model, eagle3=eagle3, draft_vocab_size=vocab, fmt=fmt)
    expected_keys = {"fc.weight", "norm.weight", "lm_head.weight"} if eagle3 else {"fc.weight", "fc.bias"}
    assert expected_keys <= set(state)
    loaded = EaModel.from_pretrained(use_eagle3=eagle3, base_model_path=str(root / "base"), ea_model_path=str(head_dir),
                                     draft_dtype=torch.float32)  # the base's dtype: the weights exactly as saved
    for key, tensor in state.items():
        torch.testing.assert_close(loaded.ea_layer.state_dict()[key].to(tensor.dtype), tensor)
    # the embedding is the base model's, shared
    assert loaded.ea_layer.embed_tokens.weight.data_ptr() == model.get_input_embeddings().weight.data_ptr() or \
        torch.equal(loaded.ea_layer.embed_tokens.weight, loaded.base_model.get_input_embeddings().weight)
    assert loaded.eagenerate(torch.tensor([[1, 50, 51]]), max_new_tokens=5).shape == (1, 8)


def test_fp16_checkpoint_loads_into_float32_base(base):
    root, model = base
    head_dir = root / "head-fp16"
    state = make_head(head_dir, model, eagle3=True, draft_vocab_size=40)
    from safetensors.torch import save_file

    save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in state.items()},
              str(head_dir / "model.safetensors"))
    loaded = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(head_dir),
                                     draft_dtype="float32")
    assert loaded.ea_layer.fc.weight.dtype == torch.float32
    assert loaded.ea_layer.d2t.dtype == torch.long and loaded.ea_layer.t2d.dtype == torch.bool
    torch.testing.assert_close(loaded.ea_layer.d2t, state["d2t"])
    # by default: float32 too, or bfloat16 on a CPU that computes in it natively; only floating weights are cast
    auto = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(head_dir))
    expected = torch.bfloat16 if native_bfloat16() else torch.float32
    assert auto.ea_layer.fc.weight.dtype == auto.ea_layer.lm_head.weight.dtype == expected
    assert auto.ea_layer.d2t.dtype == torch.long and auto.ea_layer.t2d.dtype == torch.bool


def test_draft_dtype_follows_the_base_model_unless_bfloat16_is_native(monkeypatch):
    from eagle.model.heads import loading

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(loading, "native_bfloat16", lambda: True)
    assert resolve_draft_dtype("auto", torch.float32, cpu, 3) == torch.bfloat16
    assert resolve_draft_dtype(None, torch.float32, cpu, 1) == torch.float32  # EAGLE-1 shares the target LM head
    assert resolve_draft_dtype("auto", torch.float32, cuda, 3) == torch.float32
    assert resolve_draft_dtype("auto", torch.float16, cuda, 3) == torch.float16
    monkeypatch.setattr(loading, "native_bfloat16", lambda: False)
    assert resolve_draft_dtype("auto", torch.float32, cpu, 3) == torch.float32
    assert resolve_draft_dtype("bfloat16", torch.float32, cpu, 3) == torch.bfloat16
    assert resolve_draft_dtype(torch.float16, torch.float32, cpu, 3) == torch.float16
    for bad in ("half", torch.int8, 16):
        with pytest.raises(ValueError, match="draft_dtype must be"):
            resolve_draft_dtype(bad, torch.float32, cpu, 3)
    with pytest.raises(ValueError, match="EAGLE-1 head shares the base model's LM head"):
        resolve_draft_dtype(torch.bfloat16, torch.float32, cpu, 1)


def test_eagle_model_path_alias(base):
    root, model = base
    make_head(root / "alias", model, eagle3=True)
    loaded = EaModel.from_pretrained(base_model_path=str(root / "base"), eagle_model_path=str(root / "alias"))
    assert loaded.ea_layer.eagle_version == 3


@pytest.mark.parametrize("drop", ["lm_head.weight", "midlayer.self_attn.q_proj.weight", "d2t"])
def test_missing_tensor_is_named(base, drop):
    root, model = base
    head_dir = root / f"missing-{drop}"
    state = make_head(head_dir, model, eagle3=True, draft_vocab_size=40)
    del state[drop]
    make_head(head_dir, model, eagle3=True, state_dict=state)
    (head_dir / "config.json").write_text(json.dumps({**json.loads((head_dir / "config.json").read_text()),
                                                      "draft_vocab_size": 40}))
    with pytest.raises(ValueError, match=f"missing tensors: .*{drop}"):
        EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(head_dir))


def test_unexpected_tensor_is_named(base):
    root, model = base
    head_dir = root / "unexpected"
    state = make_head(head_dir, model, eagle3=True)
    state["layers.7.extra.weight"] = torch.zeros(2)
    make_head(head_dir, model, eagle3=True, state_dict=state)
    with pytest.raises(ValueError, match="unexpected tensors: layers.7.extra.weight"):
        EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(head_dir))


def test_missing_and_corrupt_weight_files(base):
    root, model = base
    head_dir = root / "corrupt"
    make_head(head_dir, model, eagle3=True)
    (head_dir / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(ValueError, match="Could not read the weights file .*model.safetensors"):
        EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(head_dir))
    (head_dir / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="No draft-head weights"):
        EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(head_dir))


def test_head_for_another_base_model_names_both_sizes(base, tmp_path):
    root, _ = base
    other = make_target(tmp_path / "other", "llama", seed=1, hidden_size=96, intermediate_size=128)
    make_head(tmp_path / "other-head", other, eagle3=True)
    with pytest.raises(ValueError, match="size 96 but the base model's hidden_size is 64"):
        EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(tmp_path / "other-head"))
    config = json.loads((tmp_path / "other-head" / "config.json").read_text())
    config.update(hidden_size=64, vocab_size=200)
    (tmp_path / "other-head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="vocab_size is 200 but the base model's vocabulary has 128"):
        EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(tmp_path / "other-head"))


def test_eagle1_head_with_use_eagle3_is_explained(base):
    root, model = base
    make_head(root / "e1", model, eagle3=False)
    with pytest.raises(ValueError, match="no `draft_vocab_size`.*use_eagle3=False"):
        EaModel.from_pretrained(use_eagle3=True, base_model_path=str(root / "base"), ea_model_path=str(root / "e1"))


def test_unsupported_models_are_refused(base, tmp_path):
    root, model = base
    make_head(root / "ok", model, eagle3=True)
    with pytest.raises(ValueError, match="attn_implementation='flash_attention_2' cannot apply"):
        EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(root / "ok"),
                                attn_implementation="flash_attention_2")
    from transformers import T5Config, T5ForConditionalGeneration

    from eagle.model.base.target import check_target_model

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=32, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8))
    with pytest.raises(ValueError, match="encoder-decoder"):
        check_target_model(t5)


@pytest.fixture(scope="module")
def ready(base):
    root, model = base
    make_head(root / "ready", model, eagle3=True)
    return EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(root / "ready"))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(input_ids=torch.tensor([[1, 2], [3, 4]]), attention_mask=torch.ones(2, 3)), ValueError,
         r"attention_mask has shape \(2, 3\) but input_ids has shape \(2, 2\)"),
        (dict(input_ids=torch.zeros(1, 0, dtype=torch.long)), ValueError, "prompt is empty"),
        (dict(input_ids=torch.tensor([[1.0, 2.0]])), TypeError, "integer token ids"),
        (dict(input_ids="hello"), TypeError, "torch.LongTensor"),
        (dict(input_ids=torch.ones(1, 50, dtype=torch.long), max_length=40), ValueError, "does not fit max_length=40"),
        (dict(input_ids=torch.tensor([[1, 2]]), temperature=-0.5), ValueError, "temperature must be >= 0"),
        (dict(input_ids=torch.tensor([[1, 2]]), temperature=1.0, top_p=1.5), ValueError, r"top_p must be in \[0, 1\]"),
        (dict(input_ids=torch.tensor([[1, 2]]), temperature=1.0, top_k=-1), ValueError, "top_k must be"),
        (dict(input_ids=torch.tensor([[1, 500]])), ValueError, "outside the vocabulary"),
    ],
)
@pytest.mark.parametrize("method", ["eagenerate", "naivegenerate", "ea_generate", "naive_generate"])
def test_bad_requests(ready, kwargs, error, message, method):
    with pytest.raises(error, match=message):
        result = getattr(ready, method)(**kwargs)
        if method.endswith("_generate"):
            next(iter(result))
    # and the model still works afterwards
    assert ready.eagenerate(torch.tensor([[1, 60, 61]]), max_new_tokens=3).shape == (1, 6)


def test_econfig_reads_official_fields(tmp_path):
    config = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
              "num_hidden_layers": 1, "vocab_size": 128256, "draft_vocab_size": 32000, "rope_theta": 500000.0,
              "bias": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048, "hidden_act": "silu",
              "rope_scaling": {"type": "linear", "factor": 2.0}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = EConfig.from_pretrained(tmp_path)
    assert loaded.draft_vocab_size == 32000 and loaded.bias is False
    assert loaded.rope_parameters["rope_theta"] == 500000.0
    assert loaded.to_dict()["rope_theta"] == 500000.0


def test_head_only_checkpoint_with_own_embedding(base):
    """A head whose config sets target_hidden_size must carry its own embedding, and it is used."""
    root, model = base
    head_dir = root / "own-emb"
    state = make_head(head_dir, model, eagle3=True)
    config = json.loads((head_dir / "config.json").read_text())
    config["target_hidden_size"] = 64
    (head_dir / "config.json").write_text(json.dumps(config))
    state["embed_tokens.weight"] = torch.randn(128, 64)
    make_head(head_dir, model, eagle3=True, state_dict=state)
    (head_dir / "config.json").write_text(json.dumps(config))
    loaded = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(head_dir),
                                     draft_dtype=torch.float32)
    torch.testing.assert_close(loaded.ea_layer.embed_tokens.weight, state["embed_tokens.weight"])
    reference = AutoModelForCausalLM.from_pretrained(root / "base").eval()
    ids = torch.tensor([[1, 30, 31]])
    assert loaded.eagenerate(ids, max_new_tokens=8).tolist() == reference.generate(ids, max_new_tokens=8,
                                                                                   do_sample=False).tolist()
