"""``python -m eagle`` measures fairly: after a warm-up, EAGLE and plain decoding alternate over short repeats, the
median speed-up is printed with its spread, and a wide spread draws a warning (fake models and a fake clock:
nothing is loaded, every timing is known)."""

from __future__ import annotations

import types

import pytest
import torch

import eagle.__main__ as demo
from eagle.__main__ import BUSY_SPREAD, summarise_repeats


def test_the_median_speed_up_and_its_spread():
    eagle = [(64, 1.0), (64, 1.0), (64, 4.0), (60, 1.0), (64, 1.0)]  # repeat 2: a neighbour slowed EAGLE down
    plain = [(64, 2.5), (64, 2.5), (64, 2.5), (64, 2.5), (64, 2.0)]
    summary = summarise_repeats(eagle, plain)
    ratios = sorted([2.5, 2.5, 0.625, 60 / 64 * 2.5, 2.0])
    assert summary.speedup == pytest.approx(ratios[2]) and summary.speedup_min == pytest.approx(0.625)
    assert summary.speedup_max == pytest.approx(2.5) and summary.busy
    assert summary.eagle_speed == pytest.approx(64.0) and summary.plain_speed == pytest.approx(25.6)
    steady = summarise_repeats([(64, 1.0), (64, 1.1), (64, 1.05)], [(64, 2.5), (64, 2.6), (64, 2.4)])
    assert not steady.busy and steady.speedup_max / steady.speedup_min < BUSY_SPREAD
    just_over = summarise_repeats([(10, 1.0), (10, 1.0)], [(10, 2.0), (10, 2.0 * BUSY_SPREAD * 1.01)])
    assert just_over.busy
    with pytest.raises(ValueError, match="as many EAGLE as plain repeats"):
        summarise_repeats([(64, 1.0)], [])
    with pytest.raises(ValueError, match="at least one"):
        summarise_repeats([], [])


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class FakeTokenizer:
    chat_template = "yes"

    def apply_chat_template(self, messages, **_):
        return {"input_ids": torch.tensor([[1, 2, 3]])}

    def decode(self, ids, skip_special_tokens=True):
        return f"answer of {len(ids)} tokens"


class FakeModel:
    """EAGLE at 60 tokens/s and plain decoding at 25 (2.4x), except in the calls ``slow`` lists (counted from the
    first call), which a neighbour slows to a quarter."""

    def __init__(self, clock: FakeClock, slow=()):
        self.clock, self.slow, self.calls = clock, set(slow), []
        self.tokenizer, self.device = FakeTokenizer(), torch.device("cpu")
        self.tree_settings = types.SimpleNamespace(total_token=30, depth=5, top_k=8, lookup_tokens=0)

    def _generate(self, name, speed, input_ids, max_new_tokens, temperature=0.0, log=False):
        slowed = len(self.calls) in self.slow
        self.calls.append((name, max_new_tokens))
        self.clock.now += max_new_tokens / (speed / 4 if slowed else speed)
        ids = torch.cat([input_ids, torch.arange(max_new_tokens)[None] + 10], dim=1)
        return (ids, max_new_tokens, max_new_tokens // 3) if log else ids

    def eagenerate(self, input_ids, **options):
        return self._generate("eagle", 60.0, input_ids, **options)

    def naivegenerate(self, input_ids, **options):
        return self._generate("plain", 25.0, input_ids, **options)


def run_demo(monkeypatch, capsys, slow=(), argv=()):
    clock = FakeClock()
    model = FakeModel(clock, slow)
    monkeypatch.setattr("eagle.cli.load_model_from_args", lambda args: model)
    monkeypatch.setattr(demo, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    assert demo.main(list(argv)) == 0
    return model.calls, capsys.readouterr().out


def test_the_demo_warms_up_then_alternates_short_timed_repeats(monkeypatch, capsys):
    calls, out = run_demo(monkeypatch, capsys)
    warm_up, answers, timed = calls[:2], calls[2:4], calls[4:]
    assert warm_up == [("eagle", 8), ("plain", 8)] and answers == [("eagle", 192), ("plain", 192)]
    assert [name for name, _ in timed] == ["eagle", "plain", "plain", "eagle"] * 2 + ["eagle", "plain"]
    assert {tokens for _, tokens in timed} == {64}
    assert "=== EAGLE (192 tokens) ===\nanswer of 192 tokens" in out
    assert "EAGLE:            60.0 tokens/s" in out and "Plain decoding:   25.0 tokens/s" in out
    assert "Speed-up:         2.40x (min 2.40x, max 2.40x)" in out
    assert "Warning" not in out and "Greedy answers identical: yes" in out
    assert "Timed: 5 runs of each method, up to 64 new tokens each" in out


def test_a_neighbour_in_one_repeat_moves_the_spread_not_the_median(monkeypatch, capsys):
    calls, out = run_demo(monkeypatch, capsys, slow={6}, argv=["--repeats", "3", "--repeat-tokens", "32"])
    assert calls[6] == ("plain", 32) and len(calls) == 4 + 6
    assert "Speed-up:         2.40x (min 2.40x, max 9.60x)" in out  # plain decoding slowed: that repeat says 9.6x
    assert "Warning: the speed-up varied from 2.40x to 9.60x between repeats" in out


@pytest.mark.parametrize("flag", ["--repeats", "--repeat-tokens"])
def test_repeat_flags_must_be_positive(flag, capsys):
    with pytest.raises(SystemExit):
        demo.parse_args([flag, "0"])
    assert "must be a positive integer" in capsys.readouterr().err
