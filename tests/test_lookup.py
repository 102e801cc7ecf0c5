"""The prompt-lookup branch: which continuation is found, how it joins the draft tree, and that generation with it
stays lossless and really accepts grafted tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import eagle.model.drafting.lookup as drafter_module
from eagle.model.drafting.settings import TreeSettings
from eagle.model.ea_model import EaModel
from eagle.model.drafting.lookup import find_continuation, graft_chain
from eagle.model.drafting.tree import tree_from_parents
from tiny_models import make_head, make_target


def test_continuation_follows_the_most_recent_longest_match():
    history = torch.tensor([5, 6, 7, 1, 2, 9, 5, 6, 8, 3, 5, 6])
    # the last 3-gram (8, 3, 5)... does not occur earlier; the 2-gram (5, 6) does, last at index 6
    assert find_continuation(history, 8).tolist() == [8, 3, 5, 6]
    assert find_continuation(history, 4).tolist() == [8, 3]  # a 2-gram match earns half of max_tokens
    # a 3-gram match wins over a more recent 2-gram match
    history = torch.tensor([1, 2, 3, 4, 0, 2, 3, 7, 1, 2, 3])
    assert find_continuation(history, 3).tolist() == [4, 0, 2]
    # only a 1-gram matches: a quarter of max_tokens
    assert find_continuation(torch.tensor([4, 9, 8, 7, 9]), 8).tolist() == [8, 7]
    assert find_continuation(torch.tensor([4, 9, 8, 7, 9]), 3).numel() == 0
    # nothing to copy
    assert find_continuation(torch.tensor([1, 2, 3]), 4).numel() == 0
    assert find_continuation(torch.tensor([3]), 4).numel() == 0
    # max_ngram/min_ngram bound the sizes tried
    assert find_continuation(torch.tensor([4, 9, 8, 7, 9]), 8, min_ngram=2).numel() == 0


def test_continuation_length_halves_with_each_token_less_of_match():
    text = torch.arange(30)
    for tail, expected in (([5, 6, 7], 16), ([99, 6, 7], 8), ([98, 99, 7], 4)):
        chain = find_continuation(torch.cat([text, torch.tensor(tail)]), 16)
        assert chain.tolist() == list(range(8, 8 + expected))


def _small_tree():
    # root 0 (token 10) -> 1 (11) -> 3 (13); root -> 2 (12)
    return tree_from_parents(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, 0, 0, 1]),
                             torch.tensor([0.0, -0.1, -0.5, -0.3]))


def test_graft_follows_existing_nodes_then_adds_a_chain():
    tree = graft_chain(_small_tree(), torch.tensor([11, 13, 20, 21]))
    assert tree.tokens.tolist() == [10, 11, 12, 13, 20, 21]
    assert tree.parents.tolist() == [-1, 0, 0, 1, 3, 4]
    assert tree.depths.tolist() == [0, 1, 1, 2, 3, 4]
    assert tree.ancestor_mask[5].nonzero().flatten().tolist() == [0, 1, 3, 4, 5]
    assert [row for row in tree.retrieve_indices.tolist() if row[-1] == 5] == [[0, 1, 3, 4, 5]]
    # grafted nodes rank after the head's own children of the same parent (sampling tries siblings by score)
    assert tree.scores[4] < tree.scores[3] and tree.scores[5] < tree.scores[4]


def test_graft_keeps_siblings_distinct_and_is_a_no_op_when_the_chain_is_in_the_tree():
    tree = graft_chain(_small_tree(), torch.tensor([12, 11]))
    assert tree.tokens.tolist() == [10, 11, 12, 13, 11] and tree.parents.tolist() == [-1, 0, 0, 1, 2]
    for parent in range(tree.size):
        kids = tree.tokens[tree.parents == parent].tolist()
        assert len(kids) == len(set(kids))
    same = _small_tree()
    assert graft_chain(same, torch.tensor([11, 13])) is same
    assert graft_chain(same, torch.tensor([], dtype=torch.long)) is same


def test_negative_lookup_tokens_is_refused():
    with pytest.raises(ValueError, match="lookup_tokens >= 0"):
        TreeSettings(total_token=8, depth=2, top_k=4, lookup_tokens=-1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target whose next token depends on the current token alone (attention and MLP outputs zeroed): its
    greedy output soon cycles, so text repeats and prompt lookup has something to find."""
    root = tmp_path_factory.mktemp("lookup")
    model = make_target(root / "random", "llama", seed=5)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    model.save_pretrained(root / "base")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (root / "random" / name).exists():
            (root / "base" / name).write_bytes((root / "random" / name).read_bytes())
    make_head(root / "head", model, eagle3=True, seed=6)
    reference = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    return root / "base", root / "head", reference


