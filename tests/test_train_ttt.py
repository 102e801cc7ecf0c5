"""Training-time test: the fast attention and the unrolled loss agree with slow, obviously-correct references
(the second one is the inference path of the head itself), and the draft vocabulary map is well formed."""

from __future__ import annotations

import math

import pytest
import torch

from eagle.model.cnets import Model
from eagle.model.configs import EConfig
from eagle.traineagle3.data import Sample, build_vocab_map
from eagle.traineagle3.ttt import Eagle3TTTModel, target_distribution, ttt_attention


def reference_ttt_attention(query, keys, values):
    """For every batch row b, head h and position t: softmax over the step-0 keys of positions 0..t and the keys of
    steps 1..k at position t, then the weighted sum of the matching values. Loops only, no masks."""
    bsz, num_heads, length, head_dim = query.shape
    groups = num_heads // keys[0].shape[1]
    out = torch.zeros_like(query)
    for b in range(bsz):
        for h in range(num_heads):
            kv = h // groups
            for t in range(length):
                ks = [keys[0][b, kv, s] for s in range(t + 1)] + [key[b, kv, t] for key in keys[1:]]
                vs = [values[0][b, kv, s] for s in range(t + 1)] + [value[b, kv, t] for value in values[1:]]
                scores = torch.stack([query[b, h, t] @ key for key in ks]) / math.sqrt(head_dim)
                weights = torch.softmax(scores, dim=0)
                out[b, h, t] = sum(w * v for w, v in zip(weights, vs))
    return out


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_ttt_attention_matches_reference_values_and_gradients(steps):
    torch.manual_seed(steps)
    bsz, num_heads, num_kv, length, head_dim = 2, 4, 2, 6, 8
    query = torch.randn(bsz, num_heads, length, head_dim, dtype=torch.float64, requires_grad=True)
    keys = [torch.randn(bsz, num_kv, length, head_dim, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    values = [torch.randn(bsz, num_kv, length, head_dim, dtype=torch.float64, requires_grad=True) for _ in range(steps)]
    fast = ttt_attention(query, keys, values)
    slow = reference_ttt_attention(query, keys, values)
    torch.testing.assert_close(fast, slow)
    upstream = torch.randn_like(fast)
    leaves = [query, *keys, *values]
    fast_grads = torch.autograd.grad((fast * upstream).sum(), leaves)
    slow_grads = torch.autograd.grad((slow * upstream).sum(), leaves)
    for fast_grad, slow_grad in zip(fast_grads, slow_grads):
        torch.testing.assert_close(fast_grad, slow_grad)


def tiny_head(vocab=40, draft_vocab=None, hidden=32, seed=0):
    torch.manual_seed(seed)
    config = EConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=10000.0, draft_vocab_size=draft_vocab or vocab,
        max_position_embeddings=256,
    )
    head = Model(config).double()
    for name, param in head.named_parameters():
        if param.dim() == 2:
            torch.nn.init.normal_(param, std=0.3)
    if draft_vocab:
        used = torch.sort(torch.randperm(vocab)[:draft_vocab]).values
        head.d2t.copy_(used - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[used] = True
    return head


def reference_ttt_losses(head, features, input_ids, target_logits, loss_mask, length, decay):
    """The TTT losses computed the way drafting runs at inference: for every start position t, the head's own
    forward over the real context (features f_0..f_t, tokens x_1..x_{t+1}) with a KV cache, then a chain of
    single-token steps, each fed the previous step's output, the ground-truth next token and the next position.
    Step k at t predicts x_{t+2+k}; it counts when that token has loss_mask 1 and the target's top token is in the
    draft vocabulary."""
    probs_all, in_vocab = target_distribution(target_logits, head)
    bsz, seq_len = input_ids.shape
    per_step = [[] for _ in range(length)]
    hits = [0] * length
    counted = [0] * length
    for b in range(bsz):
        for t in range(seq_len - 1):
            hidden, past = head(features[b : b + 1, : t + 1], input_ids[b : b + 1, 1 : t + 2], use_cache=True)
            hidden = hidden[:, -1:]
            for k in range(length):
                if t + 1 + k >= seq_len:
                    break
                if k > 0:
                    position = torch.tensor([[t + k]])
                    hidden, past = head(hidden, input_ids[b : b + 1, t + 1 + k : t + 2 + k], position_ids=position,
                                        past_key_values=past, use_cache=True)
                predicted = t + 2 + k
                if predicted >= seq_len or not loss_mask[b, predicted]:
                    continue
                counted[k] += 1
                if not in_vocab[b, t + 1 + k]:
                    continue
                logits = head.compute_logits(hidden)[0, 0]
                probs = probs_all[b, t + 1 + k]
                per_step[k].append(-(probs * torch.log_softmax(logits, -1)).sum())
                hits[k] += int(logits.argmax() == probs.argmax())
    losses = [torch.stack(v).mean() if v else torch.zeros((), dtype=torch.float64) for v in per_step]
    total = sum(decay**k * loss for k, loss in enumerate(losses))
    return total, losses, hits, counted


@pytest.mark.parametrize("draft_vocab", [None, 24])
def test_ttt_losses_match_the_inference_path(draft_vocab):
    """The unrolled training loss equals what the head computes when drafting chains at inference (same RoPE
    positions, same attention), and the loss mask is aligned with the predicted token."""
    vocab, length, decay = 40, 3, 0.8
    head = tiny_head(vocab, draft_vocab)
    torch.manual_seed(5)
    bsz, seq_len = 2, 7
    features = torch.randn(bsz, seq_len, 3 * 32, dtype=torch.float64)
    input_ids = torch.randint(0, vocab, (bsz, seq_len))
    target_logits = torch.randn(bsz, seq_len, vocab, dtype=torch.float64) * 3
    loss_mask = torch.tensor([[0, 0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 1, 1, 0]])
    model = Eagle3TTTModel(head, length=length, decay=decay)
    probs, in_vocab = target_distribution(target_logits, head)
    out = model(features, input_ids, probs.double(), in_vocab, loss_mask)
    total, losses, hits, counted = reference_ttt_losses(head, features, input_ids, target_logits, loss_mask, length, decay)
    for k in range(length):
        torch.testing.assert_close(out.losses[k], losses[k])
        assert int(out.counted[k]) == counted[k]
        assert int(out.correct[k]) == hits[k]
    torch.testing.assert_close(out.loss, total.to(out.loss.dtype))
    grads = torch.autograd.grad(out.loss, [head.fc.weight, head.midlayer.self_attn.q_proj.weight, head.lm_head.weight])
    ref_grads = torch.autograd.grad(total, [head.fc.weight, head.midlayer.self_attn.q_proj.weight, head.lm_head.weight])
    for grad, ref in zip(grads, ref_grads):
        torch.testing.assert_close(grad, ref)


def test_only_positions_predicting_assistant_tokens_are_counted():
    head = tiny_head()
    model = Eagle3TTTModel(head, length=3)
    seq_len = 8
    input_ids = torch.randint(0, 40, (1, seq_len))
    loss_mask = torch.zeros(1, seq_len, dtype=torch.long)
    loss_mask[0, 6] = 1  # one assistant token: predicted by step 0 at t=4, step 1 at t=3, step 2 at t=2
    probs, in_vocab = target_distribution(torch.randn(1, seq_len, 40, dtype=torch.float64), head)
    features = torch.randn(1, seq_len, 96, dtype=torch.float64)
    out = model(features, input_ids, probs, in_vocab, loss_mask)
    assert [int(c) for c in out.counted] == [1, 1, 1]
    # Every step is trained towards the target's distribution for token 6 (target position 5): changing the target
    # anywhere else leaves the loss unchanged; changing it there does not.
    changed = probs.clone()
    changed[0, [0, 1, 2, 3, 4, 6, 7]] = torch.softmax(torch.randn(7, 40, dtype=torch.float64), -1)
    torch.testing.assert_close(model(features, input_ids, changed, in_vocab, loss_mask).loss, out.loss)
    changed[0, 5] = torch.softmax(torch.randn(40, dtype=torch.float64), -1)
    assert not torch.allclose(model(features, input_ids, changed, in_vocab, loss_mask).loss, out.loss)


def test_vocab_map_is_complete_even_with_few_distinct_tokens():
    samples = [Sample(torch.tensor([1, 2, 3, 3, 3, 4, 9]), torch.tensor([0, 0, 1, 1, 1, 1, 0]))]
    d2t, t2d, coverage = build_vocab_map(samples, vocab_size=20, draft_vocab_size=6)
    assert d2t.shape == (6,) and t2d.shape == (20,) and int(t2d.sum()) == 6
    target_ids = torch.arange(6) + d2t
    assert torch.equal(target_ids, torch.sort(target_ids).values) and len(set(target_ids.tolist())) == 6
    assert torch.equal(t2d.nonzero().squeeze(-1), target_ids)
    # assistant tokens first (3, 4), then the other tokens of the data (1, 2, 9), then the smallest unused id (0)
    assert target_ids.tolist() == [0, 1, 2, 3, 4, 9]
    assert coverage == 1.0


def test_vocab_map_prefers_frequent_assistant_tokens():
    ids = torch.tensor([5] * 10 + [7] * 5 + [8] * 1 + [2] * 50)
    mask = torch.tensor([1] * 16 + [0] * 50)
    d2t, t2d, coverage = build_vocab_map([Sample(ids, mask)], vocab_size=12, draft_vocab_size=2)
    assert (torch.arange(2) + d2t).tolist() == [5, 7]
    assert coverage == pytest.approx(15 / 16)


def test_draft_vocab_larger_than_vocab_is_a_clear_error():
    with pytest.raises(ValueError, match="larger than the target's vocabulary"):
        build_vocab_map([Sample(torch.tensor([1]), torch.tensor([1]))], vocab_size=10, draft_vocab_size=11)
