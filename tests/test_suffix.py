"""Suffix decoding (``"suffix"``, ``"X+suffix"``): what the index finds, the trees it proposes, the store's bound,
and that generation with it stays lossless (greedy and sampling, batches, continuous batching) while really
accepting several tokens per step on text that repeats its prompt."""

from __future__ import annotations

import pytest
import torch

from chat_helpers import chat_template_ids
from eagle.model.drafting.none import NoDrafter
from eagle.model.drafting.protocol import DraftContext
from eagle.model.drafting.registry import build_drafter
from eagle.model.drafting.settings import TreePlan
from eagle.model.drafting.suffix import SuffixDrafter, SuffixIndex, SuffixStore, graft_trie
from eagle.model.drafting.tree import tree_from_parents
from eagle.model.ea_model import EaModel
from test_engine_seams import _run
from test_lookup import pair  # noqa: F401  (the fixture: a tiny target whose greedy text repeats)
from test_sampling import LENGTH, hf_warpers, position_p_values


def _children(tree, node):
    return {token: child for child, (parent, token) in enumerate(zip(tree.parents.tolist(), tree.tokens.tolist()))
            if parent == node}


def test_the_tree_holds_the_continuations_of_the_longest_match_most_frequent_first():
    # "1 2 3" occurred three times (preceded by 10, 11, 12: the longest match is those 3 tokens), followed by 4
    # twice and by 5 once
    sequence = [10, 1, 2, 3, 4, 11, 1, 2, 3, 4, 12, 1, 2, 3, 5, 13, 1, 2, 3]
    drafter = SuffixDrafter(NoDrafter(), lambda batch_size: 24)
    drafter.reset(1)
    tree = drafter.draft(None, torch.tensor([sequence]))
    assert tree.tokens[0] == 3
    first = _children(tree, 0)
    assert set(first) == {4, 5}
    assert tree.scores[first[4]] > tree.scores[first[5]]  # 2 of 3 occurrences against 1 of 3
    assert set(_children(tree, first[4])) == {11, 12} and set(_children(tree, first[5])) == {13}
    assert tree.size == 1 + 2 * 3  # two nodes per matched token


def test_a_longer_match_wins_and_earns_a_larger_tree_and_no_match_proposes_the_root_alone():
    index = SuffixIndex()
    index.extend([7, 8, 9, 1, 2, 3, 4, 5, 6, 20, 21, 3, 4, 5, 6, 30, 3, 4, 5, 6])
    length, starts = index.occurrences(index.tokens, own=True)
    assert (length, [index.continuation(start, 3) for start in starts]) == (4, [[30, 3, 4], [20, 21, 3]])
    drafter = SuffixDrafter(NoDrafter(), lambda batch_size: 24)
    drafter.reset(2)
    trees = drafter.draft_batch(None, torch.tensor([[1, 2, 3, 4, 5, 6, 40, 41, 42, 4, 5, 6],
                                                    [1, 2, 3, 4, 5, 6, 40, 41, 42, 43, 44, 45]]))
    assert trees[0].tokens.tolist()[:2] == [6, 40] and trees[0].size == 1 + 2 * 3
    assert trees[1].size == 1  # nothing repeats: plain decoding, no tree
    assert SuffixIndex().occurrences([1, 2], own=False) == (0, [])


def test_the_suffix_tree_merges_into_another_drafters_tree():
    tree = tree_from_parents(torch.tensor([10, 11, 12]), torch.tensor([-1, 0, 0]), torch.tensor([0.0, -0.1, -0.5]))
    merged = graft_trie(tree, [11, 13, 14], [-1, 0, -1], [0.0, 0.0, -1.0])
    assert merged.tokens.tolist() == [10, 11, 12, 13, 14] and merged.parents.tolist() == [-1, 0, 0, 1, 0]
    assert merged.scores[3] < merged.scores[1] and merged.scores[4] < merged.scores[2]
    assert graft_trie(tree, [12], [-1], [0.0]) is tree


def test_the_store_stays_under_its_bound_and_forgets_the_oldest_outputs_first():
    store = SuffixStore(max_tokens=100)
    for i in range(40):
        store.add([1000 + i, 1, 2, 3, 2000 + i, 5, 6])
        assert len(store) <= 100
    index = store.index
    positions = [p for lists in (index.unigrams, index.grams) for ps in lists.values() for p in ps]
    assert min(positions) >= index.base and max(positions) < index.base + len(index)
    assert store.occurrences([1039, 1, 2], 2) == (3, [[3, 2039]])  # the newest output is there
    assert store.occurrences([1000, 1], 2) == (0, []) and 1000 not in index.unigrams  # the oldest one was evicted
    length, continuations = store.occurrences([9, 1, 2, 3], 1)
    assert length == 3 and continuations[0] == [2039]  # newest first
    store.add(list(range(500)))  # longer than the bound: its last tokens are kept
    assert len(store) <= 100 and store.occurrences([497, 498], 1) == (2, [[499]])
    store.clear()
    assert len(store) == 0
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixStore(max_tokens=1)


def test_the_registry_builds_suffix_alone_and_around_another_drafter():
    store = SuffixStore()
    alone = build_drafter("suffix", DraftContext(None, TreePlan(), store))
    assert isinstance(alone, SuffixDrafter) and isinstance(alone.inner, NoDrafter) and alone.store is store
    assert alone.max_nodes(1) == 1 + 24 and alone.max_nodes(8) == 1 + 24
    assert isinstance(build_drafter("none+suffix", DraftContext(None, TreePlan())), SuffixDrafter)


