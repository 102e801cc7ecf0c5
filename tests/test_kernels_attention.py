"""The position-ordered attention kernel (eagle.kernels.attention): agreement with the float64 reference, bit
invariance (a query's output depends only on its q row and its visible keys), transformers integration and the
refusal of malformed input."""

from __future__ import annotations

import pytest
import torch

from eagle import kernels
from eagle.kernels import attention
from eagle.kernels.reference_attention import reference_attention

@pytest.fixture(scope="module")
def ops():
    if not kernels.available():  # no extension: only the reference tests run
        pytest.skip(f"the kernels are unavailable: {kernels.unavailable_reason()}")
    return torch.ops.eagle


# ---------------------------------------------------------------------------------------------------------------
# Masks (bool (B, T, S), True = visible)


def causal(batch, queries, slots, window=None):
    """Queries at the last T positions of S slots, each seeing slots up to its own (within the window)."""
    positions = torch.arange(slots - queries, slots)[:, None]
    slot = torch.arange(slots)[None, :]
    mask = slot <= positions
    if window is not None:
        mask &= positions - slot < window
    return mask.expand(batch, queries, slots).clone()


def random_tree_parents(nodes, generator):
    """parents[j] < j (-1 for the root)."""
    return [-1] + [int(torch.randint(0, j, (1,), generator=generator)) for j in range(1, nodes)]


def tree_mask(committed, parents, slots, node_slots=None):
    """(T, S): node j sees slots 0..committed-1 and its ancestors' (and its own) slots."""
    node_slots = list(range(committed, committed + len(parents))) if node_slots is None else node_slots
    mask = torch.zeros(len(parents), slots, dtype=torch.bool)
    mask[:, :committed] = True
    for j in range(len(parents)):
        a = j
        while a >= 0:
            mask[j, node_slots[a]] = True
            a = parents[a]
    return mask


def batch_tree_masks(committed_lengths, parents, slots):
    """(B, T, S): row b with committed_lengths[b] committed slots and the same tree after them."""
    return torch.stack([tree_mask(c, parents, slots) for c in committed_lengths])


def left_padded(batch, queries, slots, pads):
    mask = causal(batch, queries, slots)
    for b, pad in enumerate(pads):
        mask[b, :, :pad] = False
    return mask


def random_qkv(batch, q_heads, kv_heads, queries, slots, dim, value_dim=None, seed=0, std=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, queries, dim, generator=g) * std
    k = torch.randn(batch, kv_heads, slots, dim, generator=g) * std
    v = torch.randn(batch, kv_heads, slots, value_dim or dim, generator=g)
    return q, k, v


def run(ops, q, k, v, mask, scale, sinks=None, softcap=None, isa=None):
    lists = attention.visible_keys(mask)
    return ops.tree_attention(q, k, v, lists.offsets, lists.indices, scale, sinks, softcap, isa)


def assert_matches_reference(out, q, k, v, mask, scale, sinks=None, softcap=None):
    ref = reference_attention(q, k, v, mask, scale, sinks, softcap)
    assert out.shape == ref.shape and out.dtype == torch.float32 and out.is_contiguous()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# Against the float64 reference


def _masks(batch, queries, slots, seed):
    g = torch.Generator().manual_seed(seed)
    parents = random_tree_parents(queries, g)
    lengths = [slots - queries - 7 * b for b in range(batch)]
    return {
        "causal": causal(batch, queries, slots),
        "tree": batch_tree_masks([slots - queries] * batch, parents, slots),
        "sliding": causal(batch, queries, slots, window=9),
        "left_padding": left_padded(batch, queries, slots, [3 * b for b in range(batch)]),
        "lengths": batch_tree_masks(lengths, parents, slots),
    }


@pytest.mark.parametrize("mask_name", ["causal", "tree", "sliding", "left_padding", "lengths"])
@pytest.mark.parametrize("groups", [1, 2, 3, 4])
def test_matches_reference_masks_and_groups(ops, mask_name, groups):
    batch, queries, slots, kv_heads = 3, 6, 41, 2
    mask = _masks(batch, queries, slots, seed=groups)[mask_name]
    q, k, v = random_qkv(batch, kv_heads * groups, kv_heads, queries, slots, 64, seed=groups)
    for isa in kernels.isas():
        out = run(ops, q, k, v, mask, 0.125, isa=isa)
        assert_matches_reference(out, q, k, v, mask, 0.125)


