"""Tree construction and tree attention against slow, obviously-correct references."""

from __future__ import annotations

import pytest
import torch

from eagle.model.drafting.eagle import EagleDrafter
from eagle.model.drafting.settings import TreePlan, TreeSettings
from eagle.model.engine.verify import verify_tree
from eagle.model.heads.loading import load_ea_layer
from eagle.model.base.target import Target, eagle3_layer_ids
from eagle.model.drafting.tree import (likeliest_root_subtrees, likeliest_subtree, select_tree, select_trees,
                              tree_from_parents, trees_from_parents)
from eagle.model.engine.acceptance import accept_greedy
from tiny_models import make_head, make_target


def random_candidates(top_k: int, depth: int, seed: int, coarse: bool):
    """Candidates laid out as the EAGLE-2 drafter produces them: level 0 has K children of the root; each later
    level has K children for each of the K best nodes of the previous level. ``coarse`` rounds log-probs so that
    exact ties happen."""
    gen = torch.Generator().manual_seed(seed)

    def logp(n):
        values = torch.log_softmax(torch.randn(n, generator=gen) * 2, dim=0).topk(top_k).values
        return values.round(decimals=0) if coarse else values

    tokens, scores, parents = [], [], []
    level_ids = list(range(top_k))
    tokens += torch.randint(0, 1000, (top_k,), generator=gen).tolist()
    scores += logp(50).tolist()
    parents += [-1] * top_k
    for _ in range(depth):
        frontier = sorted(level_ids, key=lambda c: (-scores[c], c))[:top_k]
        new_ids = []
        for parent in frontier:
            for value in logp(50).tolist():
                new_ids.append(len(tokens))
                tokens.append(int(torch.randint(0, 1000, (1,), generator=gen)))
                scores.append(scores[parent] + value)
                parents.append(parent)
        level_ids = new_ids
    return torch.tensor(tokens), torch.tensor(scores), torch.tensor(parents)


def slow_tree(root, tokens, scores, parents, num_nodes):
    """Plain-Python reference: best `num_nodes` candidates (ties: earlier first), explicit ancestor walks."""
    ranked = sorted(range(len(tokens)), key=lambda c: (-float(scores[c]), c))[:num_nodes]
    kept = sorted(ranked)
    node_of = {c: i + 1 for i, c in enumerate(kept)}
    node_parents = [-1] + [0 if int(parents[c]) < 0 else node_of[int(parents[c])] for c in kept]
    size = len(kept) + 1
    ancestors = []
    for node in range(size):
        chain, current = [], node
        while current != -1:
            chain.append(current)
            current = node_parents[current]
        ancestors.append(sorted(chain))
    depths = [len(a) - 1 for a in ancestors]
    leaves = [n for n in range(size) if n not in node_parents]
    max_depth = max(depths)
    paths = [a + [-1] * (max_depth + 1 - len(a)) for a in (ancestors[leaf] for leaf in leaves)]
    mask = [[j in ancestors[i] for j in range(size)] for i in range(size)]
    return {
        "tokens": [int(root)] + [int(tokens[c]) for c in kept],
        "parents": node_parents,
        "depths": depths,
        "ancestor_mask": mask,
        "retrieve_indices": paths,
    }


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("top_k,depth,num_nodes", [(3, 2, 6), (4, 3, 15), (5, 4, 40), (2, 6, 13), (3, 0, 2)])
def test_select_tree_matches_slow_reference(seed, top_k, depth, num_nodes):
    tokens, scores, parents = random_candidates(top_k, depth, seed, coarse=seed % 2 == 1)
    root = torch.tensor(7)
    tree = select_tree(root, tokens, scores, parents, num_nodes)
    expected = slow_tree(root, tokens, scores, parents, num_nodes)
    assert tree.tokens.tolist() == expected["tokens"]
    assert tree.parents.tolist() == expected["parents"]
    assert tree.depths.tolist() == expected["depths"]
    assert tree.ancestor_mask.tolist() == expected["ancestor_mask"]
    assert tree.retrieve_indices.tolist() == expected["retrieve_indices"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batch,top_k,depth,num_nodes",
                         [(1, 3, 2, 6), (8, 1, 0, 1), (8, 3, 1, 3), (5, 4, 3, 15), (3, 2, 6, 13), (4, 3, 0, 0),
                          (2, 3, 2, 100)])
