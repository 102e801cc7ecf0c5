"""Continuous batching (``EaModel.continuous_batch``): prompts join a running batch between steps and rows leave
when cancelled; every row is still exactly what its prompt gives alone (greedy: Hugging Face greedy decoding of
that prompt; sampling: the target's distribution), each with its own budget."""

from __future__ import annotations

import pytest
import torch

from eagle.model.ea_model import EaModel
from test_sampling import LENGTH, hf_warpers, position_p_values
from tiny_models import make_head, make_target, train_head_quickly

PROMPTS = [[1, 40, 41, 42], [1, 70, 71, 72, 73, 74, 75, 76, 77, 20], [1, 100], [1, 40, 41, 42, 40, 41]]


def hf_alone(model, prompt, max_new_tokens):
    return model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)[0, len(prompt):] \
        .tolist()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny Llama target, an EAGLE-3 head fitted to it (drafts really accepted, ragged across rows) and a random
    EAGLE-1 head."""
    root = tmp_path_factory.mktemp("continuous")
    reference = make_target(root / "base", "llama", seed=5)
    make_head(root / "eagle3", reference, eagle3=True, seed=6)
    make_head(root / "eagle1", reference, eagle3=False, seed=7)
    fitted = train_head_quickly(root / "base", root / "eagle3", eagle3=True, steps=150)
    models = {kind: EaModel.from_pretrained(use_eagle3=kind == "eagle3", base_model_path=str(root / "base"),
                                            ea_model_path=str(root / kind), total_token=12, depth=4, top_k=3,
                                            lookup_tokens=4, dtype=torch.float32) for kind in ("eagle3", "eagle1")}
    return models, reference.eval(), [p.tolist() for p in fitted[:2]] + PROMPTS


def drive(batch, joins: dict[int, list[tuple[list[int], int]]], cancels: dict[int, list[int]] | None = None):
    """Iterate ``batch``; before step i's successor, add the prompts ``joins[i]`` ((prompt, max_new_tokens); step
    -1: before the first) and cancel the rows ``cancels[i]`` (in the order added). Returns each row's tokens, the
    steps each row was computed in, and the rows that finished (a cancelled row's notice, ``finish_reason
    "cancelled"`` with no tokens in the step after its cancellation, is checked here and not counted as either)."""
    cancels = cancels or {}
    asked_to_cancel: set[int] = set()
    order: list[int] = []
    for prompt, budget in joins.get(-1, []):
        order += batch.add(torch.tensor(prompt), max_new_tokens=budget)
    tokens: dict[int, list[int]] = {row: [] for row in order}
    seen: dict[int, list[int]] = {row: [] for row in order}
    finished: set[int] = set()
    cancelled: set[int] = set()
    for i, step in enumerate(batch):
        for row, part in step.items():
            assert row not in finished | cancelled, "a row appeared after its last step"
            if part.finish_reason == "cancelled":
                assert part.tokens.numel() == 0 and row in asked_to_cancel, "a row reported cancelled unasked"
                cancelled.add(row)
                continue
            tokens[row] += part.tokens.tolist()
            seen[row].append(i)
            if part.finished:
                finished.add(row)
        for prompt, budget in joins.get(i, []):
            (row,) = batch.add(torch.tensor(prompt), max_new_tokens=budget)
            order.append(row)
            tokens[row], seen[row] = [], []
        for index in cancels.get(i, []):
            batch.cancel(order[index])
            if order[index] not in finished:
                asked_to_cancel.add(order[index])
    assert cancelled == asked_to_cancel, "every cancelled row is reported cancelled, once"
    return [tokens[row] for row in order], [seen[row] for row in order], finished


@pytest.mark.parametrize("kind,use_eagle", [("eagle3", True), ("eagle1", True), ("eagle3", False)],
                         ids=["eagle3", "eagle1", "plain"])
def test_rows_joining_at_different_steps_equal_their_greedy_answers_alone(pair, kind, use_eagle):
    models, reference, prompts = pair
    model = models[kind]
    # budgets of their own: a long row that others join, rows joining after the prefill step and later, two at once
    schedule = {-1: [(prompts[0], 30)], 0: [(prompts[1], 20)], 2: [(prompts[2], 12), (prompts[3], 25)],
                5: [(prompts[4], 3)], 6: [(prompts[5], 18)]}
    batch_rows = []
    hook = model.base_model.get_input_embeddings().register_forward_hook(
        lambda m, args, out: batch_rows.append(out.shape[0]))
    try:
        got, seen, finished = drive(model.continuous_batch(use_eagle=use_eagle), schedule)
    finally:
        hook.remove()
    joined = [item for step in sorted(schedule) for item in schedule[step]]
    expected = [hf_alone(reference, prompt, budget) for prompt, budget in joined]
    assert got == expected
    assert [len(tokens) for tokens in got] == [budget for _, budget in joined]  # each row ended at its own budget
    assert len(finished) == len(joined)
    assert seen[1][0] == 1 and seen[2][0] == seen[3][0] == 3  # joined at the next step boundary, two together
    assert max(batch_rows) >= 4 and batch_rows[:4] == [1, 1, 2, 2]  # prefills of row 0 and 1, both, rows 2 and 3


def test_cancelled_rows_leave_at_the_next_step_and_the_others_are_unchanged(pair):
    models, reference, prompts = pair
    model = models["eagle3"]
    schedule = {-1: [(prompts[0], 30), (prompts[1], 30), (prompts[2], 30)], 1: [(prompts[3], 24)]}
    batch_rows = []
    hook = model.base_model.get_input_embeddings().register_forward_hook(
        lambda m, args, out: batch_rows.append(out.shape[0]))
    try:
        got, seen, finished = drive(model.continuous_batch(), schedule, cancels={1: [1], 3: [3, 0]})
    finally:
        hook.remove()
    joined = [item for step in sorted(schedule) for item in schedule[step]]
    expected = [hf_alone(reference, prompt, budget) for prompt, budget in joined]
    assert got[2] == expected[2]  # never cancelled: its whole answer
    for row in (0, 1, 3):  # cancelled: a prefix of its answer, nothing after the cancellation
        assert got[row] == expected[row][: len(got[row])] and len(got[row]) < len(expected[row])
    assert seen[1][-1] == 1 and seen[3][-1] == seen[0][-1] == 3
    assert finished == {2}
    # rows 0..2 prefilled; verify 3; row 1 leaves, row 3 joins: verify 3; then 2 rows; then row 2 alone
    assert batch_rows[:4] == [3, 3, 1, 3] and batch_rows[-1] == 1


def test_a_bad_prompt_is_refused_and_the_batch_goes_on(pair):
    models, reference, prompts = pair
    batch = models["eagle3"].continuous_batch(max_length=40)
    (first,) = batch.add(torch.tensor(prompts[2]), max_new_tokens=10)
    tokens = []
    for i, step in enumerate(batch):
        tokens += step[first].tokens.tolist()
        if i == 1:
            with pytest.raises(ValueError, match="has 50 tokens, which does not fit max_length=40"):
                batch.add(torch.ones(50, dtype=torch.long), max_new_tokens=4)
            with pytest.raises(ValueError, match="temperature"):
                models["eagle3"].continuous_batch(temperature=-1).add(torch.tensor(prompts[2]))
    assert tokens == hf_alone(reference, prompts[2], 10)
    # the batch ended; a row added now starts it again
    (row,) = batch.add(torch.tensor(prompts[3]), max_new_tokens=6)
    assert [t for step in batch for t in step[row].tokens.tolist()] == hf_alone(reference, prompts[3], 6)


@pytest.mark.e2e  # thousands of sampled generations
def test_a_row_that_joins_a_sampled_batch_follows_the_target_distribution(pair):
    """The row that joins at the second step boundary (and the row it joins) sample tokens 1 to LENGTH from the
    distribution Hugging Face's warpers give on its prompt alone (test_sampling's chi-square)."""
    models, reference, prompts = pair
    model = models["eagle3"]
    runs, options = 300, dict(temperature=0.8, top_k=8)
    samples: list[list[tuple[int, ...]]] = [[], []]
    accepted = 0
    torch.manual_seed(2024)
    for _ in range(runs):
        batch = model.continuous_batch(**options)
        (first,) = batch.add(torch.tensor(prompts[0]), max_new_tokens=LENGTH + 6)
        rows, tokens = [first], {first: []}
        for i, step in enumerate(batch):
            for row, part in step.items():
                tokens[row] += part.tokens.tolist()
                accepted += part.accepted
            if i == 1:
                rows += batch.add(torch.tensor(prompts[1]), max_new_tokens=LENGTH)
                tokens[rows[1]] = []
        samples[0].append(tuple(tokens[first][:LENGTH]))
        samples[1].append(tuple(tokens[rows[1]]))
    assert accepted > runs  # speculation really happened
    for row in range(2):
        p_values = position_p_values(reference, torch.tensor([prompts[row]]), samples[row], hf_warpers(**options))
        assert min(p_values) > 1e-3, (row, p_values)


def test_a_batch_that_rows_keep_joining_stays_as_long_as_its_rows(pair):
    """80 requests through one running batch, a new one joining whenever one ends: every answer is its greedy answer
    alone, and neither the target's cache nor the head's grows with the number of requests served."""
    models, reference, prompts = pair
    batch = models["eagle3"].continuous_batch()
    jobs = [(prompts[i % len(prompts)], 6 + i % 5) for i in range(80)]
    expected = {job: hf_alone(reference, job[0], job[1]) for job in set(map(lambda j: (tuple(j[0]), j[1]), jobs))}
    rows = {}
    for job in jobs[:3]:
        rows[batch.add(torch.tensor(job[0]), max_new_tokens=job[1])[0]] = [job, []]
    waiting, served, slots = jobs[3:], [], []
    for step in batch:
        for row, part in step.items():
            rows[row][1] += part.tokens.tolist()
            if part.finished:
                job, tokens = rows.pop(row)
                served.append(tokens == expected[(tuple(job[0]), job[1])])
                if waiting:
                    job = waiting.pop(0)
                    rows[batch.add(torch.tensor(job[0]), max_new_tokens=job[1])[0]] = [job, []]
        running = batch._running  # the engine's state, to check its size
        head_drafter = getattr(running.drafter, "inner", running.drafter)  # under its prompt-lookup branch
        slots.append((running.cache.length, head_drafter.committed_length))
    assert len(served) == 80 and all(served)
    longest = max(len(p) for p in prompts) + 10 + models["eagle3"].tree_settings.max_tree_size
    assert max(target for target, _ in slots) <= longest
    assert max(head for _, head in slots) <= 2 * longest + 64