@pytest.mark.parametrize("dim,value_dim", [(64, 64), (128, 128), (256, 256), (80, 80), (40, 24), (3, 70)])
def test_matches_reference_head_dims(ops, dim, value_dim):
    batch, queries, slots = 2, 5, 37
    mask = _masks(batch, queries, slots, seed=dim)["tree"]
    q, k, v = random_qkv(batch, 6, 2, queries, slots, dim, value_dim, seed=dim)
    for isa in kernels.isas():
        assert_matches_reference(run(ops, q, k, v, mask, dim ** -0.5, isa=isa), q, k, v, mask, dim ** -0.5)


def test_matches_reference_sinks_and_softcap(ops):
    batch, queries, slots = 2, 7, 50
    mask = _masks(batch, queries, slots, seed=5)["tree"]
    mask[1, 3] = False  # a query that sees nothing: zeros, with or without sinks
    q, k, v = random_qkv(batch, 6, 3, queries, slots, 64, seed=5, std=2.0)
    sinks = torch.randn(6) * 3
    for isa in kernels.isas():
        for s, cap in [(sinks, None), (None, 8.0), (sinks, 5.0), (None, 0.5)]:
            out = run(ops, q, k, v, mask, 0.125, s, cap, isa=isa)
            assert_matches_reference(out, q, k, v, mask, 0.125, s, cap)
            assert torch.equal(out[1, 3], torch.zeros_like(out[1, 3]))


def test_extreme_scores_stay_finite(ops):
    """Scores hundreds apart (exp underflows for all but the maximum) still give the reference's answer."""
    q, k, v = random_qkv(1, 4, 2, 3, 30, 64, seed=3, std=6.0)
    mask = causal(1, 3, 30)
    out = run(ops, q, k, v, mask, 1.0)
    assert torch.isfinite(out).all()
    assert_matches_reference(out, q, k, v, mask, 1.0)


def test_instruction_sets_agree_bitwise(ops):
    """The AVX-512, AVX2 and portable paths follow one lane structure: the same bits on one machine."""
    isas = kernels.isas()
    q, k, v = random_qkv(2, 8, 2, 9, 45, 80, 72, seed=11)
    mask = _masks(2, 9, 45, seed=11)["lengths"]
    sinks = torch.randn(8)
    for s, cap in [(None, None), (sinks, 4.0)]:
        outs = [run(ops, q, k, v, mask, 0.1, s, cap, isa=isa) for isa in isas]
        for isa, out in zip(isas[1:], outs[1:]):
            assert torch.equal(out, outs[0]), f"{isa} differs from {isas[0]}"


# ---------------------------------------------------------------------------------------------------------------
# Bit invariance


@pytest.mark.parametrize("queries", [2, 3, 12, 17, 32])
def test_query_alone_equals_query_among_others(ops, queries):
    slots = 60
    g = torch.Generator().manual_seed(queries)
    mask = tree_mask(slots - queries, random_tree_parents(queries, g), slots)[None]
    q, k, v = random_qkv(1, 9, 3, queries, slots, 64, seed=queries)
    sinks = torch.randn(9)
    for isa in kernels.isas():
        together = run(ops, q, k, v, mask, 0.125, sinks, 30.0, isa=isa)
        for t in range(queries):
            alone = run(ops, q[:, :, t:t + 1], k, v, mask[:, t:t + 1].clone(), 0.125, sinks, 30.0, isa=isa)
            assert torch.equal(alone[:, 0], together[:, t]), f"{isa}: query {t} of {queries}"


def test_row_alone_equals_row_in_batch(ops):
    batch, queries, slots = 8, 5, 70
    g = torch.Generator().manual_seed(2)
    parents = random_tree_parents(queries, g)
    lengths = [65, 10, 40, 33, 64, 1, 20, 50]
    mask = batch_tree_masks(lengths, parents, slots)
    q, k, v = random_qkv(batch, 9, 3, queries, slots, 64, seed=2)
    together = run(ops, q, k, v, mask, 0.125)
    for b in range(batch):
        alone = run(ops, q[b:b + 1], k[b:b + 1], v[b:b + 1], mask[b:b + 1].clone(), 0.125)
        assert torch.equal(alone[0], together[b]), f"row {b}"


