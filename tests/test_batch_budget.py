"""A batch's draft nodes come from one budget: ``B x (total_token - 1)`` nodes taken by score over every row's
candidates and lookup chains (confident rows deeper, unsure ones down to their root), parents before children, and
rows stay exactly their prompts' greedy decoding."""

from __future__ import annotations

import math

import pytest
import torch

from eagle.model import drafter as drafter_module
from eagle.model.batch_budget import LookupRate, row_tree_limit, select_batch_trees
from eagle.model.batch_tree import largest_tree_size
from eagle.model.drafter import TreeSettings
from eagle.model.ea_model import EaModel
from eagle.model.tree import select_tree
from test_batch_tree import pair, token_paths  # noqa: F401  (the module's fixture)
from test_batching import hf_alone, left_padded


def chain_candidates(probs: list[float], first_token: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One row's candidates: a chain whose i-th token has conditional probability probs[i], and a weak sibling
    under each chain node (probability 1 - probs[i] of the same parent)."""
    tokens, scores, parents = [], [], []
    score, parent = 0.0, -1
    for i, p in enumerate(probs):
        tokens += [first_token + 2 * i, first_token + 2 * i + 1]
        scores += [score + math.log(p), score + math.log(1 - p)]
        parents += [parent, parent]
        score, parent = score + math.log(p), len(tokens) - 2
    return torch.tensor(tokens), torch.tensor(scores), torch.tensor(parents)


def rows_candidates(rows: list[list[float]]):
    built = [chain_candidates(probs, 100 * (b + 1)) for b, probs in enumerate(rows)]
    return torch.arange(len(rows)), *(torch.stack(parts) for parts in zip(*built))


def check_tree(tree) -> None:
    """Node 0 is the root, every other node's parent is in the tree before it."""
    assert tree.parents[0] == -1 and bool((tree.parents[1:] >= 0).all())
    assert bool((tree.parents[1:] < torch.arange(1, tree.size)).all())


def test_confident_rows_get_deeper_trees_and_the_budget_is_the_best_scored_nodes():
    confident, unsure = [0.95] * 5, [0.3] * 5
    roots, tokens, scores, parents = rows_candidates([unsure, confident, unsure, confident])
    budget = 12
    trees, grafted = select_batch_trees(roots, tokens, scores, parents, budget)
    assert grafted == [0] * 4
    for b, tree in enumerate(trees):
        check_tree(tree)
        assert tree.tokens[0] == roots[b]  # each row keeps its root
    assert sum(tree.size - 1 for tree in trees) == budget
    assert trees[1].depths.max() == 5 and trees[3].depths.max() == 5  # the confident chains all the way down
    assert trees[0].size < trees[1].size and trees[2].size < trees[3].size
    # the kept nodes are the batch's best `budget` scores
    kept = sorted((s for tree in trees for s in tree.scores[1:].tolist()), reverse=True)
    assert kept == pytest.approx(sorted(scores.flatten().tolist(), reverse=True)[:budget])
    # a budget below the rows leaves the least sure rows their root alone
    trees, _ = select_batch_trees(roots, tokens, scores, parents, 2)
    assert [tree.size for tree in trees] == [1, 2, 1, 2]


def test_a_row_alone_with_the_whole_budget_is_the_single_sequence_tree():
    roots, tokens, scores, parents = rows_candidates([[0.6, 0.7, 0.5, 0.9]])
    for budget in (0, 3, 8):
        trees, _ = select_batch_trees(roots, tokens, scores, parents, budget)
        alone = select_tree(roots[0], tokens[0], scores[0], parents[0], budget)
        assert trees[0].tokens.tolist() == alone.tokens.tolist()
        assert trees[0].parents.tolist() == alone.parents.tolist()


def test_lookup_chains_compete_for_the_budget_by_their_acceptance_rate():
    roots, tokens, scores, parents = rows_candidates([[0.3] * 3, [0.3] * 3])
    chains = [torch.tensor([7, 8, 9, 10]), None]
    trusted, _ = select_batch_trees(roots, tokens, scores, parents, 4, chains, [math.log(0.95)] * 2)
    doubted, grafted = select_batch_trees(roots, tokens, scores, parents, 4, chains, [math.log(0.05)] * 2)
    assert grafted == [0, 0] and token_paths(doubted[0]).isdisjoint({(0, 7)})
    assert (0, 7, 8, 9, 10) in token_paths(trusted[0]) and trusted[1].size == 1  # the whole chain, nothing else
    # in between: the chain's start competes with the head's best nodes, a chain is kept from its start
    mixed, grafted = select_batch_trees(roots, tokens, scores, parents, 4, chains, [math.log(0.6)] * 2)
    assert grafted[0] == 2 and (0, 7, 8) in token_paths(mixed[0]) and (0, 7, 8, 9) not in token_paths(mixed[0])
    assert sum(tree.size - 1 for tree in mixed) == 4
    # a chain that follows a kept head node is not counted twice
    follow = [tokens[0, :1].clone(), None]
    trees, grafted = select_batch_trees(roots, tokens, scores, parents, 4, follow, [math.log(0.9)] * 2)
    assert grafted[0] == 1 and sum(tree.size - 1 for tree in trees) == 3
    assert trees[0].tokens[trees[0].parents == 0].tolist().count(int(follow[0])) == 1


def test_the_lookup_rate_follows_what_rows_commit_by_match_length():
    rate = LookupRate({1: 0.5, 3: 0.5}, 10)
    chain = torch.tensor([1, 2, 3, 4])
    rate.observe(chain, 3, verified=4, committed=torch.tensor([1, 2, 3, 4, 5]))  # 4 accepted out of 4 tried
    assert rate.rate(3) > 0.6 and rate.rate(1) == 0.5
    for _ in range(40):  # first token wrong, though not verified: the target's next token says so
        rate.observe(chain, 1, verified=0, committed=torch.tensor([9]))
    assert rate.rate(1) < 0.1 and rate.rate(3) > 0.6
    rate.observe(chain, 2, verified=0, committed=torch.tensor([1]))  # right, then nothing known: one success in one
    assert rate.counts[2] == pytest.approx([0.5 * 10 * 0.98 + 1, 10 * 0.98 + 1])
    assert LookupRate().rate(1) < LookupRate().rate(2) < LookupRate().rate(3)  # longer matches, likelier chains


@pytest.fixture
def shared(monkeypatch):
    monkeypatch.setattr(drafter_module.EagleDrafter, "shared_budget", True)


def test_a_row_may_take_more_than_its_share_and_the_cache_makes_room(shared):
    assert row_tree_limit(8, 2, 4, 16, 1) == 24
    assert row_tree_limit(3, 2, 4, 8, 4) == 1 + 8
    assert row_tree_limit(8, 1, 2, 4, 8) == 1 + 2 + 4 + 4
    base, trees = TreeSettings(10, 3, 3, 6), {3: TreeSettings(4, 1, 3, 0)}
    # rows leave: at batch 2 the batch-1 tree is a budget of 2 x 9 draft nodes, one row may take them all
    assert largest_tree_size(base, trees, 8) == 1 + 2 * 9
    assert largest_tree_size(base, {}, 1) == base.max_tree_size
    # 4 rows x 8 draft nodes, at most the 4 + 2 x 16 candidates and the 3-token chain in one row
    assert largest_tree_size(TreeSettings(2, 1, 1, 0), {2: TreeSettings(9, 2, 4, 3)}, 4) == 33


def test_batched_drafts_share_the_budget_and_a_single_row_is_unchanged(pair, shared, monkeypatch):  # noqa: F811
    base, head, _ = pair
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), dtype=torch.float32)
    settings = TreeSettings(4, 2, 3, 6)
    tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13, 14, 15, 16, 17, 18, 19],
                           [5, 6, 7, 8, 9, 10, 5, 6, 7]])
    torch.manual_seed(0)
    features = torch.randn(3, tokens.shape[1], model.ea_layer.fc.weight.shape[1])
    batched = drafter_module.EagleDrafter(model.ea_layer, settings)
    batched.reset(3)
    trees = batched.draft_batch(features, tokens)
    assert sum(tree.size - 1 for tree in trees) <= 3 * (settings.total_token - 1)
    for b, tree in enumerate(trees):
        check_tree(tree)
        assert tree.tokens[0] == tokens[b, -1] and tree.size <= row_tree_limit(4, 2, 3, 6, 3)
    alone = drafter_module.EagleDrafter(model.ea_layer, settings)
    alone.reset(1)
    tree = alone.draft_batch(features[:1], tokens[:1])[0]
    assert tree.size > settings.total_token  # one row: total_token nodes plus its whole chain, as before
    monkeypatch.setattr(drafter_module.EagleDrafter, "shared_budget", False)  # to compare: the same tree per row
    uniform = drafter_module.EagleDrafter(model.ea_layer, settings)
    uniform.reset(3)
    trees = uniform.draft_batch(features, tokens)
    assert trees[1].size == settings.total_token and trees[0].size == trees[2].size == tree.size
    # the next step scores the rows' last chains into the lookup rate, which only a shared budget reads
    uniform.draft_batch(features[:, :2], tokens[:, :2])
    assert uniform.lookup_rate.counts == LookupRate().counts
    monkeypatch.setattr(drafter_module.EagleDrafter, "shared_budget", True)
    batched.draft_batch(features[:, :2], tokens[:, :2])
    assert batched.lookup_rate.counts != LookupRate().counts