def test_select_trees_equals_select_tree_per_row(seed, batch, top_k, depth, num_nodes):
    """The batched selection builds, row for row, the tree the one-row path builds: same nodes in the same order,
    every field equal (values, dtype, shape), including rows whose scores tie and rows of different shapes."""
    rows = [random_candidates(top_k, depth, 100 * seed + b, coarse=(seed + b) % 2 == 0) for b in range(batch)]
    tokens, scores, parents = (torch.stack([row[i] for row in rows]) for i in range(3))
    roots = torch.randint(0, 1000, (batch,), generator=torch.Generator().manual_seed(seed))
    trees = select_trees(roots, tokens, scores, parents, num_nodes)
    assert len(trees) == batch
    for b, tree in enumerate(trees):
        expected = select_tree(roots[b], tokens[b], scores[b], parents[b], num_nodes)
        for field in ("tokens", "parents", "depths", "ancestor_mask", "retrieve_indices", "scores"):
            got, want = getattr(tree, field), getattr(expected, field)
            assert got.dtype == want.dtype and torch.equal(got, want), (b, field, got, want)


@pytest.mark.parametrize("size", [1, 2, 5, 12])
def test_trees_from_parents_equals_tree_from_parents_per_row(size):
    """Any shapes of trees (chains, stars, mixed depths in one batch) come out of a batch of them as each comes out
    alone: the rows of the batched construction do not leak into each other."""
    gen = torch.Generator().manual_seed(size)
    parents = torch.tensor([[-1] + [int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, size)]
                            for _ in range(5)] + [[-1] + list(range(size - 1)), [-1] + [0] * (size - 1)])
    tokens = torch.randint(0, 100, parents.shape, generator=gen)
    scores = -torch.rand(parents.shape, generator=gen)
    for b, tree in enumerate(trees_from_parents(tokens, parents, scores)):
        expected = tree_from_parents(tokens[b], parents[b], scores[b])
        for field in ("tokens", "parents", "depths", "ancestor_mask", "retrieve_indices", "scores"):
            got, want = getattr(tree, field), getattr(expected, field)
            assert got.dtype == want.dtype and torch.equal(got, want), (b, field, got, want)


@pytest.mark.parametrize("size", [1, 2, 4, 12, 32])
def test_small_trees_built_from_python_lists_equal_the_tensor_construction(size):
    """Small CPU trees (the embedded pair's) derive their structure from Python lists: every field equals the
    tensor construction's (values, dtype, shape), for chains, stars and random shapes."""
    from eagle.model.drafting import tree as trees

    assert size <= trees.SMALL_TREE_NODES
    gen = torch.Generator().manual_seed(size)
    parents = torch.tensor([[-1] + [int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, size)]
                            for _ in range(6)] + [[-1] + list(range(size - 1)), [-1] + [0] * (size - 1)])
    tokens = torch.randint(0, 100, parents.shape, generator=gen)
    scores = -torch.rand(parents.shape, generator=gen)
    small = trees._small_trees_from_parents(tokens, parents, scores)
    assert small is not None
    for got_tree, want_tree in zip(small, trees._tensor_trees_from_parents(tokens, parents, scores), strict=True):
        for field in ("tokens", "parents", "depths", "ancestor_mask", "retrieve_indices", "scores"):
            got, want = getattr(got_tree, field), getattr(want_tree, field)
            assert got.dtype == want.dtype and torch.equal(got, want), (field, got, want)
    if size > 1:  # a parent after its node: left to the tensor construction
        assert trees._small_trees_from_parents(tokens[:1], torch.tensor([[-1, size - 1] + [0] * (size - 2)]),
                                               scores[:1]) is None


def test_spec_worked_example():
    """EAGLE_SPEC section 5: K=3, D=2, N=6, best flat indices [0,1,2,3,4,6]."""
    parents = torch.tensor([-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2])
    scores = torch.tensor([-1.0, -1.1, -1.2, -2.0, -2.1, -9.0, -2.2, -9.0, -9.0, -9.0, -9.0, -9.0])
    tree = select_tree(torch.tensor(0), torch.arange(12) + 100, scores, parents, 6)
    assert tree.parents.tolist() == [-1, 0, 0, 0, 1, 1, 2]
    assert tree.depths.tolist() == [0, 1, 1, 1, 2, 2, 2]
    assert tree.retrieve_indices.tolist() == [[0, 3, -1], [0, 1, 4], [0, 1, 5], [0, 2, 6]]


