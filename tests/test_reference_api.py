"""The reference's step functions (eagle.model.utils) drive a full generation that equals eagenerate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

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
    # the loop stops once 29 tokens are out (its last step may accept several): each output is exactly greedy search
    # of its own length, and they agree on their common tokens
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert ids.shape[1] - input_ids.shape[1] == new_token >= 29
    assert ids.tolist() == reference.generate(input_ids, max_new_tokens=new_token, do_sample=False).tolist()
    assert expected.tolist() == reference.generate(input_ids, max_new_tokens=30, do_sample=False).tolist()
    n = min(ids.shape[1], expected.shape[1])
    assert ids[0, :n].tolist() == expected[0, :n].tolist()
    assert len(choices.mc_sim_7b_63) == 25
    assert len(prepare_logits_processor(0.0)) == 0 and len(prepare_logits_processor(0.5, top_p=0.9, top_k=5)) == 3


def test_total_token_minus_one_tunes_the_tree_on_this_device(tmp_path, caplog, monkeypatch):
    """The reference's ``total_token=-1`` still chooses the size on this device; the other settings given stay."""
    import logging

    from eagle.model.tuning import autotune

    base, head = make_tiny_pair(tmp_path, "qwen2", eagle3=True)
    monkeypatch.setenv("EAGLE_TREE_CACHE", str(tmp_path / "trees.json"))
    monkeypatch.setattr(autotune, "CALIBRATION_TOKENS", 8)
    monkeypatch.setattr(autotune, "REPEATS", 1)
    with caplog.at_level(logging.INFO, logger="eagle.model.tuning.autotune"):
        model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=-1, depth=5,
                                        top_k=4)
    assert (model.tree_settings.depth, model.tree_settings.top_k) == (5, 4)
    assert model.total_token in autotune.SIZE_CHOICES
    assert f"tuned the tree for this cpu: {model.total_token}/5/4/" in caplog.text
    prompt = torch.tensor([[1, 20, 21]])
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert model.eagenerate(prompt, max_new_tokens=6).tolist() == reference.generate(
        prompt, max_new_tokens=6, do_sample=False).tolist()


COMPAT_MODULES = ("cnets", "cnets1", "configs", "choices", "utils", "kv_cache")


def test_reference_names_are_the_engine_classes():
    from eagle.model import cnets, cnets1, configs, utils
    from eagle.model.heads import draft_config
    from eagle.model.heads import draft_head

    assert cnets.Model is draft_head.Eagle3DraftHead and cnets1.Model is draft_head.Eagle1DraftHead
    assert cnets.Model is not cnets1.Model and configs.EConfig is draft_config.EConfig
    for name in ("prepare_logits_processor", "initialize_tree", "tree_decoding", "evaluate_posterior",
                 "update_inference_inputs", "reset_tree_mode", "generate_tree_buffers", "pad_path", "TOPK"):
        assert hasattr(utils, name), name


