"""Greedy losslessness: EAGLE output equals Hugging Face `generate(do_sample=False)` token for token, for every
tested family, head kind and tree setting; and with heads that are really accepted."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle.model.ea_model import EaModel
from tiny_models import FAMILIES, make_head, make_target, train_head_quickly

HEAD_KINDS = {"eagle3-full": (True, None), "eagle3-reduced": (True, 48), "eagle1": (False, None)}
TREES = [(16, 3, 4, 0), (7, 5, 2, 0), (8, 2, 4, 6)]  # total_token, depth, top_k, lookup_tokens
PROMPTS = [[1, 40, 41, 42], [1, 70, 71, 72, 73, 74, 75, 76, 77, 20], [1, 100]]
MAX_NEW = 24


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """family -> (base_dir, {head kind: head_dir}), built once per module."""
    built = {}
    root = tmp_path_factory.mktemp("families")
    for family in FAMILIES:
        base = root / family
        model = make_target(base, family, seed=3)
        heads = {}
        for kind, (eagle3, vocab) in HEAD_KINDS.items():
            heads[kind] = root / f"{family}-{kind}"
            make_head(heads[kind], model, eagle3=eagle3, draft_vocab_size=vocab, seed=4)
        built[family] = (base, heads)
    return built


@pytest.fixture(scope="module")
def hf_reference(family_dirs):
    """(family, prompt index) -> ids from transformers' own greedy generate."""
    cache = {}

    def get(family, index):
        if (family, index) not in cache:
            model = AutoModelForCausalLM.from_pretrained(family_dirs[family][0], dtype=torch.float32).eval()
            for i, prompt in enumerate(PROMPTS):
                cache[(family, i)] = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
        return cache[(family, index)]

    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", list(HEAD_KINDS))
def test_greedy_equals_hf_generate(family, kind, family_dirs, hf_reference):
    base, heads = family_dirs[family]
    eagle3, _ = HEAD_KINDS[kind]
    model = EaModel.from_pretrained(use_eagle3=eagle3, base_model_path=str(base), ea_model_path=str(heads[kind]),
                                    dtype=torch.float32)
    for total_token, depth, top_k, lookup_tokens in TREES:
        model.set_tree(total_token, depth, top_k, lookup_tokens)
        for index, prompt in enumerate(PROMPTS):
            expected = hf_reference(family, index)
            got = model.eagenerate(torch.tensor([prompt]), max_new_tokens=MAX_NEW)
            assert got.tolist() == expected.tolist(), (family, kind, total_token, depth, top_k, lookup_tokens, prompt)
            assert model.naivegenerate(torch.tensor([prompt]), max_new_tokens=MAX_NEW).tolist() == expected.tolist()


TRAINED_KINDS = {"eagle3-full": (True, None), "eagle3-reduced": (True, 64), "eagle1": (False, None)}


def fit_head(root, base, model, kind: str, seed: int = 6):
    """A head of ``kind`` fitted in a few seconds to ``model``'s own greedy outputs; returns (head dir, prompts)."""
    eagle3, vocab = TRAINED_KINDS[kind]
    head = root / f"{base.name}-{kind}"
    make_head(head, model, eagle3=eagle3, draft_vocab_size=vocab, seed=seed)
    return head, train_head_quickly(base, head, eagle3=eagle3, steps=40, num_sequences=16, lr=1e-2)


@pytest.fixture(scope="module")
def trained_pairs(tmp_path_factory):
    """Heads of every kind fitted to a tiny Llama's own outputs, with the prompts they were fitted on."""
    root = tmp_path_factory.mktemp("trained")
    base = root / "base"
    model = make_target(base, "llama", seed=5)
    pairs = {}
    for kind, (eagle3, _) in TRAINED_KINDS.items():
        head, prompts = fit_head(root, base, model, kind)
        pairs[kind] = (base, head, eagle3, prompts)
    return pairs