def test_tree_from_parents_chain():
    tree = tree_from_parents(torch.arange(4), torch.tensor([-1, 0, 1, 2]), torch.zeros(4))
    assert tree.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    assert torch.equal(tree.ancestor_mask, torch.ones(4, 4, dtype=torch.bool).tril())


def test_likeliest_subtree_is_the_node_then_its_best_descendants():
    #        0
    #      /   \
    #     1     2
    #    / \    |
    #   3   4   5
    #   |
    #   6
    tree = tree_from_parents(torch.arange(7), torch.tensor([-1, 0, 0, 1, 1, 2, 3]),
                             torch.tensor([0.0, -1.0, -2.0, -3.0, -1.5, -2.5, -9.0]))
    assert likeliest_subtree(tree, 1, 8) == [1, 4, 3, 6]
    assert likeliest_subtree(tree, 1, 3) == [1, 4, 3]  # capped, the best first
    assert likeliest_subtree(tree, 2, 8) == [2, 5]
    assert likeliest_subtree(tree, 6, 8) == [6]  # a leaf


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("limit", [1, 3, 8])
def test_likeliest_root_subtrees_equals_likeliest_subtree_per_row(seed, limit):
    """The roots' likeliest subtrees ranked for a whole batch at once (trees of different sizes, tied scores) are
    each row's own."""
    gen = torch.Generator().manual_seed(seed)
    trees = []
    for _ in range(6):
        size = int(torch.randint(1, 12, (1,), generator=gen))
        parents = torch.tensor([-1] + [int(torch.randint(0, node, (1,), generator=gen)) for node in range(1, size)])
        scores = torch.cat([torch.zeros(1), -torch.randint(1, 4, (size - 1,), generator=gen).float()])
        trees.append(tree_from_parents(torch.arange(size), parents, scores))
    for batch in (trees, [trees[0]] * 3):
        assert likeliest_root_subtrees(batch, limit) == [likeliest_subtree(tree, 0, limit) for tree in batch]


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree-target")
    model = make_target(root / "base", "qwen3", seed=11)
    make_head(root / "head", model, eagle3=True, seed=12)
    return model, root


def test_tree_attention_equals_path_forward(tiny_target):
    """Each tree node's logits equal a plain causal forward over prefix + its root-to-node path."""
    model, _ = tiny_target
    target = Target(model, feature_layers=None)
    torch.manual_seed(0)
    prefix = torch.randint(6, 128, (1, 9))
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 3, 3, 6])
    tree = tree_from_parents(torch.randint(6, 128, (9,)), parents, torch.zeros(9))
    cache = target.new_cache(64)
    target.prefill(prefix, cache, logits_to_keep=0)
    logits, _ = verify_tree(target, tree, cache)
    for node in range(tree.size):
        path = [n for n in range(tree.size) if tree.ancestor_mask[node, n]]
        sequence = torch.cat([prefix[0], tree.tokens[path]])[None]
        with torch.no_grad():
            expected = model(sequence).logits[0, -1]
        torch.testing.assert_close(logits[node], expected, atol=1e-4, rtol=1e-4)


