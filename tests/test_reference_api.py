"""The reference's step functions (eagle.model.utils) drive a full generation that equals eagenerate."""

from __future__ import annotations

import torch

from eagle.model import EaModel, choices
from eagle.model.kv_cache import initialize_past_key_values
from eagle.model.utils import (evaluate_posterior, initialize_tree, prepare_logits_processor, tree_decoding,
                               update_inference_inputs)
from tiny_models import make_tiny_pair


def test_reference_style_loop_equals_eagenerate(tmp_path):
    base, head = make_tiny_pair(tmp_path, "llama", eagle3=True)
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=12, depth=3,
                                    top_k=3)
    input_ids = torch.tensor([[1, 44, 45, 46, 47]])
    expected = model.eagenerate(input_ids, max_new_tokens=30)

    past_key_values, data, lengths = initialize_past_key_values(model.base_model, max_length=128)
    draft, retrieve, tree_mask, positions, logits, hidden, root = initialize_tree(input_ids, model, past_key_values,
                                                                                  None)
    ids, new_token = input_ids, 0
    while new_token < 29:
        tree_logits, features, _ = tree_decoding(model, draft, past_key_values, positions, ids, retrieve, tree_mask)
        padded = torch.cat([draft, torch.tensor([[-1]])], dim=1)
        candidates = padded[0, retrieve]
        best, accept, sample_p = evaluate_posterior(tree_logits, candidates, None)
        ids, draft, retrieve, tree_mask, positions, new_token, _, root = update_inference_inputs(
            ids, candidates, best, accept, retrieve, None, new_token, data, lengths, model, features, sample_p,
            past_key_values=past_key_values)
    n = min(ids.shape[1], expected.shape[1])
    assert ids[0, :n].tolist() == expected[0, :n].tolist()
    assert len(choices.mc_sim_7b_63) == 25
    assert len(prepare_logits_processor(0.0)) == 0 and len(prepare_logits_processor(0.5, top_p=0.9, top_k=5)) == 3


def test_total_token_minus_one_times_verification_on_this_device(tmp_path, caplog, monkeypatch):
    import logging

    from eagle.model import autotune

    base, head = make_tiny_pair(tmp_path, "qwen2", eagle3=True)
    measured = []
    real = autotune.time_verification

    def spy(model, size, **kwargs):
        seconds = real(model, size, prefix=32, repeats=1)
        measured.append((size, seconds))
        return seconds

    monkeypatch.setattr(autotune, "time_verification", spy)
    with caplog.at_level(logging.INFO, logger="eagle.model.ea_model"):
        model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=-1, depth=5)
    assert [size for size, _ in measured] == list(autotune.CANDIDATES)
    assert all(seconds > 0 for _, seconds in measured)
    rates = {size: autotune.expected_tokens(size, 5) / seconds for size, seconds in measured}
    assert model.total_token == max(rates, key=rates.get)
    assert model.ea_layer.total_tokens == model.total_token - 1
    assert f"chose a tree of {model.total_token} tokens" in caplog.text
    out = model.eagenerate(torch.tensor([[1, 20, 21]]), max_new_tokens=6)
    assert out.shape == (1, 9)