def assert_accepted_and_greedy(base, head, eagle3, prompts, floor: float, max_new: int = 40):
    """EAGLE's output equals Hugging Face greedy search on each prompt (batch one), and the drafts are really
    accepted: more than ``floor`` tokens per draft/verify cycle on average (1 = nothing accepted)."""
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = EaModel.from_pretrained(use_eagle3=eagle3, base_model_path=str(base), ea_model_path=str(head),
                                    total_token=16, depth=4, top_k=4, dtype=torch.float32)
    emitted = cycles = 0
    for prompt in prompts:
        ids = prompt[None]
        expected = reference.generate(ids, max_new_tokens=max_new, do_sample=False)
        assert model.eagenerate(ids, max_new_tokens=max_new).tolist() == expected.tolist()
        steps = list(model.generate_steps(ids, max_new_tokens=max_new))
        assert torch.cat([ids[0]] + [s.tokens for s in steps]).tolist() == expected[0].tolist()
        emitted += sum(s.tokens.numel() for s in steps[1:])  # steps[0] is the prefill's token
        cycles += len(steps) - 1
    mean_tokens = emitted / cycles  # tokens per draft/verify cycle: accepted drafts + 1
    assert mean_tokens > floor, mean_tokens


@pytest.mark.parametrize("kind", list(TRAINED_KINDS))
def test_trained_head_is_accepted_and_lossless(kind, trained_pairs):
    base, head, eagle3, prompts = trained_pairs[kind]
    assert_accepted_and_greedy(base, head, eagle3, prompts[:6], floor=2.0 if kind != "eagle3-reduced" else 1.8)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_trained_heads_of_every_family_are_accepted_and_lossless(family, tmp_path):
    """Every tested family with a fitted head: drafts accepted, output exactly greedy search (the check of
    transformers' test_assisted_decoding_matches_greedy_search, with EAGLE as the assistant)."""
    model = make_target(tmp_path / family, family, seed=5)
    kind = "eagle1" if family in ("qwen3", "gemma") else "eagle3-full"
    head, prompts = fit_head(tmp_path, tmp_path / family, model, kind)
    assert_accepted_and_greedy(tmp_path / family, head, TRAINED_KINDS[kind][0], prompts[:3], floor=2.0)


def test_prompt_lookup_matches_greedy_search(family_dirs, monkeypatch):
    """transformers' test_prompt_lookup_decoding_matches_greedy_search, here: several models, batch one, with the
    lookup branch grafting continuations copied from the context onto a one-token head tree, the output is exactly
    greedy search. (That copied tokens are accepted is shown in test_lookup.py, on text that repeats.)"""
    import eagle.model.drafting.lookup as drafter_module

    grafted = []
    real_graft = drafter_module.graft_chain
    monkeypatch.setattr(drafter_module, "graft_chain",
                        lambda tree, chain: grafted.append(chain.numel()) or real_graft(tree, chain))
    for family in ("llama", "qwen2", "mixtral", "gemma"):
        base, heads = family_dirs[family]
        reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                        total_token=3, depth=0, top_k=2, lookup_tokens=6, dtype=torch.float32)
        for prompt in ([1, 30, 31, 32, 33, 30, 31, 32, 33, 30], PROMPTS[1]):
            ids = torch.tensor([prompt])
            expected = reference.generate(ids, max_new_tokens=48, do_sample=False)
            steps = list(model.generate_steps(ids, max_new_tokens=48))
            assert torch.cat([ids[0]] + [s.tokens for s in steps]).tolist() == expected[0].tolist(), family
    assert grafted  # the lookup branch was really verified


def test_stop_token_and_budget(family_dirs):
    """Nothing after the first stop token; never more than max_new_tokens; same as HF for every budget."""
    base, heads = family_dirs["llama"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    total_token=8, depth=3, top_k=3)
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    prompt = torch.tensor([PROMPTS[1]])
    for budget in range(0, 12):
        got, new_tokens, _ = model.eagenerate(prompt, max_new_tokens=budget, log=True)
        assert new_tokens == got.shape[1] - prompt.shape[1] <= budget
        if budget:
            assert got.tolist() == reference.generate(prompt, max_new_tokens=budget, do_sample=False).tolist()
    # make the target's first choice a stop token: generation ends right there, stop token included
    first = model.eagenerate(prompt, max_new_tokens=1)[0, -1].item()
    model.base_model.generation_config.eos_token_id = [first]
    try:
        out = model.eagenerate(prompt, max_new_tokens=30)
        assert out[0, prompt.shape[1]:].tolist() == [first]
    finally:
        model.base_model.generation_config.eos_token_id = 5


