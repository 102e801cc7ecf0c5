"""The thread policy (eagle.utils.threads): on a fake machine whose step costs per thread count are known, it picks
the cheaper count, follows the machine when load comes and goes, and stays out when the user set the count; in
the real generation loop it is called around each verification step and never changes a token."""

from __future__ import annotations

import os

import pytest
import torch

from eagle.utils.threads import (
    PolicySettings, ThreadPolicy, TorchThreads, available_cpus, idle_cpu_seconds, thread_ladder, work_kind,
)


class FakeMachine:
    """A clock and a thread count in one. ``cpus`` CPUs, ``neighbours`` busy programs beside the policy's process.
    A step of ``work`` tokens at n threads takes ``cost(n, work)`` seconds; meanwhile the process gets CPU time
    ``n * share`` per second (share < 1 when n + neighbours exceed the CPUs: threads descheduled) and the CPUs
    left over sit idle."""

    def __init__(self, cost, cpus=2, threads=2, neighbours=0, idle_known=True):
        self.cost, self.cpus, self.threads, self.neighbours = cost, cpus, threads, neighbours
        self.idle_known = idle_known
        self.now = self.cpu_seconds = self.idle_seconds = 0.0
        self.sets: list[int] = []
        self.share_override = None

    def wall(self) -> float:
        return self.now

    def cpu(self) -> float:
        return self.cpu_seconds

    def idle(self):
        return self.idle_seconds if self.idle_known else None

    def get(self) -> int:
        return self.threads

    def set(self, count: int) -> None:
        self.threads = count
        self.sets.append(count)

    def step(self, policy: ThreadPolicy, work: int = 30) -> int:
        policy.step_started()
        used = self.threads
        seconds = self.cost(used, work, self.neighbours)
        runnable = used + self.neighbours
        share = self.share_override or (min(1.0, self.cpus / runnable))
        self.now += seconds
        self.cpu_seconds += seconds * used * share
        self.idle_seconds += seconds * max(0, self.cpus - runnable)
        policy.step_finished(work)
        return used

    def run(self, policy: ThreadPolicy, steps: int, work: int = 30) -> list[int]:
        return [self.step(policy, work) for _ in range(steps)]


def two_core_cost(threads: int, work: int, neighbours: int) -> float:
    """The 2-core machine of the issue: idle, 2 threads cost 0.6 of 1 thread; with a busy neighbour, 2 threads
    cost three times 1 thread (every barrier waits for the descheduled thread); 1 thread costs the same."""
    per_token = {1: 0.0020, 2: 0.0012} if neighbours == 0 else {1: 0.0020, 2: 0.0060}
    return 0.002 + per_token[threads] * work


def make_policy(machine: FakeMachine, **settings) -> ThreadPolicy:
    return ThreadPolicy(max_threads=machine.cpus, settings=PolicySettings(**settings) if settings else None,
                        clock=machine, torch_threads=machine, environ={}, default_threads=machine.threads)


def seconds_at(count: int, steps: int, work: int = 30, neighbours: int = 0) -> float:
    return steps * two_core_cost(count, work, neighbours)


# ------------------------------------------------------------------------------------------------ on a fake clock
def test_picks_one_thread_when_a_busy_neighbour_takes_a_cpu():
    machine = FakeMachine(two_core_cost, neighbours=1)
    policy = make_policy(machine)
    used = machine.run(policy, 300)
    assert policy.threads == 1 and machine.threads == 1
    half_window = PolicySettings().window // 2
    assert used[:half_window] == [2] * half_window and used.count(2) <= half_window + 4  # then a few rechecks
    assert machine.now <= seconds_at(1, 300, neighbours=1) / 0.9  # the target: >= 0.9x the best fixed count
    assert [change[1:3] for change in policy.changes] == [(2, 1)]


def test_keeps_every_thread_on_an_idle_machine_and_rechecks_less_and_less():
    machine = FakeMachine(two_core_cost)
    policy = make_policy(machine)
    used = machine.run(policy, 2000)
    assert policy.threads == 2 and not policy.changes
    assert machine.now <= seconds_at(2, 2000) * 1.02  # the rechecks cost under 2%
    tried = [i for i, count in enumerate(used) if count == 1]
    gaps = [b - a for a, b in zip(tried, tried[1:]) if b - a > 1]
    assert len(gaps) >= 3 and gaps == sorted(gaps)  # the interval doubles while the choice holds


