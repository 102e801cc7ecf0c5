"""Batched generation: every row of a left-padded batch is exactly what its prompt gives alone (greedy: Hugging
Face greedy decoding of that prompt; sampling: the target's distribution), with per-row stops and budgets, and bad
batches refused with a clear error."""

from __future__ import annotations

import pytest
import torch

from eagle.model.ea_model import EaModel
from eagle.model.engine import loop
from eagle.model.engine.commit import Rows, commit_batch
from eagle.model.engine.verify import prefill, verify_trees
from eagle.model.backends import linear as linear_backends
from eagle.model.backends.onednn import PackedLinear, packing_available
from eagle.model.base.kv_cache import TreeKVCache
from eagle.model.drafting.tree import stack_trees, tree_from_parents
from test_sampling import LENGTH, hf_warpers, position_p_values
from tiny_models import FAMILIES, make_head, make_target, train_head_quickly

HEAD_KINDS = {"eagle3-full": (True, None), "eagle3-reduced": (True, 48), "eagle1": (False, None)}
TREES = [(16, 3, 4, 0), (8, 2, 4, 6)]  # total_token, depth, top_k, lookup_tokens (the second grafts lookup chains)
PROMPTS = [[1, 40, 41, 42], [1, 70, 71, 72, 73, 74, 75, 76, 77, 20], [1, 100], [1, 40, 41, 42, 40, 41]]
MAX_NEW = 20


def left_padded(prompts, pad=0):
    """(ids, attention_mask) as a tokenizer with padding_side='left' returns them."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def rows_of(out, width, counts):
    """Each row's new tokens, by the per-row counts that log=True returns."""
    return [out[b, width : width + n].tolist() for b, n in enumerate(counts)]


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    built = {}
    root = tmp_path_factory.mktemp("batch-families")
    for family in FAMILIES:
        model = make_target(root / family, family, seed=3)
        heads = {}
        for kind, (eagle3, vocab) in HEAD_KINDS.items():
            heads[kind] = root / f"{family}-{kind}"
            make_head(heads[kind], model, eagle3=eagle3, draft_vocab_size=vocab, seed=4)
        built[family] = (root / family, heads, model.eval())
    return built


def hf_alone(model, prompts, max_new_tokens=MAX_NEW, **kwargs):
    """Hugging Face greedy decoding of each prompt alone: its new tokens."""
    return [model.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, **kwargs)[0, len(p):]
            .tolist() for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", list(HEAD_KINDS))
def test_each_row_equals_hf_greedy_of_its_prompt_alone(family, kind, family_dirs):
    base, heads, reference = family_dirs[family]
    expected = hf_alone(reference, PROMPTS)
    model = EaModel.from_pretrained(use_eagle3=HEAD_KINDS[kind][0], base_model_path=str(base),
                                    ea_model_path=str(heads[kind]), dtype=torch.float32)
    ids, mask = left_padded(PROMPTS)
    for tree in TREES:
        model.set_tree(*tree)
        out, counts, idx = model.eagenerate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, log=True)
        assert out.shape == (len(PROMPTS), ids.shape[1] + MAX_NEW) and out[:, : ids.shape[1]].tolist() == ids.tolist()
        assert rows_of(out, ids.shape[1], counts) == expected, (family, kind, tree)
        assert len(idx) == len(PROMPTS) and all(0 <= i < MAX_NEW for i in idx)
        hf_style = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW)
        assert hf_style.tolist() == out.tolist()
    plain = model.naivegenerate([torch.tensor(p) for p in PROMPTS], max_new_tokens=MAX_NEW)
    assert plain.tolist() == out.tolist()