def test_streaming_matches_and_chunks_are_steps(family_dirs):
    base, heads = family_dirs["qwen2"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    total_token=8, depth=3, top_k=3)
    prompt = torch.tensor([PROMPTS[0]])
    final = model.eagenerate(prompt, max_new_tokens=20)
    lengths = [ids.shape[1] for ids in model.ea_generate(prompt, max_new_tokens=20)]
    assert lengths[0] == prompt.shape[1] + 1 and lengths[-1] == final.shape[1]
    assert all(b > a for a, b in zip(lengths, lengths[1:]))
    naive = [ids.shape[1] for ids in model.naive_generate(prompt, max_new_tokens=20)]
    assert naive == list(range(prompt.shape[1] + 1, final.shape[1] + 1))


def test_generation_runs_without_autograd_and_leaves_the_callers_grad_mode_alone(family_dirs):
    base, heads = family_dirs["llama"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    total_token=8, depth=3, top_k=3)
    prompt = torch.tensor([PROMPTS[0]])
    assert torch.is_grad_enabled()
    # A training loop that streams samples between its own steps must keep its grad mode between chunks.
    for stream in (model.ea_generate(prompt, max_new_tokens=12), model.naive_generate(prompt, max_new_tokens=4)):
        modes = [torch.is_grad_enabled() for _ in stream]
        assert modes and all(modes)
    # ... and nothing the loop computes records an autograd graph, at temperature 0 or above.
    projected = []
    model.base_model.lm_head.register_forward_hook(lambda module, args, out: projected.append(out.requires_grad))
    for temperature in (0.0, 1.0):
        steps = list(model.generate_steps(prompt, temperature=temperature, max_new_tokens=12))
        assert steps and not any(step.tokens.requires_grad for step in steps)
    assert projected and not any(projected)
    assert torch.is_grad_enabled()


def test_hf_style_generate(family_dirs):
    base, heads = family_dirs["llama"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]))
    inputs = model.tokenizer("Hello", return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=10)
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert out.tolist() == reference.generate(**inputs, max_new_tokens=10, do_sample=False).tolist()


def test_hf_style_generate_honours_eos_and_refuses_what_it_cannot_do(family_dirs):
    base, heads = family_dirs["llama"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]))
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    inputs = model.tokenizer("Hello", return_tensors="pt")
    start = inputs["input_ids"].shape[1]
    full = model.generate(**inputs, max_new_tokens=10, num_beams=1, pad_token_id=0, use_cache=True)
    stop = int(full[0, start + 3])
    out = model.generate(**inputs, max_new_tokens=10, eos_token_id=stop)
    assert out.tolist() == reference.generate(**inputs, max_new_tokens=10, do_sample=False, eos_token_id=stop).tolist()
    assert out.shape[1] <= start + 4 and int(out[0, -1]) == stop
    for bad in (dict(num_beams=2), dict(repetition_penalty=1.3), dict(streamer=object())):
        with pytest.raises(ValueError, match=f"cannot honour {next(iter(bad))}"):
            model.generate(**inputs, max_new_tokens=4, **bad)


def test_abandoned_stream_and_failed_call_leave_model_usable(family_dirs):
    base, heads = family_dirs["llama"]
    model = EaModel.from_pretrained(base_model_path=str(base), ea_model_path=str(heads["eagle3-full"]),
                                    total_token=8, depth=3, top_k=3)
    prompt = torch.tensor([PROMPTS[1]])
    expected = model.eagenerate(prompt, max_new_tokens=16)
    stream = model.ea_generate(prompt, max_new_tokens=16)
    next(stream)
    next(stream)
    del stream  # abandoned half-way
    with pytest.raises(ValueError):
        model.eagenerate(torch.tensor([[1, 2, 3000]]), max_new_tokens=4)
    assert model.eagenerate(prompt, max_new_tokens=16).tolist() == expected.tolist()
    # a later call with a larger max_length grows the cache
    long_prompt = torch.randint(6, 128, (1, 300))
    out = model.eagenerate(long_prompt, max_new_tokens=4, max_length=400)
    assert out.shape[1] == 304