def test_follows_the_machine_when_load_comes_and_goes():
    machine = FakeMachine(two_core_cost)
    policy = make_policy(machine)
    machine.run(policy, 200)
    assert policy.threads == 2
    machine.neighbours = 1  # the steps at 2 threads now cost about 3x: a recheck at once, not at the interval
    used = machine.run(policy, 40)
    assert policy.threads == 1 and used[-20:] == [1] * 20
    machine.neighbours = 0  # one thread costs what it did, but a CPU is idle now: back to 2
    used = machine.run(policy, 40)
    assert policy.threads == 2 and used[-20:] == [2] * 20
    assert [change[1:3] for change in policy.changes] == [(2, 1), (1, 2)]


def test_without_idle_figures_the_periodic_recheck_finds_the_freed_cpu():
    machine = FakeMachine(two_core_cost, neighbours=1, idle_known=False)
    policy = make_policy(machine)
    machine.run(policy, 300)
    assert policy.threads == 1
    machine.neighbours = 0
    start = machine.now
    while policy.threads == 1 and machine.now - start < 200:
        machine.step(policy)
    assert policy.threads == 2 and machine.now - start <= PolicySettings().max_interval_s + 1


def test_a_much_slower_count_is_retried_seldom_enough_to_cost_under_the_overhead():
    """On a heavily loaded machine a step at 2 threads can cost many times one at 1 thread (30x here): each recheck
    loses 29 steps' time, so the rechecks are spaced to keep that within the overhead budget (2% of the
    generation), not at the plain doubling interval (4, 8, 16... seconds), which would lose about 6% here."""
    def cost(threads, work, neighbours):
        return 0.002 * work * (30 if threads == 2 else 1)

    machine = FakeMachine(cost, neighbours=1)
    policy = make_policy(machine)
    used = []
    while machine.now < 150:
        used.append(machine.step(policy))
    first_switch = used.index(1)
    retries = used[first_switch:].count(2)
    assert policy.threads == 1 and retries >= 1
    lost = retries * (cost(2, 30, 1) - cost(1, 30, 1))
    assert lost <= 1.5 * PolicySettings().overhead * (machine.now - first_switch * cost(2, 30, 1))


def test_descheduled_threads_bring_the_recheck_forward():
    """The step cost barely moves but the process's threads get half the CPU time they got: the policy tries the
    other count at the end of the window instead of waiting for the interval."""
    machine = FakeMachine(two_core_cost)
    policy = make_policy(machine)
    machine.run(policy, 100)
    machine.sets.clear()
    due = policy._next_check
    machine.share_override = 0.45
    while not machine.sets:
        machine.step(policy)
    assert machine.now < due and machine.sets[0] == 1


def run_until_due(machine: FakeMachine, policy: ThreadPolicy, cost) -> list[int]:
    """The steps from now until the next periodic recheck is due, each at ``cost``; the counts they ran at."""
    machine.cost, due, used = cost, policy._next_check, []
    while machine.now < due - 1:
        used.append(machine.step(policy))
    return used


def test_more_load_at_one_thread_does_not_retry_more_threads():
    """At one thread a second neighbour makes steps dearer: more threads would only wait longer, so nothing is
    tried before the periodic recheck."""
    machine = FakeMachine(two_core_cost, neighbours=1)
    policy = make_policy(machine)
    machine.run(policy, 400)
    assert policy.threads == 1
    used = run_until_due(machine, policy, lambda n, work, neighbours: 2 * two_core_cost(n, work, 1))
    assert len(used) > 3 * PolicySettings().window and set(used) == {1}


def test_a_short_burst_of_load_is_not_a_change():
    """Load lasting one window (a program starting up) does not start a recheck; load that lasts does."""
    machine = FakeMachine(two_core_cost)
    policy = make_policy(machine)
    machine.run(policy, 400)
    window = PolicySettings().window
    while policy._window.steps:  # to the start of a window: the burst fills exactly one
        machine.step(policy)

    def slow(threads, work, neighbours):
        return 3 * two_core_cost(threads, work, 0)

    machine.sets.clear()
    machine.cost = slow
    burst = machine.run(policy, window)
    rest = run_until_due(machine, policy, two_core_cost)
    assert set(burst + rest) == {2} and not machine.sets
    machine.cost = slow
    assert 1 in machine.run(policy, 3 * window)


@pytest.mark.parametrize("neighbours, best", [(1, 1), (0, 2)])
def test_compares_only_steps_of_like_work(neighbours, best):
    """EAGLE steps (30 tokens) and plain decoding steps (1 token) alternate, their costs per token 10x apart: the
    policy still finds the cheaper count for both (compared across kinds, an EAGLE step at 2 threads would look
    cheaper than a plain one at 1, and the count of the kind that happened to be tried would win)."""
    def cost(threads, work, neighbours):  # per token: 0.021 s for a plain step, 0.0017 s for an EAGLE step
        return (0.02 + 0.001 * work) * ({1: 1.0, 2: 0.6} if neighbours == 0 else {1: 1.0, 2: 3.0})[threads]

    machine = FakeMachine(cost, neighbours=neighbours)
    policy = make_policy(machine, first_interval_s=0.2, max_interval_s=0.5)  # rechecks that straddle both kinds
    used = []
    for _ in range(100):
        used += machine.run(policy, 3, work=30) + machine.run(policy, 2, work=1)
    assert policy.threads == best and used[-100:].count(best) >= 90
    assert work_kind(30) == work_kind(17) != work_kind(1) == work_kind(0.5)