def test_rows_stop_at_once_early_and_late_and_finished_rows_leave_the_batch(family_dirs):
    base, heads, reference = family_dirs["llama"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    total_token=8, depth=3, top_k=3, dtype=torch.float32)
    prompts = PROMPTS[:3]
    free = hf_alone(reference, prompts)
    # row 0 stops at its first token, row 1 a few tokens later, row 2 late or at its budget
    early = next(token for i, token in enumerate(free[1][2:], 2)
                 if token not in free[1][:i] + free[2][:12] and token != free[0][0])
    stops = [free[0][0], early]
    expected = hf_alone(reference, prompts, eos_token_id=stops)
    assert len(expected[0]) == 1 and 2 < len(expected[1]) < len(expected[2])
    batch_sizes = []
    model.base_model.get_input_embeddings().register_forward_hook(lambda m, args, out: batch_sizes.append(out.shape[0]))
    ids, mask = left_padded(prompts)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, eos_token_id=stops,
                         pad_token_id=0)
    width = ids.shape[1]
    for row, tokens in enumerate(expected):
        assert out[row, width : width + len(tokens)].tolist() == tokens
        assert out[row, width + len(tokens):].tolist() == [0] * (out.shape[1] - width - len(tokens))
    assert out.shape[1] == width + max(len(t) for t in expected)
    # the finished rows stopped costing work: later forward passes ran fewer rows
    assert batch_sizes[0] == 3 and batch_sizes[1] == 2 and batch_sizes[-1] == 1
    # per-row budgets: max_length cuts the longest prompt's row first
    out, counts, _ = model.eagenerate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, max_length=14, log=True)
    assert counts == [min(MAX_NEW, 14 - len(p)) for p in prompts]
    assert rows_of(out, width, counts) == [t[:n] for t, n in zip(free, counts)]


def test_streaming_and_batch_steps(family_dirs):
    base, heads, _ = family_dirs["qwen2"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    total_token=8, depth=3, top_k=3, lookup_tokens=4)
    ids, mask = left_padded(PROMPTS)
    final, counts, idx = model.eagenerate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, log=True)
    streamed = list(model.ea_generate(ids, attention_mask=mask, max_new_tokens=MAX_NEW))
    widths = [s.shape[1] for s in streamed]
    assert widths[0] == ids.shape[1] + 1 and all(b >= a for a, b in zip(widths, widths[1:]))
    assert streamed[-1].tolist() == final.tolist()
    steps = list(model.generate_batch_steps(ids, attention_mask=mask, max_new_tokens=MAX_NEW))
    assert [len(s.tokens) for s in steps] == [len(PROMPTS)] * len(steps) and all(steps[-1].finished)
    for row in range(len(PROMPTS)):
        tokens = [t for s in steps for t in s.tokens[row].tolist()]
        assert tokens == final[row, ids.shape[1] : ids.shape[1] + counts[row]].tolist()
        active = [s for s in steps if s.tokens[row].numel()]
        assert len(active) - 2 == idx[row]  # idx = draft/verify cycles - 1; the first step is the prefill's
        assert all(s.accepted[row] == s.tokens[row].numel() - 1 for s in active[1:-1])
        first_done = next(i for i, s in enumerate(steps) if s.finished[row])
        assert all(s.finished[row] and not s.tokens[row].numel() for s in steps[first_done + 1:])


def test_a_batch_of_one_is_unchanged(family_dirs):
    base, heads, reference = family_dirs["llama"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    total_token=8, depth=3, top_k=3)
    prompt = torch.tensor([PROMPTS[1]])
    out, new_tokens, idx = model.eagenerate(prompt, max_new_tokens=MAX_NEW, log=True)
    assert isinstance(new_tokens, int) and isinstance(idx, int)
    assert out.tolist() == reference.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False).tolist()
    cycles = len(list(model.generate_steps(prompt, max_new_tokens=MAX_NEW))) - 1
    assert idx == cycles - 1 and new_tokens == MAX_NEW
    assert model.eagenerate(prompt[0], max_new_tokens=MAX_NEW).tolist() == out.tolist()
    assert model.eagenerate([prompt[0]], max_new_tokens=MAX_NEW).tolist() == out.tolist()
    assert model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_NEW).tolist() \
        == out.tolist()


def _ragged_trees(roots, sizes, seeds):
    """One random tree per root, of the given node counts (parents: any earlier node)."""
    trees = []
    for root, size, seed in zip(roots, sizes, seeds):
        generator = torch.Generator().manual_seed(seed)
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)])
        tokens = torch.cat([root.reshape(1), torch.randint(6, 128, (size - 1,), generator=generator)])
        trees.append(tree_from_parents(tokens, parents, torch.zeros(size)))
    return trees