def test_tree_layout_equals_plain_layout(ops):
    """A tree node whose ancestors sit at scattered slots (other nodes' keys between them, masked) gets the bits
    the same token gets in plain decoding, where the same keys sit at contiguous slots 0..p."""
    committed, nodes, heads, kv_heads, dim = 37, 14, 9, 3, 64
    g = torch.Generator().manual_seed(7)
    parents = random_tree_parents(nodes, g)
    slots = committed + nodes + 5  # a few unused slots at the end, as in a preallocated cache
    q, k, v = random_qkv(1, heads, kv_heads, nodes, slots, dim, seed=7)
    tree = tree_mask(committed, parents, slots)[None]
    verified = run(ops, q, k, v, tree, 0.125)
    for node in range(nodes):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        kept = list(range(committed)) + [committed + a for a in reversed(path)]
        k_plain, v_plain = k[:, :, kept].clone(), v[:, :, kept].clone()
        plain = torch.ones(1, 1, len(kept), dtype=torch.bool)
        alone = run(ops, q[:, :, node:node + 1], k_plain, v_plain, plain, 0.125)
        assert torch.equal(alone[:, 0], verified[:, node]), f"node {node}"


def test_thread_count_does_not_change_bits(ops):
    q, k, v = random_qkv(4, 9, 3, 12, 90, 64, seed=4)
    mask = _masks(4, 12, 90, seed=4)["lengths"]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(ops, q, k, v, mask, 0.125)
        torch.set_num_threads(2)
        two = run(ops, q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_bool_and_additive_masks_give_the_same_bits(ops):
    q, k, v = random_qkv(2, 4, 2, 6, 33, 64, seed=9)
    visible = _masks(2, 6, 33, seed=9)["left_padding"]
    expected = attention.tree_attention(q, k, v, visible[:, None], 0.125)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        for masked in (torch.finfo(dtype).min, float("-inf")):
            additive = torch.zeros(visible.shape, dtype=dtype).masked_fill(~visible, masked)
            out = attention.tree_attention(q, k, v, additive[:, None], 0.125)
            assert torch.equal(out, expected), (dtype, masked)


def test_cache_views_equal_contiguous_copies(ops):
    """k/v as views of a longer preallocated cache (strided in B, H, S) give the bits of contiguous copies, and q
    in transformers' (B, T, H, D)-transposed layout those of a contiguous q."""
    capacity, slots = 80, 45
    q_btd = torch.randn(2, 7, 6, 64)  # (B, T, Hq, D) as a projection writes it
    cache_k, cache_v = torch.randn(2, 3, capacity, 64), torch.randn(2, 3, capacity, 64)
    q, k, v = q_btd.transpose(1, 2), cache_k[:, :, :slots], cache_v[:, :, :slots]
    mask = _masks(2, 7, slots, seed=1)["tree"]
    strided = run(ops, q, k, v, mask, 0.125)
    copied = run(ops, q.contiguous(), k.contiguous(), v.contiguous(), mask, 0.125)
    assert torch.equal(strided, copied)
    # a last dimension that is not contiguous is copied, same bits
    k_t = k.contiguous().transpose(2, 3).contiguous().transpose(2, 3)
    assert torch.equal(run(ops, q, k_t, v, mask, 0.125), copied)


def test_broadcast_mask_batch(ops):
    """A (1, 1, T, S) mask applies to every row, as a (B, 1, T, S) copy of it does."""
    q, k, v = random_qkv(3, 4, 2, 5, 30, 64, seed=12)
    one = causal(1, 5, 30)
    assert torch.equal(run(ops, q, k, v, one, 0.125), run(ops, q, k, v, one.expand(3, 5, 30).clone(), 0.125))


# ---------------------------------------------------------------------------------------------------------------
# The Python API


def test_visible_keys_lists_and_cache(ops):
    mask = torch.tensor([[[True, False, True, True], [False, False, False, False]]])
    lists = attention.visible_keys(mask[:, None])
    assert lists.offsets.tolist() == [0, 3, 3] and lists.indices.tolist() == [0, 2, 3]
    four_d = mask[:, None]
    assert attention.visible_keys(four_d) is attention.visible_keys(four_d)  # one computation per mask object
    four_d[0, 0, 1, 1] = True  # modified in place: rebuilt
    assert attention.visible_keys(four_d).indices.tolist() == [0, 2, 3, 1]


def test_visible_keys_match_the_mask(ops):
    """The lists hold exactly each row's visible slots, ascending, for bool and additive masks in any layout (a
    last dimension that is not contiguous, a batch broadcast with stride 0)."""
    g = torch.Generator().manual_seed(3)
    visible = torch.rand(3, 7, 50, generator=g) < 0.5
    visible[1, 2] = False
    visible[2, 3] = True
    layouts = [visible, visible.transpose(1, 2).contiguous().transpose(1, 2), visible[:1].expand(3, 7, 50)]
    for layout in layouts:
        additive = torch.zeros(layout.shape).masked_fill(~layout, float("-inf"))
        for mask in (layout, additive, additive.transpose(1, 2).contiguous().transpose(1, 2)):
            lists = attention.visible_keys(mask[:, None])
            for r, row in enumerate(layout.reshape(-1, 50)):
                got = lists.indices[lists.offsets[r]:lists.offsets[r + 1]]
                assert got.tolist() == row.nonzero().flatten().tolist(), r


def test_reference_fallback_agrees(ops):
    """Where the op cannot run (float64 inputs, autograd), tree_attention computes the same math in PyTorch."""
    q, k, v = random_qkv(2, 6, 3, 5, 29, 64, seed=13)
    mask = _masks(2, 5, 29, seed=13)["tree"][:, None]
    sinks = torch.randn(6)
    compiled = attention.tree_attention(q, k, v, mask, 0.125, sinks, 20.0)
    fallback = attention.tree_attention(q.double(), k.double(), v.double(), mask, 0.125, sinks.double(), 20.0)
    assert fallback.dtype == torch.float64
    torch.testing.assert_close(compiled.double(), fallback, atol=2e-5, rtol=2e-5)
    q_grad = q.clone().requires_grad_()
    out = attention.tree_attention(q_grad, k, v, mask, 0.125)
    out.sum().backward()
    assert q_grad.grad is not None and torch.isfinite(q_grad.grad).all()


def test_causal_mask_without_attention_mask(ops):
    """attention_mask=None reads as transformers' SDPA path reads it: one query sees everything; T == S queries
    are causal."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    for queries, slots in [(1, 20), (20, 20)]:
        q, k, v = random_qkv(2, 4, 2, queries, slots, 64, seed=queries)
        ours, _ = attention.attention_forward(module, q, k, v, None, scaling=0.125)
        sdpa, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.125)
        torch.testing.assert_close(ours, sdpa, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Through transformers


def _tiny(family, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    common = dict(vocab_size=96, hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
                  pad_token_id=0)
    config = AutoConfig.for_model(family, **{**common, **overrides})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.mark.parametrize("family,overrides,baseline", [
    ("llama", {}, "sdpa"),
    ("qwen3", {}, "sdpa"),
    ("gemma2", dict(sliding_window=5, attn_logit_softcapping=20.0, query_pre_attn_scalar=16), "eager"),
    ("gpt_oss", dict(sliding_window=5, num_local_experts=4, num_experts_per_tok=2, layer_types=None), "eager"),
])
def test_logits_match_transformers_with_4d_mask(ops, family, overrides, baseline):
    """A tiny random model with attention_forward registered gives the logits of transformers' own attention
    (SDPA, or eager where SDPA lacks soft-capping / sinks) for a prompt under a 4-D tree-style mask, and for a
    left-padded batch whose masks transformers builds (full and sliding window)."""
    name = attention.register("eagle_test_position_ordered")
    model = _tiny(family, **overrides)
    ids = torch.randint(1, 96, (2, 11), generator=torch.Generator().manual_seed(1))
    prompt = causal(2, 11, 11)
    prompt[:, 8, 6:8] = False  # a tree: positions 6, 7 and 8 are siblings of one another
    prompt[:, 7, 6] = False
    four_d = torch.zeros(2, 1, 11, 11).masked_fill(~prompt[:, None], torch.finfo(torch.float32).min)
    padding = torch.ones(2, 11, dtype=torch.long)
    padding[1, :3] = 0
    with torch.no_grad():
        for kwargs in [dict(attention_mask=four_d), dict(attention_mask=padding)]:
            model.set_attn_implementation(baseline)
            expected = model(input_ids=ids, **kwargs).logits
            model.set_attn_implementation(name)
            got = model(input_ids=ids, **kwargs).logits
            real = slice(None) if kwargs["attention_mask"].dim() == 4 else (padding.bool())
            torch.testing.assert_close(got[real], expected[real], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# Malformed input


def _lists(offsets, indices):
    return torch.tensor(offsets, dtype=torch.long), torch.tensor(indices, dtype=torch.int32)


@pytest.mark.parametrize("offsets,indices,message", [
    ([0, 2, 3], [0, 5, 1], "strictly ascending slots in \\[0, 5\\); entry 1 is 5"),
    ([0, 2, 3], [0, 1, -1], "entry 0 is -1"),
    ([0, 2, 3], [3, 1, 2], "entry 1 is 1 after 3"),
    ([0, 2, 4], [0, 1, 2], "offsets\\[-1\\] = 4 but indices holds 3"),
    ([0, 2], [0, 1], "mask_batch \\* T \\+ 1 entries"),
    ([1, 2, 3], [0, 1, 2], "offsets\\[0\\] must be 0"),
    ([0, 3, 2], [0, 1, 2], "non-decreasing"),
    ([0, 6, 6], [0, 1, 2, 3, 4, 4], "at most S = 5"),
])
def test_op_refuses_malformed_lists(ops, offsets, indices, message):
    q, k, v = random_qkv(1, 2, 1, 2, 5, 16)
    o, i = _lists(offsets, indices)
    with pytest.raises(RuntimeError, match=message):
        ops.tree_attention(q, k, v, o, i, 1.0)


def test_op_refuses_wrong_shapes_and_dtypes(ops):
    q, k, v = random_qkv(1, 4, 2, 2, 5, 16)
    o, i = _lists([0, 2, 4], [0, 1, 0, 1])
    cases = [
        ((q.double(), k, v, o, i, 1.0), "q must be Float"),
        ((q, k[..., :8], v, o, i, 1.0), "with q's D"),
        ((q, k, v[:, :1], o, i, 1.0), "same number of heads"),
        ((q[:, :3], k, v, o, i, 1.0), "dividing q's Hq"),
        ((q, k, v, o.int(), i, 1.0), "offsets must be Long"),
        ((q, k, v, o, i.long(), 1.0), "indices must be Int"),
        ((q, k, v, o, i, 1.0, torch.zeros(3)), "sinks must have Hq = 4"),
        ((q, k, v, o, i, 1.0, None, -1.0), "softcap must be a positive"),
        ((q, k, v, o, i, float("nan")), "scale must be finite"),
        ((q, k, v, o, i, 1.0, None, None, "sse9"), "unknown isa"),
        ((q[0], k, v, o, i, 1.0), "q must be \\(B, Hq, T, D\\)"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            ops.tree_attention(*args)


def test_python_api_refuses_bad_input(ops):
    q, k, v = random_qkv(2, 4, 2, 3, 10, 16)
    good = causal(2, 3, 10)[:, None]
    with pytest.raises(ValueError, match="shared by all heads"):
        attention.tree_attention(q, k, v, good.expand(2, 4, 3, 10), 1.0)
    with pytest.raises(ValueError, match="must be \\(B or 1, 1, T, S\\)"):
        attention.tree_attention(q, k, v, causal(2, 3, 9)[:, None], 1.0)
    with pytest.raises(ValueError, match="must be \\(B or 1, 1, T, S\\)"):
        attention.tree_attention(q, k, v, causal(3, 3, 10)[:, None], 1.0)
    with pytest.raises(ValueError, match="dividing"):
        attention.tree_attention(q[:, :3], k, v, good, 1.0)
    biased = torch.zeros(2, 1, 3, 10)
    biased[0, 0, 1, 2] = 0.5
    with pytest.raises(ValueError, match="0.5 \\(masks that add a bias"):
        attention.tree_attention(q, k, v, biased, 1.0)
    with pytest.raises(ValueError, match="bool or floating point"):
        attention.tree_attention(q, k, v, good.long(), 1.0)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="position_bias"):
        attention.attention_forward(module, q, k, v, good, position_bias=torch.zeros(1))
    module.train()
    with pytest.raises(ValueError, match="dropout"):
        attention.attention_forward(module, q, k, v, good, dropout=0.1)
    module.eval()
    out, weights = attention.attention_forward(module, q, k, v, good, dropout=0.1, position_ids=torch.arange(3),
                                               use_cache=True)
    assert weights is None and out.shape == (2, 3, 4, 16)