PROMPTS = [[1, 30, 31, 32, 33, 30, 31, 32, 33, 30], [1, 70, 71, 72, 73, 74, 75, 76, 77, 20], [1, 100]]


@pytest.fixture(scope="module")
def repeating(pair):  # noqa: F811
    base, head, reference = pair
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=3, depth=0,
                                    top_k=2, dtype=torch.float32)
    return model, reference


@pytest.mark.parametrize("drafter", ["suffix", "eagle3+suffix"])
def test_greedy_output_equals_plain_decoding_alone_and_in_batches(repeating, drafter):
    model, reference = repeating
    expected = [reference.generate(torch.tensor([p]), max_new_tokens=40, do_sample=False)[0, len(p):].tolist()
                for p in PROMPTS]
    for prompt, want in zip(PROMPTS, expected):
        rows, steps = _run(model, [prompt], drafter, max_new_tokens=40)
        assert rows[0] == want
    rows, steps = _run(model, PROMPTS, drafter, max_new_tokens=40)  # rows of different lengths
    assert rows == expected
    assert len(steps) < 30, "suffix drafts were never accepted on text that repeats"


def test_rows_joining_a_running_batch_keep_their_greedy_output(repeating):
    model, reference = repeating
    batch = model.engine.open_batch(drafter="eagle3+suffix")
    rows = batch.add(torch.tensor(PROMPTS[0]), max_new_tokens=30)
    got: dict[int, list[int]] = {rows[0]: []}
    for i, step in enumerate(batch):
        for row, part in step.items():
            got[row] += part.tokens.tolist()
        if i in (2, 5):
            (row,) = batch.add(torch.tensor(PROMPTS[1 if i == 2 else 2]), max_new_tokens=30)
            got[row] = []
    for row, prompt in zip(sorted(got), PROMPTS):
        want = reference.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False)[0, len(prompt):]
        assert got[row] == want.tolist()


def test_sampling_with_suffix_trees_keeps_the_targets_distribution(repeating):
    """A store filled with the target's own samples after the prompt's last tokens: branching trees, often right,
    from the first step; the samples still follow the target's distribution (chi-square, as test_sampling)."""
    model, reference = repeating
    prompt = torch.tensor([[1, 50, 60, 70, 80]])
    store = SuffixStore()
    torch.manual_seed(7)
    for _ in range(40):
        sample = reference.generate(prompt, max_new_tokens=8, do_sample=True, temperature=0.8, top_k=0)[0]
        store.add(prompt[0, -3:].tolist() + sample[prompt.shape[1]:].tolist())
    model.engine.suffix_store = store
    samples, accepted = [], 0
    try:
        torch.manual_seed(1234)
        for _ in range(300):
            rows, steps = _run(model, prompt, "suffix", max_new_tokens=LENGTH, temperature=0.8)
            samples.append(tuple(rows[0]))
            accepted += sum(s.accepted[0] for s in steps)
    finally:
        model.engine.suffix_store = SuffixStore()
    assert accepted > 0.3 * 300, accepted
    assert min(position_p_values(reference, prompt, samples, hf_warpers(0.8))) > 1e-3


@pytest.fixture(scope="module")
def default_model():
    from eagle.cli import load_default_model

    return load_default_model()


def test_a_rewrite_prompt_accepts_several_tokens_per_step_on_the_embedded_pair(default_model):
    from eagle.evaluation.questions import load_questions

    question = next(q for q in load_questions("rewrite") if q["turns"][0].startswith("Copy this paragraph"))
    ids = chat_template_ids(default_model, question["turns"][0])
    plain, _ = _run(default_model, ids, "none", max_new_tokens=80)
    taus = {}
    for drafter in ("suffix", "eagle3", "eagle3+suffix"):
        default_model.engine.suffix_store.clear()  # the row's own text only
        rows, steps = _run(default_model, ids, drafter, max_new_tokens=80)
        assert rows == plain, drafter
        taus[drafter] = len(rows[0]) / (len(steps) - 1)  # tokens per verification step (the first is the prefill's)
    assert taus["suffix"] > 1.5 and taus["eagle3+suffix"] > taus["eagle3"], taus


def test_a_repeated_request_drafts_from_the_earlier_output_in_the_store(default_model):
    ids = chat_template_ids(default_model, "Write a short poem about a lighthouse keeper.")
    store = default_model.engine.suffix_store
    store.clear()
    first, first_steps = _run(default_model, ids, "suffix", max_new_tokens=60)
    assert len(store) > 0  # the finished request's output went to the model's store
    second, second_steps = _run(default_model, ids, "suffix", max_new_tokens=60)
    assert second == first and len(second_steps) < len(first_steps) / 2


def test_the_rewrite_questions_are_found_by_name_and_ship_with_the_package():
    import fnmatch
    import re
    from pathlib import Path

    from eagle.evaluation.questions import load_questions, question_file_for

    questions = load_questions("rewrite")
    assert len(questions) >= 20 and len({q["question_id"] for q in questions}) == len(questions)
    assert all(len(q["turns"]) == 1 and q["category"] for q in questions)
    path = Path(question_file_for("rewrite")).resolve()
    package = Path(__file__).resolve().parents[1] / "eagle"
    patterns = re.findall(r'"([^"]+)"', (package.parent / "setup.py").read_text().split("package_data=", 1)[1]
                          .split("}", 1)[0])
    assert any(fnmatch.fnmatch(str(path.relative_to(package)), pattern) for pattern in patterns)
    with pytest.raises(FileNotFoundError, match="'mt_bench', 'rewrite'"):
        question_file_for("rewrites")