def _prefill_and_verify(target, prompts, sizes):
    """Prefill the left-padded prompts and verify one tree per row of ``sizes`` nodes: (first tokens, prompt
    features of each row's real slots, per row (node logits (n, V), node features (n, F)))."""
    ids, mask = left_padded(prompts)
    pads = (1 - mask).sum(1).tolist()
    cache = target.new_cache(64)
    cache.reset(len(prompts))
    first = prefill(target, ids, cache, None, True, pads)
    roots, features = first.next_tokens[:, -1], first.features
    rows = Rows(list(range(len(prompts))), pads, [ids.shape[1]] * len(prompts))
    trees = stack_trees(_ragged_trees(roots, sizes, seeds=[len(p) for p in prompts]))
    verified = verify_trees(target, trees, cache, rows)
    logits, tree_features = verified.logits, verified.features
    nodes = [(torch.stack([logits.row(b)[i] for i in range(n)]), tree_features[b, :n]) for b, n in enumerate(sizes)]
    return roots, [features[b, pad:] for b, pad in enumerate(pads)], nodes


@pytest.mark.skipif(not packing_available(), reason="this torch build cannot pack weights")
@pytest.mark.parametrize("family", FAMILIES)
def test_padding_rows_are_skipped_and_real_rows_equal_each_row_alone(family, family_dirs, monkeypatch):
    """With packed linear layers, a batch's left-padded prefill and ragged trees compute the linear layers for the
    real rows alone (prompt tokens, tree nodes), and each row's logits and features are what the row gives alone."""
    base, heads, _ = family_dirs[family]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    dtype=torch.float32, pack_cpu_weights=True)
    target, prompts, sizes = model.engine.target, PROMPTS[:3], [9, 2, 4]
    rows_seen = []
    compute = PackedLinear._linear
    monkeypatch.setattr(PackedLinear, "_linear",
                        lambda self, x: rows_seen.append(x[..., 0].numel()) or compute(self, x))
    roots, features, nodes = _prefill_and_verify(target, prompts, sizes)
    # prompts: 4 + 10 + 2 real slots of 3 x 10; trees: 9 + 2 + 4 real nodes of 3 x 9
    assert {16, 15} <= set(rows_seen) and not {30, 27} & set(rows_seen)
    for b, (prompt, size) in enumerate(zip(prompts, sizes)):
        alone_root, alone_features, [(alone_logits, alone_nodes)] = _prefill_and_verify(target, [prompt], [size])
        assert int(alone_root[0]) == int(roots[b])
        torch.testing.assert_close(features[b], alone_features[0], rtol=1e-4, atol=5e-4)  # float32 rounding
        torch.testing.assert_close(nodes[b][0], alone_logits, rtol=1e-4, atol=5e-4)
        torch.testing.assert_close(nodes[b][1], alone_nodes, rtol=1e-4, atol=5e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma", "phi3"])
@pytest.mark.parametrize("pack", [True, False])
def test_ragged_trees_with_lookup_chains_are_lossless(family, pack, family_dirs, monkeypatch):
    """Rows whose trees differ in size (a lookup chain grafted on some rows, no padding filled with candidates)
    verify in one padded forward, and every row is still its prompt's greedy decoding, packed or not."""
    monkeypatch.setattr(linear_backends, "MIN_PADDING_ROWS", 1)  # every padded forward skips its padding rows
    skipping = []
    real_rows = linear_backends.RealRows
    monkeypatch.setattr(linear_backends, "RealRows",
                        lambda shape, index: skipping.append(shape) or real_rows(shape, index))
    sizes = []
    stack = loop.stack_trees
    monkeypatch.setattr(loop, "stack_trees", lambda trees: sizes.append({t.size for t in trees}) or stack(trees))
    base, heads, reference = family_dirs[family]
    prompts = PROMPTS + [[1, 50, 51, 52, 53, 50, 51, 52, 53, 50, 51]]  # a repeating prompt: lookup finds chains
    expected = hf_alone(reference, prompts)
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    dtype=torch.float32, pack_cpu_weights=pack, total_token=6, depth=2, top_k=3,
                                    lookup_tokens=8)
    ids, mask = left_padded(prompts)
    out, counts, _ = model.eagenerate(ids, attention_mask=mask, max_new_tokens=MAX_NEW, log=True)
    assert rows_of(out, ids.shape[1], counts) == expected
    assert any(len(step) > 1 for step in sizes)  # some steps verified trees of different sizes
    assert any(shape[1] > 1 for shape in skipping)  # ... with their padding nodes skipped (when packed)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-trained")
    model = make_target(root / "base", "llama", seed=5)
    make_head(root / "head", model, eagle3=True, seed=6)
    prompts = train_head_quickly(root / "base", root / "head", eagle3=True, steps=150)
    return root / "base", root / "head", model.eval(), prompts


