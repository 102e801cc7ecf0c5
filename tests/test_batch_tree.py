"""Batch trees: a batch drafts with the tree for its number of rows (the head's ``eagle_batch_tree``, or
``set_batch_trees``), re-chosen as rows finish; an explicit tree applies to every batch size; rows stay exactly their
prompts' greedy decoding; bad batch trees are refused with a clear error."""

from __future__ import annotations

import json

import pytest
import torch

from eagle.model.drafting import lookup as lookup_module
from eagle.model.drafting.batch_tree import largest_tree_size, parse_batch_trees, tree_for_batch
from eagle.model.drafting.settings import TreeSettings
from eagle.model.ea_model import EaModel
from test_batching import hf_alone, left_padded
from tiny_models import make_head, make_target

BATCH1 = {"total_token": 10, "depth": 3, "top_k": 3, "lookup_tokens": 6}
BATCH_TREES = {"cpu": {"3": {"total_token": 4, "depth": 1, "top_k": 3, "lookup_tokens": 0},
                       "5": {"total_token": 2, "depth": 0}}}
PROMPTS = [[1, 40, 41, 42, 40, 41], [1, 70, 71, 72, 73, 74, 75, 76, 77, 20], [1, 100], [1, 40, 41, 42],
           [1, 5, 6, 7, 5, 6]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-tree")
    model = make_target(root / "base", "llama", seed=3)
    make_head(root / "head", model, eagle3=True, seed=4)
    config = json.loads((root / "head" / "config.json").read_text())
    config.update(eagle_tree={"cpu": BATCH1}, eagle_batch_tree=BATCH_TREES)
    (root / "head" / "config.json").write_text(json.dumps(config))
    return root / "base", root / "head", model.eval()


def test_the_tree_for_a_batch_size_is_the_entry_of_the_largest_key_not_above_it():
    base = TreeSettings(**BATCH1)
    trees = parse_batch_trees(BATCH_TREES, base)["cpu"]
    assert trees == {3: TreeSettings(4, 1, 3, 0), 5: TreeSettings(2, 0, 3, 6)}  # missing settings: the batch-1 tree's
    assert [tree_for_batch(base, trees, b) for b in (1, 2, 3, 4, 5, 16)] == [base, base] + [trees[3]] * 2 + [trees[5]] * 2
    assert largest_tree_size(base, trees, 8) == base.max_tree_size  # rows leave: the batch-1 tree may come back
    assert largest_tree_size(TreeSettings(2, 1, 1, 0), {2: TreeSettings(9, 2, 4, 3)}, 4) == 12


def test_the_head_s_batch_trees_are_used_and_rechosen_as_rows_finish(pair, monkeypatch):
    base, head, reference = pair
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), dtype=torch.float32)
    assert model.tree_settings == TreeSettings(**BATCH1)
    assert model.tree_for_batch(2) == model.tree_settings and model.tree_for_batch(4) == TreeSettings(4, 1, 3, 0)
    assert model.tree_for_batch(8) == TreeSettings(2, 0, 3, 6)
    drafted = []  # (rows, the tree in use, each tree's size, the drafter) per draft
    original = lookup_module.LookupDrafter.propose

    def spy(self):  # the head's drafter with its lookup branch (the batch-1 tree grafts lookup chains)
        trees = original(self)
        drafted.append((len(trees), self.inner.settings, [t.size for t in trees], self))
        return trees

    monkeypatch.setattr(lookup_module.LookupDrafter, "propose", spy)
    # max_length 16: budgets 10, 6, 14, 12, 10, so the batch shrinks from 5 rows to 4, 2 and 1
    expected = [row[: 16 - len(prompt)] for row, prompt in zip(hf_alone(reference, PROMPTS, max_new_tokens=14),
                                                                 PROMPTS)]
    ids, mask = left_padded(PROMPTS)
    out, counts, _ = model.eagenerate(ids, attention_mask=mask, max_new_tokens=30, max_length=16, log=True)
    assert [out[b, ids.shape[1] : ids.shape[1] + n].tolist() for b, n in enumerate(counts)] == expected
    assert {rows for rows, *_ in drafted} == {5, 4, 2, 1}
    for rows, settings, sizes, _ in drafted:
        assert settings == model.tree_for_batch(rows)
        assert all(size <= settings.max_tree_size for size in sizes)
    assert any(max(sizes) > 4 for rows, _, sizes, _ in drafted if rows <= 2)  # the batch-1 tree came back
    # the lookup history of the last row is its whole text, though 4 rows drafted without lookup before
    drafter = drafted[-1][3]
    history = drafter.history[0].tolist()
    assert history[:1] == PROMPTS[2][1:] and history[1:] == expected[2][: len(history) - 1]
    assert len(history) > 10