PROMPTS = [[1, 30, 31, 32, 33, 30, 31, 32, 33, 30], [1, 70, 71, 72, 73, 74, 75, 76, 77, 20], [1, 100]]


def test_lookup_branch_is_lossless_and_accepted(pair, monkeypatch):
    """A tree of depth 0 lets the head propose one token per step: every step that accepts two or more tokens
    accepted grafted lookup tokens. Greedy output equals transformers' generate with and without the branch."""
    base, head, reference = pair
    grafted = []
    real_graft = drafter_module.graft_chain

    def counting_graft(tree, chain):
        out = real_graft(tree, chain)
        grafted.append(out.size - tree.size)
        return out

    monkeypatch.setattr(drafter_module, "graft_chain", counting_graft)
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=3, depth=0,
                                    top_k=2, lookup_tokens=6)
    long_steps = 0
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        expected = reference.generate(ids, max_new_tokens=48, do_sample=False)
        steps = list(model.generate_steps(ids, max_new_tokens=48))
        emitted = torch.cat([s.tokens for s in steps])
        assert torch.equal(torch.cat([ids[0], emitted]), expected[0])
        long_steps += sum(s.accepted >= 2 for s in steps)
        model.set_tree(3, 0, 2, lookup_tokens=0)
        assert torch.equal(model.eagenerate(ids, max_new_tokens=48), expected)
        model.set_tree(3, 0, 2, lookup_tokens=6)
    assert any(grafted), "no lookup chain was ever grafted"
    assert max(grafted) <= 6
    assert long_steps > 0, "no grafted token was ever accepted"


def test_lookup_by_name_grafts_where_the_tree_has_no_lookup_branch(pair, monkeypatch):
    """``drafter="eagle3+lookup"`` on a tree with ``lookup_tokens=0`` grafts chains of GRAFTED_LOOKUP_TOKENS (it is
    not silently the head alone), and its greedy output is still transformers' generate."""
    base, head, reference = pair
    grafted = []
    real_graft = drafter_module.graft_chain

    def counting_graft(tree, chain):
        grafted.append(chain.numel())
        return real_graft(tree, chain)

    monkeypatch.setattr(drafter_module, "graft_chain", counting_graft)
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=3, depth=0,
                                    top_k=2, lookup_tokens=0)
    assert model.drafter == "eagle3"
    ids = torch.tensor([PROMPTS[0]])
    expected = reference.generate(ids, max_new_tokens=32, do_sample=False)
    assert torch.equal(model.eagenerate(ids, max_new_tokens=32), expected)
    assert not grafted, "the head's own drafter grafted a chain with lookup_tokens=0"
    assert torch.equal(model.eagenerate(ids, max_new_tokens=32, drafter="eagle3+lookup"), expected)
    assert grafted and max(grafted) == drafter_module.GRAFTED_LOOKUP_TOKENS


def test_lookup_tokens_from_pretrained_and_set_tree(pair):
    base, head, _ = pair
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=8, depth=2,
                                    top_k=4, lookup_tokens=5)
    assert model.tree_settings.lookup_tokens == 5 and model.tree_settings.max_tree_size == 13
    model.set_tree(6, 2, 3)  # None keeps the branch
    assert model.tree_settings.lookup_tokens == 5
    model.set_tree(6, 2, 3, lookup_tokens=0)
    assert model.tree_settings.lookup_tokens == 0
    with pytest.raises(ValueError, match="lookup_tokens"):
        EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), lookup_tokens=-2)


def test_simulate_tree_list_errors_say_what_is_expected():
    from eagle.evaluation.simulate import parse_trees

    assert [(t.total_token, t.depth, t.top_k, t.lookup_tokens) for t in parse_trees("8/2/4/16, 12/2/4")] == [
        (8, 2, 4, 16), (12, 2, 4, 0)]
    with pytest.raises(SystemExit, match="total_token/depth/top_k"):
        parse_trees("8/2")
    with pytest.raises(SystemExit, match="lookup_tokens >= 0"):
        parse_trees("8/2/4/-1")