def test_ragged_acceptance_with_a_trained_head_is_lossless(trained):
    """With a head that is really accepted, rows accept different numbers of drafts in the same step, and every row
    is still exactly its prompt's greedy decoding."""
    base, head, reference, fitted = trained
    # different lengths, still what the head was fitted on: fitted prompts, two with their first answer tokens
    answers = hf_alone(reference, fitted[:4].tolist(), max_new_tokens=6)
    prompts = [fitted[0].tolist(), fitted[1].tolist() + answers[1][:3], fitted[2].tolist(),
               fitted[3].tolist() + answers[3]]
    expected = hf_alone(reference, prompts, max_new_tokens=32)
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(head), total_token=12, depth=4,
                                    top_k=3, lookup_tokens=4, dtype=torch.float32)
    ids, mask = left_padded(prompts)
    steps = list(model.generate_batch_steps(ids, attention_mask=mask, max_new_tokens=32))
    got = [[t for s in steps for t in s.tokens[row].tolist()] for row in range(len(prompts))]
    assert got == expected
    ragged = [s for s in steps[1:] if len({a for a, f in zip(s.accepted, s.finished) if not f}) > 1]
    assert sum(sum(s.accepted) for s in steps) > len(steps) and ragged


@pytest.mark.parametrize("family,window", [("mistral", 5)])
def test_sliding_window_rows_see_their_own_window(family, window, tmp_path):
    model = make_target(tmp_path / "base", family, seed=7, sliding_window=window).eval()
    make_head(tmp_path / "head", model, eagle3=True, seed=8)
    eagle = EaModel.from_pretrained(base_model_path=str(tmp_path / "base"), ea_model_path=str(tmp_path / "head"),
                                    total_token=8, depth=2, top_k=3, dtype=torch.float32)
    expected = hf_alone(model, PROMPTS, max_new_tokens=12)
    ids, mask = left_padded(PROMPTS)
    out, counts, _ = eagle.eagenerate(ids, attention_mask=mask, max_new_tokens=12, log=True)
    assert rows_of(out, ids.shape[1], counts) == expected


@pytest.mark.parametrize(
    "inputs,message",
    [
        (lambda: (torch.tensor([[1, 2, 3], [0, 4, 5]]), torch.ones(2, 2)), r"attention_mask has shape \(2, 2\)"),
        (lambda: (torch.tensor([[1, 2, 3], [0, 4, 5]]), torch.tensor([[1, 1, 1], [0, 0, 0]])), "Row 1 .* all zeros"),
        (lambda: (torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])), "right padding or a hole"),
        (lambda: (torch.tensor([[1, 2, 3], [4, 0, 5]]), torch.tensor([[1, 1, 1], [1, 0, 1]])), "right padding or a hole"),
        (lambda: (torch.tensor([[1, 2, 3], [0, 4, 5]]), torch.tensor([[1, 1, 1], [0, 2, 1]])), "0 .padding. and 1"),
        (lambda: ([torch.tensor([1, 2]), torch.tensor([], dtype=torch.long)], None), "Prompt 1 is empty"),
        (lambda: ([torch.ones(30, dtype=torch.long), torch.tensor([1, 2])], None), "of row 0 has 30 tokens.*max_length=20"),
    ],
    ids=["mask-shape", "all-zero-row", "right-padding", "hole", "not-0-1", "empty-prompt", "too-long"],
)
@pytest.mark.parametrize("method", ["eagenerate", "naive_generate", "generate"])
def test_bad_batches_are_refused_and_the_model_stays_usable(family_dirs, inputs, message, method):
    base, heads, _ = family_dirs["llama"]
    model = _usable_model(family_dirs)
    ids, mask = inputs()
    with pytest.raises(ValueError, match=message):
        result = getattr(model, method)(input_ids=ids, attention_mask=mask, max_new_tokens=4, max_length=20)
        if method.endswith("_generate"):
            next(iter(result))
    ids, mask = left_padded(PROMPTS[:2])
    assert model.eagenerate(ids, attention_mask=mask, max_new_tokens=3).shape == (2, ids.shape[1] + 3)