def test_the_embedded_head_s_batch_trees_shrink_as_the_batch_grows():
    from pathlib import Path

    import eagle

    config = json.loads((Path(eagle.__file__).parent / "default_head" / "config.json").read_text())
    base = TreeSettings(**config["eagle_tree"]["cpu"])
    trees = parse_batch_trees(config["eagle_batch_tree"], base)["cpu"]
    sizes = [tree_for_batch(base, trees, b).max_tree_size for b in (1, 2, 4, 8, 16)]
    assert sizes == sorted(sizes, reverse=True) and sizes[-1] < sizes[0]


def test_batch_trees_apply_only_from_the_kind_whose_batch_1_tree_was_chosen():
    """On the int8 GGUF kernels the embedded head's batch-1 tree is its own ``cpu-gguf-int8`` one; the ``cpu`` batch
    trees (float32 weights' costs) would give a batch of 2 a larger tree than one sequence gets, so none apply; a
    head with batch trees for the kernels' own kind uses them, and the plain CPU keeps its ``cpu`` ones."""
    from pathlib import Path

    import eagle
    from eagle.model.drafting.batch_tree import head_batch_trees

    config = json.loads((Path(eagle.__file__).parent / "default_head" / "config.json").read_text())
    cpu = torch.device("cpu")
    int8 = TreeSettings(**config["eagle_tree"]["cpu-gguf-int8"])
    assert head_batch_trees(config, cpu, int8, "gguf-int8") == {}
    assert set(head_batch_trees(config, cpu, TreeSettings(**config["eagle_tree"]["cpu"]))) == {2, 5}
    own = dict(config, eagle_batch_tree={**config["eagle_batch_tree"], "cpu-gguf-int8": {"4": {"total_token": 1}}})
    assert head_batch_trees(own, cpu, int8, "gguf-int8") == {4: TreeSettings(1, 0, 1, 0)}
    no_batch_1 = {"eagle_tree": {"cpu": config["eagle_tree"]["cpu"]}, "eagle_batch_tree": config["eagle_batch_tree"]}
    assert set(head_batch_trees(no_batch_1, cpu, int8, "gguf-int8")) == {2, 5}  # the "cpu" tree is the batch-1 one


def test_an_explicit_tree_applies_to_every_batch_size(pair):
    base, head, reference = pair
    given = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), lookup_tokens=0,
                                    dtype=torch.float32)
    assert given.batch_trees == {} and given.tree_for_batch(8) == given.tree_settings == TreeSettings(10, 3, 3, 0)
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), dtype=torch.float32)
    assert model.batch_trees
    model.set_tree(6, 2, 2, 0)
    assert model.batch_trees == {} and model.tree_for_batch(16) == TreeSettings(6, 2, 2, 0)
    model.set_batch_trees({4: TreeSettings(3, 1, 2, 0)})
    assert model.tree_for_batch(4) == TreeSettings(3, 1, 2, 0) and model.tree_for_batch(3) == TreeSettings(6, 2, 2, 0)
    model.tree_settings = TreeSettings(5, 1, 4, 2)
    assert model.batch_trees == {} and model.tree_for_batch(4) == TreeSettings(5, 1, 4, 2)


@pytest.mark.parametrize("trees", [{1: TreeSettings()}, {"4": TreeSettings()}, {4: {"total_token": 4}}, [4]])
def test_bad_batch_trees_are_refused(pair, trees):
    base, head, _ = pair
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), dtype=torch.float32)
    before = model.batch_trees
    with pytest.raises(ValueError, match="batch size >= 2|Batch trees must be a dict"):
        model.set_batch_trees(trees)
    assert model.batch_trees == before


@pytest.mark.parametrize("field", [{"cpu": {"1": {"total_token": 4}}}, {"cpu": {"4": {"width": 4}}},
                                   {"cpu": {"4": {"total_token": 0}}}, {"cpu": [4]}, [1]])
def test_a_head_with_a_bad_batch_tree_field_says_what_was_expected(pair, tmp_path, field):
    base, head, _ = pair
    bad = tmp_path / "head"
    bad.mkdir()
    config = json.loads((head / "config.json").read_text())
    config["eagle_batch_tree"] = field
    (bad / "config.json").write_text(json.dumps(config))
    (bad / "model.safetensors").write_bytes((head / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="eagle_batch_tree"):
        EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(bad), dtype=torch.float32)


def token_paths(tree) -> set[tuple[int, ...]]:
    """Every node as the tokens from the root to it."""
    return {tuple(tree.tokens[tree.ancestor_mask[node]].tolist()) for node in range(tree.size)}