def test_replay_against_a_recorded_answer_reproduces_the_generation_loop(trained_pairs):
    """eagle.evaluation.simulate: replaying the drafter against the recorded greedy answer accepts, step by step,
    what the real generation loop accepts (a trained head, with the lookup branch on)."""
    from eagle.evaluation.simulate import record, replay

    base, head, eagle3, prompts = trained_pairs["eagle3-full"]
    model = EaModel.from_pretrained(use_eagle3=eagle3, base_model_path=str(base), ea_model_path=str(head),
                                    total_token=8, depth=2, top_k=3, lookup_tokens=4, dtype=torch.float32)
    accepted = 0
    for prompt in prompts[:3]:
        ids = prompt[None]
        steps = list(model.generate_steps(ids, max_new_tokens=40))
        real = [s.accepted for s in steps[1:]]  # steps[0] is the prefill's token
        recording = record(model, ids, max_new_tokens=40)
        assert torch.equal(recording.tokens, model.naivegenerate(ids, max_new_tokens=40)[0])
        simulated = replay(model.ea_layer, recording, model.tree_settings)
        # the loop's last step may be cut by the token budget; every other step matches exactly
        assert simulated.accept_lengths[:-1] == real[:-1]
        assert len(simulated.accept_lengths) == len(real)
        accepted += sum(real)
    assert accepted > 10  # the head is really accepted, so the replay's features are really used


def _count_projected_rows(model, monkeypatch) -> list[int]:
    """Record how many rows each lazy projection through the LM head computes."""
    target = model.engine.target
    counts: list[int] = []
    project = target.project

    def counting(hidden):
        counts.append(hidden.shape[0])
        return project(hidden)

    monkeypatch.setattr(target, "project", counting)
    return counts


def test_cpu_verification_projects_only_the_accepted_path(trained_pairs, monkeypatch):
    """On a CPU the LM head runs only for the tree rows verification reads (the accepted path), each projected
    together with a few of the likeliest nodes below it so that a long accepted path costs few projections; the
    output is still exactly HF greedy decoding."""
    from eagle.model.engine.verify import LAZY_PROJECTION_ROWS

    base, head, eagle3, prompts = trained_pairs["eagle3-full"]
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = EaModel.from_pretrained(use_eagle3=eagle3, base_model_path=str(base), ea_model_path=str(head),
                                    total_token=16, depth=4, top_k=4, dtype=torch.float32)
    counts = _count_projected_rows(model, monkeypatch)
    head_rows: list[int] = []  # rows of every LM head call: in the forward passes and in the lazy projections
    model.base_model.lm_head.register_forward_hook(lambda module, args, out: head_rows.append(args[0].shape[-2]))
    ids = prompts[0][None]
    steps = list(model.generate_steps(ids, max_new_tokens=40))
    got = torch.cat([ids[0]] + [s.tokens for s in steps])
    assert got.tolist() == reference.generate(ids, max_new_tokens=40, do_sample=False)[0].tolist()
    assert model.engine.target._lazy_logits is True
    counts = counts[1:]  # the first call is the prefill's check that the LM head alone gives the logits
    accepted = sum(s.accepted for s in steps)
    assert accepted > len(steps) - 1  # the head is really accepted, so whole paths were walked
    # at most one projection per accepted draft (the last step may be cut by the budget), never the whole
    # 16-node tree at once; and batching works: accepted paths of two or more tokens took fewer projections
    assert all(1 <= c <= LAZY_PROJECTION_ROWS for c in counts)
    assert all(1 <= r <= LAZY_PROJECTION_ROWS for r in head_rows) and len(head_rows) == len(counts) + len(steps) + 1
    assert len(counts) <= accepted + 4
    if any(s.accepted >= 2 for s in steps):
        assert len(counts) < accepted
    # the root and its likeliest descendants come out of the verification forward itself: most steps that accept
    # a draft token need no projection after it
    assert len(counts) < sum(s.accepted >= 1 for s in steps)