def test_a_batch_whose_cache_does_not_fit_is_refused_before_it_runs(family_dirs, monkeypatch):
    from eagle.model.base import kv_cache

    model = _usable_model(family_dirs)
    ids, mask = left_padded(PROMPTS)
    ran = []
    model.base_model.register_forward_pre_hook(lambda *args: ran.append(1))
    monkeypatch.setattr(kv_cache, "free_memory", lambda device: 1000)
    model.engine.cache = None
    with pytest.raises(ValueError, match="A batch of 4 rows needs a KV cache of .* only 0.00 GiB"):
        model.eagenerate(ids, attention_mask=mask, max_new_tokens=4)
    assert not ran
    monkeypatch.undo()
    assert model.eagenerate(ids, attention_mask=mask, max_new_tokens=3).shape == (4, ids.shape[1] + 3)


_MODELS: dict = {}


def _usable_model(family_dirs) -> EaModel:
    if "llama" not in _MODELS:
        base, heads, _ = family_dirs["llama"]
        _MODELS["llama"] = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                                   total_token=8, depth=3, top_k=3)
    return _MODELS["llama"]


@pytest.fixture(scope="module")
def sampling_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-sampling")
    model = make_target(root / "base", "llama", seed=21, layers=4)
    make_head(root / "head", model, eagle3=True, seed=22)
    prompts = train_head_quickly(root / "base", root / "head", eagle3=True, steps=120)
    eagle = EaModel.from_pretrained(base_model_path=str(root / "base"), ea_model_path=str(root / "head"),
                                    total_token=10, depth=3, top_k=4)
    # different lengths, still what the head was fitted on: two prompts extended by their own greedy answers
    answers = hf_alone(model.eval(), prompts[:3].tolist(), max_new_tokens=5)
    return eagle, model, [prompts[0].tolist(), prompts[1].tolist() + answers[1][:2], prompts[2].tolist() + answers[2]]


@pytest.mark.e2e  # thousands of sampled generations
@pytest.mark.parametrize("options", [dict(temperature=0.8), dict(temperature=0.7, top_k=3)], ids=["temperature", "top-k"])
def test_each_row_of_a_sampled_batch_follows_the_target_distribution(sampling_pair, options):
    """Tokens 1 to LENGTH of every row follow, position by position, the distribution Hugging Face's warpers give
    on a plain forward pass of that row's prompt alone (the chi-square machinery of test_sampling.py)."""
    eagle, reference, prompts = sampling_pair
    runs = 300
    ids, mask = left_padded(prompts)
    samples: list[list[tuple[int, ...]]] = [[] for _ in prompts]
    accepted = 0
    torch.manual_seed(4321)
    for _ in range(runs):
        steps = list(eagle.generate_batch_steps(ids, attention_mask=mask, max_new_tokens=LENGTH, **options))
        accepted += sum(sum(s.accepted) for s in steps)
        for row in range(len(prompts)):
            samples[row].append(tuple(t for s in steps for t in s.tokens[row].tolist()))
    assert accepted > runs * 0.3  # speculation really happened
    for row, prompt in enumerate(prompts):
        p_values = position_p_values(reference, torch.tensor([prompt]), samples[row], hf_warpers(**options))
        assert min(p_values) > 1e-3, (row, p_values)
    # torch.manual_seed reproduces a sampled batch
    again = []
    for _ in range(2):
        torch.manual_seed(5)
        again.append(eagle.eagenerate(ids, attention_mask=mask, temperature=1.0, max_new_tokens=12).tolist())
    assert again[0] == again[1]


@pytest.mark.skipif(not packing_available(), reason="this torch build cannot pack weights")
def test_batch_benchmark_reports_every_method_and_lossless_rows(family_dirs, tmp_path):
    """`python -m eagle.evaluation.benchmark --batch-size ...`: every method per batch size (HF batched generate
    on the packed weights and on the weights as transformers loads them), the rows of the batched EAGLE output equal
    to batch-1 EAGLE's, a report with both HF ratios and a plot."""
    from eagle.evaluation.benchmark import main

    base, heads, _ = family_dirs["llama"]
    results = main(["--batch-size", "1,2", "--base-model-path", str(base), "--ea-model-path", str(heads["eagle3-full"]),
                    "--total-token", "8", "--depth", "2", "--top-k", "3", "--num-questions", "2",
                    "--max-new-tokens", "4", "--warmup", "0", "--output-dir", str(tmp_path),
                    "--pack-cpu-weights", "on"])
    assert sorted(results) == [1, 2]
    for item in results.values():
        assert item["rows"] == 2 and item["rows_equal"] == 2
        assert all(item[m]["tokens"] > 0 and item[m]["tokens_per_s"] > 0 for m in ("eagle_batched", "hf_batched",
                                                                                  "hf_batched_unpacked",
                                                                                  "eagle_sequential"))
    report = (tmp_path / "batch_report.md").read_text()
    assert "EAGLE / HF unpacked" in report and report.count("\n| 2 |") == 1
    assert {p.name for p in tmp_path.iterdir()} >= {"batch_results.json", "batch_report.md", "batch_throughput.png"}