def test_engine_imports_nothing_from_the_compatibility_layer():
    """The reference's module names are a thin layer over the engine: no other module of the package imports
    them (so the engine can change without them, and they can go without touching it)."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[1] / "eagle"
    compat = {f"eagle.model.{name}" for name in COMPAT_MODULES} | {"eagle.model.compat"}
    compat |= {f"eagle.model.compat.{name}" for name in COMPAT_MODULES}
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if (path.parent == package / "model" and path.stem in COMPAT_MODULES) or path.parent == package / "model" / "compat":
            continue
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(parts[: len(parts) - node.level]) if node.level else ""
                module = ".".join(filter(None, [base, node.module]))
                names = [module] + [f"{module}.{alias.name}" for alias in node.names]
            else:
                continue
            offenders += [f"{path.relative_to(package.parent)}:{node.lineno} {name}" for name in names if name in compat]
    assert not offenders, offenders


def test_reference_evaluate_posterior_samples_like_the_engine():
    """``utils.evaluate_posterior`` with a sampling processor walks the paths as the engine's verifier walks the
    tree: same accepted tokens, and the returned distribution draws the engine's bonus token."""
    from eagle.model.drafting.tree import tree_from_parents
    from eagle.model.utils import evaluate_posterior
    from eagle.model.engine.acceptance import Sampler, accept_sampling

    # Nodes numbered depth first, siblings by descending score: row order of the paths = the engine's order.
    parents = torch.tensor([-1, 0, 1, 1, 0, 4, 5, 0])
    tokens = torch.tensor([9, 1, 2, 3, 2, 4, 0, 5])
    tree = tree_from_parents(tokens, parents, -torch.arange(8.0))
    processors = prepare_logits_processor(0.8, top_p=0.95)
    accepted_lengths = set()
    for seed in range(60):
        node_logits = torch.randn(8, 6, generator=torch.Generator().manual_seed(seed)) * 2
        retrieve = tree.retrieve_indices
        candidates = torch.where(retrieve >= 0, tokens[retrieve.clamp(min=0)], -1)
        path_logits = node_logits[retrieve.clamp(min=0)]
        sampler = Sampler(0.8, top_p=0.95, generator=torch.Generator().manual_seed(seed))
        path, bonus = accept_sampling(tree, node_logits, sampler)
        generator = torch.Generator().manual_seed(seed)
        best, accept, probs = evaluate_posterior(path_logits, candidates, processors, generator)
        assert candidates[best, : accept + 1].tolist() == tokens[path].tolist()
        assert int(torch.multinomial(probs, 1, generator=generator)[0]) == int(bonus)
        accepted_lengths.add(accept)
    assert len(accepted_lengths) > 1  # the walk both stopped early and went deeper


def test_static_tree_buffers_of_the_reference_tree():
    """``utils.generate_tree_buffers`` (reference name; the engine's trees are dynamic) on ``mc_sim_7b_63``: every
    node sees exactly its ancestors, the retrieved paths are the 15 maximal ones, and each node indexes its rank in
    its parent's block of TOPK candidates."""
    from eagle.model.utils import TOPK, generate_tree_buffers

    paths = sorted(choices.mc_sim_7b_63, key=lambda path: (len(path), path))
    buffers = generate_tree_buffers(choices.mc_sim_7b_63)
    mask, rows = buffers["tree_attn_mask"][0, 0], buffers["retrieve_indices"].tolist()
    assert mask.shape == (26, 26) and len(rows) == 15 and rows == sorted(rows, key=lambda r: [v % 100 for v in r])  # -1 last
    assert {node for row in rows for node in row if node >= 0} == set(range(26))
    for row in rows:
        nodes = [node for node in row if node >= 0]
        assert nodes[0] == 0 and [paths[n - 1] for n in nodes[1:]] == [paths[nodes[-1] - 1][:k] for k in range(1, len(nodes))]
        for depth, node in enumerate(nodes):
            assert mask[node].nonzero().flatten().tolist() == nodes[: depth + 1]
            assert int(buffers["tree_position_ids"][node]) == depth
    blocks = {}
    for node, path in enumerate(paths, start=1):
        block, rank = divmod(int(buffers["tree_indices"][node]) - 1, TOPK)
        assert rank == path[-1]
        assert blocks.setdefault(tuple(path[:-1]), block) == block
    assert sorted(blocks.values()) == list(range(len(blocks)))  # one block per expanded node, none skipped


# The reference's public import paths (EAGLE_SPEC section 1), each with a name its users import from it.
REFERENCE_PATHS = [("eagle.model", "EaModel"), ("eagle.model.ea_model", "EaModel"), ("eagle.model.cnets", "Model"),
                   ("eagle.model.cnets1", "Model"), ("eagle.model.configs", "EConfig"),
                   ("eagle.model.choices", "mc_sim_7b_63"), ("eagle.model.utils", "initialize_tree"),
                   ("eagle.model.utils", "prepare_logits_processor"),
                   ("eagle.model.kv_cache", "initialize_past_key_values")]


@pytest.mark.parametrize("module, name", REFERENCE_PATHS, ids=lambda value: str(value))
def test_every_reference_import_path_works(module, name):
    import importlib

    assert getattr(importlib.import_module(module), name) is not None