def test_greedy_rows_with_a_shared_budget_equal_hf_greedy(pair, shared, monkeypatch):  # noqa: F811
    base, head, reference = pair
    sizes = []
    original = drafter_module.EagleDrafter.draft_batch

    def spy(self, features, next_tokens, valid=None):
        trees = original(self, features, next_tokens, valid)
        sizes.append([tree.size for tree in trees])
        return trees

    monkeypatch.setattr(drafter_module.EagleDrafter, "draft_batch", spy)
    prompts = [[1, 40, 41, 42, 40, 41], [1, 70, 71, 72, 73, 74, 75, 76, 77, 20], [1, 100], [1, 5, 6, 7, 5, 6]]
    expected = hf_alone(reference, prompts, max_new_tokens=24)
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), dtype=torch.float32)
    model.set_batch_trees({2: TreeSettings(3, 3, 3, 6)})
    ids, mask = left_padded(prompts)
    steps = list(model.generate_batch_steps(ids, attention_mask=mask, max_new_tokens=24))
    assert [[t for s in steps for t in s.tokens[row].tolist()] for row in range(len(prompts))] == expected
    shared_steps = [step for step in sizes if len(step) > 1]
    assert all(sum(step) <= 3 * len(step) for step in shared_steps)  # 2 draft nodes per row on average at most
    assert any(len(set(step)) > 1 for step in shared_steps)  # rows got different shares