def test_cache_keeps_accepted_path(tiny_target):
    """After verification and compaction, the cache equals that of a plain forward over the accepted tokens."""
    model, _ = tiny_target
    target = Target(model, feature_layers=None)
    prefix = torch.randint(6, 128, (1, 7))
    tree = tree_from_parents(torch.randint(6, 128, (6,)), torch.tensor([-1, 0, 0, 2, 2, 4]), torch.zeros(6))
    cache = target.new_cache(32)
    target.prefill(prefix, cache, logits_to_keep=0)
    verify_tree(target, tree, cache)
    path = torch.tensor([0, 2, 4, 5])
    cache.keep_path(path + 7, 7)
    reference = target.new_cache(32)
    target.prefill(torch.cat([prefix[0], tree.tokens[path]])[None], reference, logits_to_keep=0)
    assert cache.length == reference.length == 11
    for mine, theirs in zip(cache.layers, reference.layers):
        torch.testing.assert_close(mine.keys[:, :, :11], theirs.keys[:, :, :11], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.values[:, :, :11], theirs.values[:, :, :11], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keeping_a_path_moves_every_layers_entries_as_the_layer_by_layer_copy(dtype):
    from eagle import kernels
    from eagle.model.base.kv_cache import TreeKVCache

    if not kernels.available():
        pytest.skip("eagle's native kernels are not built here")
    torch.manual_seed(0)
    native, layered = TreeKVCache(3, 24), TreeKVCache(3, 24)
    for a, b in zip(native.layers, layered.layers):
        keys, values = torch.randn(2, 3, 15, 8).to(dtype), torch.randn(2, 3, 15, 8).to(dtype)
        a.update(keys, values)
        b.update(keys.clone(), values.clone())
    path = torch.tensor([9, 10, 12, 14])  # the root stays, one node moves by one slot, one by two
    native.keep_path(path, 9)
    for layer in layered.layers:
        layer.keep(path, 9)
    assert native.length == layered.length == 13
    for a, b in zip(native.layers, layered.layers):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    keys = native.layers[0].keys
    for positions, start, message in [([11, 10], 9, "ascend strictly"), ([8], 9, "ascend strictly"),
                                      ([9, 30], 9, "past the tensor's 24 slots")]:
        with pytest.raises(ValueError, match=message):
            kernels.ops().keep_slots([keys], positions, start)
    with pytest.raises(ValueError, match="contiguous 4-D"):
        kernels.ops().keep_slots([keys.transpose(1, 2)], [9], 9)


def test_greedy_verification_picks_longest_matching_path():
    tokens = torch.tensor([10, 11, 12, 13, 14, 15])
    tree = tree_from_parents(tokens, torch.tensor([-1, 0, 0, 1, 2, 4]), torch.zeros(6))
    logits = torch.full((6, 20), -5.0)
    # target wants: after root -> 12, after node2 (12) -> 14, after node4 (14) -> 3 (not 15), after node1 -> 13
    for node, token in [(0, 12), (2, 14), (4, 3), (1, 13), (3, 0), (5, 0)]:
        logits[node, token] = 5.0
    path, bonus = accept_greedy(tree, logits)
    assert path.tolist() == [0, 2, 4] and int(bonus) == 3


def test_drafter_expansion_matches_explicit_chains(tiny_target):
    """Every drafted node's score is its parent's score plus the log-prob that a plain causal head forward over
    (committed context, then the parent's chain fed back one pair at a time) gives it: the tree attention and
    the expansion KV of the drafter are exact."""
    model, root = tiny_target
    head = load_ea_layer(str(root / "head"), model, True,  # full vocabulary: draft id = token
                         draft_dtype=torch.float32)  # exact arithmetic to compare with
    target = Target(model, feature_layers=eagle3_layer_ids(model.config.num_hidden_layers))
    prompt = torch.randint(6, 128, (1, 8))
    out = target.prefill(prompt, target.new_cache(64), logits_to_keep=0)
    context_ids = torch.cat([prompt[0, 1:], torch.tensor([17])])[None]
    tree = EagleDrafter(head, TreePlan(TreeSettings(total_token=20, depth=3, top_k=3))).draft(out.features, context_ids)
    assert tree.size == 20 and int(tree.tokens[0]) == 17
    with torch.no_grad():
        for node in range(1, tree.size):
            chain = [n for n in range(tree.size) if tree.ancestor_mask[node, n]]
            hidden_in, ids = head.fc(out.features), context_ids
            hidden_out = head(hidden_in, ids)
            for step in chain[1:-1]:  # feed the parent's chain back, one (hidden, token) pair at a time
                hidden_in = torch.cat([hidden_in, hidden_out[:, -1:]], dim=1)
                ids = torch.cat([ids, tree.tokens[[step]][None]], dim=1)
                hidden_out = head(hidden_in, ids)
            logp = torch.log_softmax(head.compute_logits(hidden_out[:, -1])[0].float(), dim=-1)
            parent = int(tree.parents[node])
            expected = float(tree.scores[parent]) + float(logp[int(tree.tokens[node])])
            assert abs(float(tree.scores[node]) - expected) < 1e-4, (node, chain)