def test_a_bfloat16_draft_head_changes_nothing_in_the_output(trained_pairs):
    """The draft head's dtype is a speed choice: a bfloat16 head of a float32 model drafts nearly as well (its
    proposals are still accepted) and the output is exactly greedy decoding, with or without native bfloat16."""
    base, head, eagle3, prompts = trained_pairs["eagle3-full"]
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    model = EaModel.from_pretrained(use_eagle3=eagle3, base_model_path=str(base), ea_model_path=str(head),
                                    total_token=12, depth=3, top_k=4, dtype=torch.float32, draft_dtype="bfloat16")
    assert model.ea_layer.fc.weight.dtype == torch.bfloat16 and model.base_model.dtype == torch.float32
    accepted = drafted_steps = 0
    for prompt in prompts[:2]:
        ids = prompt[None]
        steps = list(model.generate_steps(ids, max_new_tokens=32))
        got = torch.cat([ids[0]] + [s.tokens for s in steps])
        assert got.tolist() == reference.generate(ids, max_new_tokens=32, do_sample=False)[0].tolist()
        accepted += sum(s.accepted for s in steps)
        drafted_steps += len(steps) - 1
    assert accepted > drafted_steps  # more than one accepted draft token per step on average


def test_logits_that_are_not_the_lm_head_alone_are_never_computed_lazily(tmp_path, monkeypatch):
    """A model whose logits are post-processed (Granite divides them by ``logits_scaling``) verifies full trees; so
    does one whose logits fail the numerical check. Both stay equal to HF greedy decoding."""
    from eagle.model.base.target import Target

    model = make_target(tmp_path / "base", "granite", seed=2, logits_scaling=4.0)
    make_head(tmp_path / "head", model, eagle3=True, seed=3)
    prompt = torch.tensor([PROMPTS[1]])
    expected = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False).tolist()
    capped = EaModel.from_pretrained(base_model_path=str(tmp_path / "base"), ea_model_path=str(tmp_path / "head"),
                                     total_token=8, depth=3, top_k=3, dtype=torch.float32)
    assert capped.engine.target._lazy_logits is False
    assert capped.eagenerate(prompt, max_new_tokens=MAX_NEW).tolist() == expected

    base = make_target(tmp_path / "llama", "llama", seed=2)
    make_head(tmp_path / "llama-head", base, eagle3=True, seed=3)
    monkeypatch.setattr(Target, "project", lambda self, hidden: self.model.get_output_embeddings()(hidden) * 2.0)
    scaled = EaModel.from_pretrained(base_model_path=str(tmp_path / "llama"), ea_model_path=str(tmp_path / "llama-head"),
                                     total_token=8, depth=3, top_k=3, dtype=torch.float32)
    expected = base.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False).tolist()
    assert scaled.eagenerate(prompt, max_new_tokens=MAX_NEW).tolist() == expected
    assert scaled.engine.target._lazy_logits is False


def test_tree_verification_runs_sdpa_gqa_and_gets_the_same_logits(tmp_path, monkeypatch):
    """On a CPU a tree forward of a grouped-query model runs SDPA's own GQA (no copy of the keys and values for each
    query head), gives bitwise the logits and features of transformers' SDPA path, and leaves the model's attention
    setting as it was (ours stands for SDPA where no pass of ours asks for more)."""
    import dataclasses

    import torch.nn.functional as F

    from eagle.model.backends import attention
    from eagle.model.base.target import Target
    from eagle.model.drafting.tree import tree_from_parents

    model = make_target(tmp_path / "base", "llama", seed=4)
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    target = Target(model, feature_layers=[1, 3, 5])
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(6, 128, (1, 20), generator=generator)
    tree = tree_from_parents(torch.randint(6, 128, (6,), generator=generator), torch.tensor([-1, 0, 0, 1, 1, 3]),
                             torch.zeros(6))
    grouped: list[bool] = []
    real_sdpa = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        grouped.append(bool(kwargs.get("enable_gqa")))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)

    def verify():
        cache = target.new_cache(64)
        target.prefill(prompt, cache, logits_to_keep=0)
        grouped.clear()
        return target.verify(tree.tokens[None], cache, tree.depths + 20, tree.ancestor_mask)

    fast = verify()
    assert grouped == [True] * model.config.num_hidden_layers
    assert attention.base_attention(model.config._attn_implementation) == "sdpa"
    monkeypatch.setattr(target, "forward_plan", dataclasses.replace(target.forward_plan,
                                                                    attend=attention.sdpa_attention))
    stock = verify()
    assert grouped == [False] * model.config.num_hidden_layers  # transformers repeats keys and values instead
    assert torch.equal(fast.logits, stock.logits) and torch.equal(fast.features, stock.features)
