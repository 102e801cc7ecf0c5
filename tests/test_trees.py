"""Tree settings: the tree a head carries (``eagle_tree`` in its config.json), how ``from_pretrained`` resolves
them, and the ``total_token=-1`` tuner (its choice from costs and acceptance, its cache)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from eagle.model.tuning import autotune
from eagle.model.configs import EConfig
from eagle.model.drafting.settings import TreeSettings
from eagle.model.ea_model import EaModel
from eagle.model.tuning.head_tree import REFERENCE_TREE, read_head_trees, write_head_tree
from tiny_models import make_tiny_pair

CPU_TREE = {"total_token": 9, "depth": 2, "top_k": 3, "lookup_tokens": 5}


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    return make_tiny_pair(tmp_path_factory.mktemp("trees"), "llama", eagle3=True)


def head_with_tree(tmp_path, head, trees) -> str:
    """A copy of ``head`` whose config, read and saved through EConfig (as the trainer saves heads), carries
    ``trees`` as its ``eagle_tree``."""
    config = EConfig.from_json_file(str(head / "config.json"))
    config.eagle_tree = trees
    target = tmp_path / "head-with-tree"
    target.mkdir()
    config.to_json_file(str(target / "config.json"))
    for weights in head.glob("*.safetensors"):
        shutil.copy(weights, target / weights.name)
    return str(target)


def settings_dict(settings: TreeSettings) -> dict:
    return {key: getattr(settings, key) for key in CPU_TREE}


def test_head_tree_round_trips_through_save_and_load(tiny_pair, tmp_path):
    base, head = tiny_pair
    tuned = head_with_tree(tmp_path, head, {"cpu": CPU_TREE, "cuda": {"total_token": 48, "depth": 6, "top_k": 8}})
    assert read_head_trees(tuned)["cpu"] == CPU_TREE
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=tuned)
    assert settings_dict(model.tree_settings) == CPU_TREE
    # the loaded head config writes the field back out: a head saved from it keeps its tree
    assert json.loads(model.ea_layer.config.to_json_string())["eagle_tree"]["cpu"] == CPU_TREE
    write_head_tree(tuned, "cpu", TreeSettings(12, 3, 4, 0))  # the --write-tree path: other kinds stay
    trees = read_head_trees(tuned)
    assert trees["cpu"] == {"total_token": 12, "depth": 3, "top_k": 4, "lookup_tokens": 0}
    assert trees["cuda"]["total_token"] == 48
    ids = torch.tensor([[1, 20, 21, 22]])
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=tuned)
    assert model.tree_settings == TreeSettings(12, 3, 4, 0)
    assert model.eagenerate(ids, max_new_tokens=12).tolist() == model.naivegenerate(ids, max_new_tokens=12).tolist()


def test_explicit_arguments_win_one_by_one(tiny_pair, tmp_path):
    base, head = tiny_pair
    tuned = head_with_tree(tmp_path, head, {"cpu": CPU_TREE})

    def load(path, **tree):
        return EaModel.from_pretrained(base_model_path=str(base), ea_model_path=path, **tree).tree_settings

    assert settings_dict(load(tuned, depth=4)) == {**CPU_TREE, "depth": 4}
    assert settings_dict(load(tuned, total_token=20, lookup_tokens=0)) == {**CPU_TREE, "total_token": 20,
                                                                            "lookup_tokens": 0}
    assert load(tuned, total_token=60, depth=7, top_k=10, lookup_tokens=0) == REFERENCE_TREE
    # a head without a tree (or without one for this kind of device) keeps the reference's defaults
    assert load(str(head)) == REFERENCE_TREE == TreeSettings(60, 7, 10, 0)
    (tmp_path / "gpu").mkdir()
    gpu_only = head_with_tree(tmp_path / "gpu", head, {"cuda": CPU_TREE})
    assert load(gpu_only) == REFERENCE_TREE
    assert settings_dict(load(str(head), top_k=3)) == {"total_token": 60, "depth": 7, "top_k": 3, "lookup_tokens": 0}


def test_bad_tree_settings_are_clear_errors(tiny_pair, tmp_path):
    base, head = tiny_pair
    with pytest.raises(ValueError, match="depth >= 0"):
        EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), depth=-2)
    with pytest.raises(ValueError, match="top_k must be an integer"):
        EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), top_k=2.5)
    bad = head_with_tree(tmp_path, head, {"cpu": {"total_tokens": 8}})
    with pytest.raises(ValueError, match="eagle_tree"):
        EaModel.from_pretrained(base_model_path=str(base), ea_model_path=bad)
    with pytest.raises(ValueError, match="both base_model_path and ea_model_path, or neither"):
        EaModel.from_pretrained(base_model_path=str(base))


class LinearCosts:
    """Verification costs ``fixed + per_token * size``; drafts ``0.5 ms`` per level."""

    def __init__(self, fixed: float, per_token: float):
        self.fixed, self.per_token, self.overhead, self.plain_step = fixed, per_token, 0.002, fixed + 0.002

    def verify(self, size):
        return self.fixed + self.per_token * size

    def draft(self, depth, top_k):
        return 0.0005 * (depth + 1) * (1 + top_k / 10)


def model_acceptance(settings: TreeSettings):
    """More nodes are accepted more, with diminishing returns, capped by the depth; no lookup gain."""
    tokens = min(1 + 0.8 * math.log2(settings.total_token), settings.depth + 2)
    return tokens * (1 + 0.01 * min(settings.top_k, 6)), float(settings.total_token + settings.lookup_tokens)


def test_tuner_picks_small_trees_when_verification_is_dear_and_large_ones_when_cheap():
    dear = autotune.choose_tree(autotune.search_space(), model_acceptance, LinearCosts(0.02, 0.004))
    cheap = autotune.choose_tree(autotune.search_space(), model_acceptance, LinearCosts(0.02, 0.00001))
    assert dear[0].settings.total_token <= 8 and dear[0].settings.lookup_tokens == 0, dear[0].describe()
    assert cheap[0].settings.total_token >= 48 and cheap[0].settings.depth >= 4, cheap[0].describe()
    assert dear[0].tokens_per_second >= dear[1].tokens_per_second
    fixed = autotune.choose_tree(autotune.search_space({"depth": 3, "top_k": 4}), model_acceptance,
                                 LinearCosts(0.02, 0.00001))
    assert {(p.settings.depth, p.settings.top_k) for p in fixed} == {(3, 4)}


def test_swept_acceptance_matches_the_replay_of_the_real_drafter(tiny_pair):
    """The one-draft-per-position sweep predicts exactly what the simulator's replay (the real drafter, step by
    step) accepts, for trees of several sizes, depths and lookup lengths."""
    from eagle.model.tuning.replay import Recording, replay

    base, head = tiny_pair
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), draft_dtype=torch.float32)
    torch.manual_seed(0)
    # an answer that repeats itself, so the lookup branch has something to graft
    prompt = torch.randint(6, 100, (1, 6))
    tokens = torch.cat([prompt[0], torch.randint(6, 100, (8,)).repeat(4)])
    features = model.engine.target.prefill(tokens[None], model.engine.target.new_cache(tokens.shape[0])).features
    recording = Recording(6, tokens, features)
    acceptance = autotune.CalibrationAcceptance({3: [autotune.sweep_positions(model.ea_layer, recording, 3, 3)]})
    for settings in (TreeSettings(4, 1, 3, 0), TreeSettings(10, 3, 3, 0), TreeSettings(6, 2, 3, 8),
                     TreeSettings(2, 3, 3, 32)):
        result = replay(model.ea_layer, recording, settings)
        tokens_per_step, tree_tokens = acceptance(settings)
        assert tokens_per_step == pytest.approx(result.tau), settings
        assert tree_tokens == pytest.approx(result.mean_tree_size), settings


def test_total_token_minus_one_tunes_once_and_the_cache_is_reused(tiny_pair, tmp_path, monkeypatch, caplog):
    import logging

    base, head = tiny_pair
    monkeypatch.setenv("EAGLE_TREE_CACHE", str(tmp_path / "cache" / "trees.json"))
    monkeypatch.setattr(autotune, "CALIBRATION_TOKENS", 12)  # tiny answers: the test checks the pipeline
    monkeypatch.setattr(autotune, "TOP_K_CHOICES", (2, 4))
    monkeypatch.setattr(autotune, "MAX_DEPTH", 3)
    monkeypatch.setattr(autotune, "REPEATS", 1)
    with caplog.at_level(logging.INFO, logger="eagle.model.tuning.autotune"):
        model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=-1)
    assert "tuned the tree for this cpu" in caplog.text and "runner-up" in caplog.text
    tuned = model.tree_settings
    assert tuned.top_k in (2, 4) and 1 <= tuned.depth <= 3
    ids = torch.tensor([[1, 20, 21, 22]])
    assert model.eagenerate(ids, max_new_tokens=12).tolist() == model.naivegenerate(ids, max_new_tokens=12).tolist()
    cache = json.loads((tmp_path / "cache" / "trees.json").read_text())
    assert [entry["tree"] for entry in cache.values()] == [settings_dict(tuned)]

    def no_measuring(*args, **kwargs):
        raise AssertionError("the cached tree should have been used")

    monkeypatch.setattr(autotune, "measure_acceptance", no_measuring)
    monkeypatch.setattr(autotune, "measure_costs", no_measuring)
    again = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=-1)
    assert again.tree_settings == tuned
    # a setting given with total_token=-1 stays fixed (and is another cache entry)
    monkeypatch.undo()
    monkeypatch.setenv("EAGLE_TREE_CACHE", str(tmp_path / "cache" / "trees.json"))
    monkeypatch.setattr(autotune, "CALIBRATION_TOKENS", 12)
    monkeypatch.setattr(autotune, "REPEATS", 1)
    fixed = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=-1, depth=2,
                                    top_k=3, lookup_tokens=0)
    assert (fixed.tree_settings.depth, fixed.tree_settings.top_k, fixed.tree_settings.lookup_tokens) == (2, 3, 0)
    assert len(json.loads((tmp_path / "cache" / "trees.json").read_text())) == 2


def test_write_tree_ships_the_tuned_tree_with_a_head(tiny_pair, tmp_path, monkeypatch):
    """``python -m eagle.evaluation.simulate --write-tree HEAD_DIR``: a trainer's output gets its tree, which
    ``from_pretrained`` then uses."""
    from eagle.evaluation import simulate

    base, head = tiny_pair
    target = tmp_path / "trained-head"
    shutil.copytree(head, target)
    monkeypatch.setenv("EAGLE_TREE_CACHE", str(tmp_path / "trees.json"))
    monkeypatch.setattr(autotune, "CALIBRATION_TOKENS", 8)
    monkeypatch.setattr(autotune, "TOP_K_CHOICES", (2, 3))
    monkeypatch.setattr(autotune, "MAX_DEPTH", 2)
    monkeypatch.setattr(autotune, "REPEATS", 1)
    [tree] = simulate.main(["--base-model-path", str(base), "--write-tree", str(target), "--device", "cpu"])
    assert read_head_trees(str(target)) == {"cpu": tree}
    assert tree["top_k"] in (2, 3) and 1 <= tree["depth"] <= 2
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(target))
    assert settings_dict(model.tree_settings) == tree
    with pytest.raises(SystemExit, match="config.json"):
        simulate.main(["--base-model-path", str(base), "--write-tree", str(tmp_path / "nothing-here")])