def test_batch_benchmark_refuses_too_few_questions_for_a_batch_before_loading(tmp_path):
    """A batch size larger than --num-questions would time no batch at all (0 tokens/s): refused, naming both."""
    from eagle.evaluation.benchmark import main

    with pytest.raises(SystemExit, match="--num-questions 4 cannot fill a batch of 8"):
        main(["--batch-size", "1,8", "--num-questions", "4", "--base-model-path", str(tmp_path / "missing"),
              "--output-dir", str(tmp_path)])


@pytest.mark.skipif(not packing_available(), reason="this torch build cannot pack weights")
def test_batch_benchmark_unpacked_hf_runs_unpacked_and_repacks(family_dirs):
    """`hf_batched_unpacked` times HF generate on the layers as transformers loads them and leaves the engine's
    packed layers as they were; without packed layers it is not offered (hf_batched already is that)."""
    from eagle.evaluation import batch_benchmark
    from eagle.model.backends.onednn import packed_layer_count

    base, heads, _ = family_dirs["llama"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    dtype=torch.float32, pack_cpu_weights=True)
    packed = packed_layer_count(model.base_model)
    assert packed > 0 and "hf_batched_unpacked" in batch_benchmark.methods_for(model)
    seen = []
    original = model.base_model.generate

    def spy(*args, **kwargs):
        seen.append(packed_layer_count(model.base_model))
        return original(*args, **kwargs)

    model.base_model.generate = spy
    ids, mask = batch_benchmark.left_pad([[5, 6, 7], [8, 9]], 0)
    rows, seconds = batch_benchmark.run_method("hf_batched_unpacked", model, ids, mask, 3, [1])
    assert seen == [0] and len(rows) == 2 and seconds > 0
    assert packed_layer_count(model.base_model) == packed
    with pytest.raises(ValueError, match="Unknown method"):
        batch_benchmark.run_method("hf_unbatched", model, ids, mask, 3, [1])
    unpacked = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                       dtype=torch.float32, pack_cpu_weights=False)
    assert "hf_batched_unpacked" not in batch_benchmark.methods_for(unpacked)


@pytest.mark.parametrize("seed", range(8))
def test_commit_batch_moves_each_accepted_path_after_its_rows_committed_tokens(seed):
    """After a verification, row b's entries (every layer, keys and values) at its committed length onwards are
    those of its accepted nodes, in path order, and its committed entries are untouched: rows behind the batch's
    slot end, rows already in place (plain decoding's root, or nodes 0, 1, ...), rows of ragged paths."""
    gen = torch.Generator().manual_seed(seed)
    batch, tree_size, slots, layers = 6, 5, 20, 3
    cache = TreeKVCache(layers, 40)
    for layer in cache.layers:
        layer.lazy_initialization(torch.zeros(batch, 2, 1, 4), torch.zeros(batch, 2, 1, 4))
        layer.keys.normal_(generator=gen)
        layer.values.normal_(generator=gen)
        layer.length = slots + tree_size
    lengths = [slots - int(torch.randint(0, 3, (1,), generator=gen)) * (seed % 2) for _ in range(batch)]
    paths = []
    for b in range(batch):
        count = int(torch.randint(1, tree_size + 1, (1,), generator=gen))
        rest = (torch.randperm(tree_size - 1, generator=gen)[: count - 1].sort().values + 1).tolist()
        paths.append(torch.tensor([0] + (list(range(1, count)) if b % 3 == 0 else rest)))
    before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
    rows = Rows(list(range(batch)), [0] * batch, list(lengths))
    commit_batch(cache, rows, paths, tree_size)
    assert rows.length == [n + p.numel() for n, p in zip(lengths, paths)]
    assert cache.length == max(rows.length)
    for layer, old in zip(cache.layers, before):
        for new, old_tensor in zip((layer.keys, layer.values), old):
            for b, (n, path) in enumerate(zip(lengths, paths)):
                assert torch.equal(new[b, :, :n], old_tensor[b, :, :n])
                assert torch.equal(new[b, :, n : n + path.numel()], old_tensor[b, :, slots + path])