def test_a_prefill_sized_step_in_a_recheck_is_not_counted():
    """A recheck of 1 thread sees a 500-token step (a joining prompt), far cheaper per token than a verification
    step; it is not compared with the verification steps, so 1 thread is not taken on the strength of it."""
    def cost(threads, work, neighbours):
        return 0.1 if work > 64 else two_core_cost(threads, work, neighbours)

    machine = FakeMachine(cost)
    policy = make_policy(machine, probe_steps=2)
    machine.run(policy, PolicySettings().window // 2)  # half a window: the first recheck is due and starts
    assert policy._probe is not None
    assert machine.step(policy, work=500) == 1  # tried at 1 thread, not counted
    machine.run(policy, 2)
    assert policy.threads == 2 and not policy.changes


def test_climbs_the_ladder_on_a_larger_machine():
    """16 CPUs, 10 of them taken: the best count is 6; from torch's 16 the policy walks down the ladder."""
    def cost(threads, work, neighbours):
        return 0.001 * work / min(threads, 6) * (1 + 0.5 * max(0, threads - 6))

    machine = FakeMachine(cost, cpus=16, threads=16, neighbours=10)
    policy = make_policy(machine)
    machine.run(policy, 600)
    assert policy.threads == 6
    assert thread_ladder(16) == [1, 2, 3, 4, 5, 6, 7, 8, 12, 16]


def test_the_ladder_and_the_settings():
    assert thread_ladder(1) == [1] and thread_ladder(2) == [1, 2]
    assert thread_ladder(40)[-4:] == [16, 24, 32, 40] and thread_ladder(9) == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    for bad in (dict(window=1), dict(probe_steps=0), dict(first_interval_s=0), dict(max_interval_s=1),
                dict(give_up_ratio=1.0), dict(switch_margin=1.0)):
        with pytest.raises(ValueError, match="PolicySettings"):
            PolicySettings(**bad)


# --------------------------------------------------------------------------------------------- the user wins
def test_an_explicit_thread_count_wins():
    machine = FakeMachine(two_core_cost, neighbours=1)
    policy = make_policy(machine)
    machine.run(policy, 100)
    assert policy.threads == 1
    machine.threads = 2  # torch.set_num_threads(2) by the user
    machine.sets.clear()
    assert machine.run(policy, 200) == [2] * 200 and not machine.sets
    assert "set to 2" in policy.stayed_out and not policy.active
    policy.resume()  # a benchmark that changed it on purpose hands it back
    assert policy.active and machine.sets == [1]
    machine.run(policy, 50)
    assert machine.threads == 1


@pytest.mark.parametrize("environ, threads, default, cpus, reason", [
    ({"OMP_NUM_THREADS": "2"}, 2, 2, 2, "OMP_NUM_THREADS is set"),
    ({"MKL_NUM_THREADS": "1"}, 2, 2, 2, "MKL_NUM_THREADS is set"),
    ({}, 1, 2, 2, "set by the user"),  # torch.set_num_threads(1) before the model was made
    ({}, 1, 1, 1, "one CPU"),
])
def test_stays_out_when_the_count_is_pinned(environ, threads, default, cpus, reason):
    machine = FakeMachine(two_core_cost, cpus=cpus, threads=threads, neighbours=1 if threads == 2 else 0)
    policy = ThreadPolicy(max_threads=cpus, clock=machine, torch_threads=machine, environ=environ,
                          default_threads=default)
    assert reason in policy.stayed_out
    assert machine.run(policy, 200) == [threads] * 200 and not machine.sets
    policy.resume()
    assert not policy.active and not machine.sets  # resume() does not override a pinned count
    assert ThreadPolicy(max_threads=2, clock=machine, torch_threads=machine, environ={"OMP_NUM_THREADS": ""},
                        default_threads=threads).stayed_out != "OMP_NUM_THREADS is set"  # empty: not set


def test_the_machine_readings():
    assert available_cpus() >= 1
    if not os.path.exists("/proc/stat"):
        assert idle_cpu_seconds() is None
        return
    first = idle_cpu_seconds()
    assert isinstance(first, float) and 0 <= first <= idle_cpu_seconds()
    assert idle_cpu_seconds(cpus={10 ** 6}) is None  # no such CPU


# ------------------------------------------------------------------------------------- in the generation loop
class Recorder:
    """A policy that records the loop's calls."""

    def __init__(self):
        self.calls = []

    def step_started(self):
        self.calls.append("started")

    def step_finished(self, work):
        self.calls.append(work)


def test_the_loop_calls_the_policy_around_each_verification_step(tiny_model):
    ids = torch.tensor([[1, 40, 41, 42, 43, 44]])
    saved = tiny_model.thread_policy
    try:
        for use_eagle in (True, False):
            tiny_model.thread_policy = recorder = Recorder()
            steps = list(tiny_model.generate_steps(ids, max_new_tokens=10, use_eagle=use_eagle))
            calls = recorder.calls
            assert calls[::2] == ["started"] * (len(steps) - 1)  # every step after the prefill
            works = calls[1::2]
            assert len(works) == len(steps) - 1
            if use_eagle:
                assert all(1 < work <= 12 for work in works)  # the tree's nodes (total_token 12)
            else:
                assert works == [1] * len(works)
        tiny_model.thread_policy = recorder = Recorder()
        batch = tiny_model.continuous_batch()
        batch.add(ids[0], max_new_tokens=6)
        batch.add(ids[0, :4], max_new_tokens=6)
        updates = list(batch)
        assert recorder.calls and recorder.calls.count("started") < len(updates)  # prefills are not timed
    finally:
        tiny_model.thread_policy = saved


def test_from_pretrained_turns_the_policy_on_and_off(tiny_pair):
    from eagle.model.ea_model import EaModel

    base, head = tiny_pair
    options = dict(base_model_path=str(base), ea_model_path=str(head), total_token=6, depth=2, top_k=2)
    assert isinstance(EaModel.from_pretrained(**options).thread_policy, ThreadPolicy)
    assert EaModel.from_pretrained(**options, thread_policy=False).thread_policy is None
    with pytest.raises(ValueError, match="thread_policy must be True or False"):
        EaModel.from_pretrained(**options, thread_policy="off")


class Alternating:
    """A policy that changes the thread count before every step: 1, 2, 1, 2..."""

    def __init__(self):
        self.count, self.seen = 0, set()

    def step_started(self):
        self.count += 1
        torch.set_num_threads(1 + self.count % 2)
        self.seen.add(torch.get_num_threads())

    def step_finished(self, work):
        pass


class CountingThreads(TorchThreads):
    def __init__(self):
        self.counts = []

    def set(self, count):
        self.counts.append(count)
        super().set(count)


@pytest.fixture(scope="module")
def default_model():
    from eagle.model.ea_model import EaModel

    return EaModel.from_pretrained()


@pytest.mark.e2e  # the embedded pair, the thread count changed before every step
@pytest.mark.skipif(available_cpus() < 2, reason="thread counts differ only with 2 CPUs or more")
def test_thread_changes_between_steps_leave_every_token_alone(default_model):
    """The embedded pair, greedy: EAGLE and plain decoding give the same tokens with the count fixed, changed
    before every step, and chosen by a policy set to recheck all the time."""
    model, tokenizer = default_model, default_model.tokenizer
    prompts = ["Explain why the sky is blue.", "Name a sea."]
    ids = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True)["input_ids"] for p in prompts]
    previous = torch.get_num_threads()

    def answers():
        single = [(model.eagenerate(i, max_new_tokens=32), model.naivegenerate(i, max_new_tokens=32)) for i in ids[:1]]
        return single, model.eagenerate([i[0] for i in ids], max_new_tokens=16)

    try:
        model.thread_policy = None
        torch.set_num_threads(1)  # (one thread: the cheap reference on a loaded machine)
        reference = answers()
        model.thread_policy = alternating = Alternating()
        assert _same(answers(), reference) and alternating.seen == {1, 2}
        threads = CountingThreads()
        torch.set_num_threads(2)
        model.thread_policy = ThreadPolicy(max_threads=2, torch_threads=threads, environ={}, default_threads=2,
                                           settings=PolicySettings(window=2, probe_steps=1, give_up_ratio=100,
                                                                   switch_margin=0, first_interval_s=1e-6,
                                                                   max_interval_s=1e-6))
        assert _same(answers(), reference) and 1 in threads.counts
    finally:
        model.thread_policy = None
        torch.set_num_threads(previous)


def _same(a, b) -> bool:
    (single_a, batch_a), (single_b, batch_b) = a, b
    return all(torch.equal(x, y) for pair_a, pair_b in zip(single_a, single_b) for x, y in zip(pair_a, pair_b)) \
        and torch.equal(batch_a, batch_b)
