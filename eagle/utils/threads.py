"""Choosing torch's intra-op thread count for the generation loop as the machine is now, not as ``os.cpu_count()``
says.

A decoding step runs thousands of small parallel regions, each ending at a barrier. When another program takes
one of the CPUs, the thread the scheduler took away holds up every barrier: on the 2-core machine this project
measures on, with one Python busy loop beside it, two threads ran a step about three times slower than one
thread did. How many threads are fastest therefore depends on what else runs, and that changes while a server
lives.

:class:`ThreadPolicy` is called by the generation loop around each verification step
(:meth:`~ThreadPolicy.step_started`, :meth:`~ThreadPolicy.step_finished` with the step's work, the tokens its
target forward carried). It keeps one thread count (at first torch's own) and, at a modest interval, tries the
neighbouring counts on a ladder (1, 2, ... up to the CPUs this process may run on, ``os.sched_getaffinity``) for
a few steps each; it keeps the count whose steps cost least per unit of work, comparing only steps of like work
(a prefill or a batch of another size is not a verification step of one row). A count that is clearly worse is
dropped after one step. While its choice holds, the interval doubles (up to two minutes of generation), and it is
stretched so that rechecks cost at most 2% of the generation time (trying two threads where they are ten times
slower loses nine steps' time); it rechecks sooner when the machine changes under it for two windows of steps in
a row, and only towards the counts the change could favour: fewer threads when its steps cost much more than when
it chose or its threads get a smaller share of CPU time than they did (they are being descheduled), more when its
steps cost much less or CPUs it could use became idle.

The user always wins: with ``OMP_NUM_THREADS`` or ``MKL_NUM_THREADS`` set, with a thread count other than torch's
default when the policy is made, or once the count differs from what the policy last set in that thread (an
explicit ``torch.set_num_threads``), the policy stays out for good (``stayed_out`` says why; ``resume()`` hands
the count back to it after a change made on purpose, as the benchmark's fixed counts do).
``EaModel.from_pretrained(thread_policy=False)`` turns it off.

It is meant to change nothing but speed: the embedded pair gives the same greedy tokens whatever the thread count
and however often it changes between steps (tested on this project's CPU; a kernel whose rounding depended on its
thread count could only ever move a numerical near-tie). ``torch.set_num_threads`` applies to the calling thread's
OpenMP pool (see :mod:`eagle.utils.openmp`), so the policy acts in the thread that generates (a server's model
worker). ``EaModel`` makes one for a model on the CPU only: elsewhere the CPU threads do not carry the step.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

PINNING_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclass(frozen=True)
class PolicySettings:
    """How the policy measures.

    - ``window``: steps at the chosen count a recheck compares with (the median of the last ones of like work);
      half of it must be measured before a recheck starts;
    - ``probe_steps``: steps each other count is tried for;
    - ``give_up_ratio``: a tried count whose step costs this many times the chosen count's is dropped at once;
    - ``switch_margin``: another count is taken only when it is at least this much cheaper (0.05 = 5%);
    - ``first_interval_s``, ``max_interval_s``: seconds of generation (steps timed) between rechecks after a
      change, doubling while the choice holds, up to the maximum;
    - ``overhead``: the most a recheck that keeps the choice may cost, as a fraction of the generation time
      until the next one (the interval is lengthened to keep it so: a count ten times slower, as two threads
      can be on a loaded machine, is retried less often);
    - ``changed_ratio``: a step cost or CPU share that moved by this factor since the choice, or
      ``idle_cpus_rise`` more idle CPUs than then, starts a recheck at once (within the overhead).
    """

    window: int = 6
    probe_steps: int = 2
    give_up_ratio: float = 1.5
    switch_margin: float = 0.05
    first_interval_s: float = 4.0
    max_interval_s: float = 120.0
    overhead: float = 0.02
    changed_ratio: float = 1.4
    idle_cpus_rise: float = 0.5

    def __post_init__(self):
        if self.window < 2 or self.probe_steps < 1:
            raise ValueError(f"PolicySettings: window must be >= 2 and probe_steps >= 1, got {self.window} and "
                             f"{self.probe_steps}.")
        if not 0 < self.first_interval_s <= self.max_interval_s:
            raise ValueError("PolicySettings: expected 0 < first_interval_s <= max_interval_s, got "
                             f"{self.first_interval_s} and {self.max_interval_s}.")
        if self.give_up_ratio <= 1 or self.changed_ratio <= 1 or not 0 <= self.switch_margin < 1 \
                or not 0 < self.overhead < 1:
            raise ValueError("PolicySettings: give_up_ratio and changed_ratio must be > 1, switch_margin in [0, 1) "
                             "and overhead in (0, 1).")


# ------------------------------------------------------------------------------------------ what the machine says
def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask), else ``os.cpu_count()``."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def torch_default_threads() -> int:
    """The intra-op thread count torch starts with when nothing sets it: the machine's physical cores (what torch
    asks cpuinfo for), read from ``/sys`` where it can be, else ``os.cpu_count()``."""
    cores, processors = set(), 0
    for topology in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology"):
        try:
            with open(os.path.join(topology, "physical_package_id")) as package, \
                    open(os.path.join(topology, "core_id")) as core:
                cores.add((package.read().strip(), core.read().strip()))
            processors += 1
        except OSError:
            continue
    if 0 < len(cores) < processors:
        return len(cores)
    return os.cpu_count() or 1


def idle_cpu_seconds(cpus=None) -> float | None:
    """Seconds the CPUs ``cpus`` (default: this process's) have spent idle since boot (``/proc/stat``: idle +
    iowait), or None where that is not known (not Linux)."""
    if cpus is None:
        cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, AttributeError):
        return None
    total, found = 0, False
    for line in lines:
        fields = line.split()
        if not fields or not fields[0].startswith("cpu") or not fields[0][3:].isdigit() or len(fields) < 6:
            continue
        if cpus is None or int(fields[0][3:]) in cpus:
            total, found = total + int(fields[4]) + int(fields[5]), True
    return total / ticks if found else None


class SystemClock:
    """What the policy reads: wall seconds, the process's CPU seconds (all its threads), and the idle CPU seconds
    of the CPUs it may run on (None where unknown). Tests pass a fake one."""

    def wall(self) -> float:
        return time.perf_counter()

    def cpu(self) -> float:
        return time.process_time()

    def idle(self) -> float | None:
        return idle_cpu_seconds()


class TorchThreads:
    """torch's intra-op thread count of the calling thread. Tests pass a fake one."""

    def get(self) -> int:
        return torch.get_num_threads()

    def set(self, count: int) -> None:
        torch.set_num_threads(count)


def thread_ladder(most: int) -> list[int]:
    """The counts the policy moves between: every count up to 8, then about 1.5x apart (12, 16, 24, 32...), and
    ``most`` itself."""
    counts, step = set(range(1, min(most, 8) + 1)), 8
    while step < most:
        counts.update({step, step + step // 2})
        step *= 2
    return sorted({c for c in counts if c <= most} | {most})


def work_kind(work: float) -> int:
    """Steps whose work (tokens through the target) is within the same power of two are compared."""
    return int(math.log2(max(work, 1)))


# ---------------------------------------------------------------------------------------------------- the policy
@dataclass
class _Window:
    """The chosen count's recent steps: costs (seconds per unit of work) per kind of work, and the CPU the
    process got over them."""

    costs: dict
    size: int
    cpu: float = 0.0
    thread_seconds: float = 0.0
    steps: int = 0

    def add(self, kind: int, cost: float, cpu: float, thread_seconds: float) -> None:
        self.costs.setdefault(kind, deque(maxlen=self.size)).append(cost)
        self.cpu, self.thread_seconds, self.steps = self.cpu + cpu, self.thread_seconds + thread_seconds, self.steps + 1

    def cost(self, kind: int) -> float | None:
        """The median cost of this kind of step, once half a window of them was measured."""
        costs = self.costs.get(kind)
        return statistics.median(costs) if costs and len(costs) >= max(2, self.size // 2) else None

    def share(self) -> float | None:
        """CPU seconds the process got per second per thread it ran (1.0: never descheduled)."""
        return self.cpu / self.thread_seconds if self.thread_seconds > 0 else None


@dataclass
class _Probe:
    """A recheck in progress: the counts still to try, and each tried count's mean cost relative to the chosen
    count's (same kind of work)."""

    queue: list
    results: dict
    samples: list
    lost: float = 0.0  # seconds beyond what the chosen count would have taken
    seconds: dict = field(default_factory=dict)  # count -> seconds of its steps


class ThreadPolicy:
    """Picks torch's intra-op thread count for the generation loop (see the module docstring).

    ``loop``: call :meth:`step_started` before each verification step and :meth:`step_finished` (its work: the
    tokens its target forward carried) after it, in the thread that generates. ``threads``: the count it runs
    with (its choice); ``stayed_out``: why it does not act (None while it does); ``changes``: its recent
    decisions, ``(seconds of generation it had timed, from, to, why)``.
    """

    def __init__(self, max_threads: int | None = None, settings: PolicySettings | None = None, clock=None,
                 torch_threads=None, environ=None, default_threads: int | None = None):
        self.settings = settings or PolicySettings()
        self.clock = clock or SystemClock()
        self.torch_threads = torch_threads or TorchThreads()
        self.max_threads = max_threads or available_cpus()
        self.threads = self._start = self.torch_threads.get()
        self.ladder = sorted(set(thread_ladder(self.max_threads)) | {self.threads})
        self.changes: deque = deque(maxlen=64)
        self.stayed_out = self._reason_to_stay_out(os.environ if environ is None else environ, default_threads)
        self._overridden = False  # stayed out because the count was set: resume() may bring it back
        self._set_here = threading.local()  # the count this policy last set in each thread
        self._last_set: int | None = None
        self._interval = self.settings.first_interval_s
        self._elapsed = 0.0  # seconds of the steps timed: the clock of the rechecks
        self._next_check = -math.inf  # the first recheck comes once half a window is measured
        self._earliest = 0.0  # no recheck, however the machine changed, before this (the overhead budget)
        self._continue: int | None = None  # after a change, the next count in the same direction
        self._reset_window()
        self._probe: _Probe | None = None
        self._step: tuple | None = None
        if self.stayed_out:
            logger.debug("Thread policy stays out: %s", self.stayed_out)

    def _reason_to_stay_out(self, environ, default_threads: int | None) -> str | None:
        pinned = [name for name in PINNING_VARIABLES if environ.get(name, "").strip()]
        if pinned:
            return f"{pinned[0]} is set"
        if self.max_threads < 2:
            return "one CPU available"
        default = torch_default_threads() if default_threads is None else default_threads
        if self.threads != default:
            return f"torch runs {self.threads} threads, not its default {default}: set by the user"
        return None

    @property
    def active(self) -> bool:
        return self.stayed_out is None

    # ------------------------------------------------------------------------------------------ the loop's calls
    def step_started(self) -> None:
        """Before a step: stay out if the user changed the thread count, else run the count the policy wants."""
        if self.stayed_out is not None:
            return
        current = self.torch_threads.get()
        expected = getattr(self._set_here, "count", None)
        if current != expected and (expected is not None or current not in (self.threads, self._last_set,
                                                                            self._start)):
            self.stayed_out = f"the thread count was set to {current} (torch.set_num_threads)"
            self._overridden, self._probe = True, None
            logger.debug("Thread policy stays out: %s", self.stayed_out)
            return
        count = self._probe.queue[0] if self._probe is not None else self.threads
        if count != current:
            self._apply(count)
        self._step = (count, self.clock.wall(), self.clock.cpu())

    def step_finished(self, work: float) -> None:
        """After a step that carried ``work`` (tokens through the target forward, > 0)."""
        if self.stayed_out is not None or self._step is None:
            return
        count, wall, cpu = self._step
        self._step = None
        seconds, cpu_seconds = self.clock.wall() - wall, self.clock.cpu() - cpu
        if seconds <= 0 or work <= 0:
            return
        kind, cost = work_kind(work), seconds / work
        self._elapsed += seconds
        if self._probe is not None:
            self._probe_step(kind, cost, seconds)
        else:
            self._window.add(kind, cost, cpu_seconds, seconds * count)
            self._maybe_recheck(kind)

    def resume(self) -> None:
        """Set the calling thread's count back to the policy's choice, after it was changed on purpose (a benchmark
        comparing fixed counts): the policy acts again, unless the environment pins the count."""
        if self.stayed_out is not None and not self._overridden:
            return
        self.stayed_out, self._overridden = None, False
        self._apply(self.threads)

    # ---------------------------------------------------------------------------------------------- internals
    def _apply(self, count: int) -> None:
        self.torch_threads.set(count)
        self._set_here.count = self._last_set = count

    def _reset_window(self) -> None:
        """A new window at the chosen count, after a decision: its first full window sets ``_decided`` (costs per
        kind, CPU share, idle CPUs), what later windows are compared with."""
        self._window = _Window({}, self.settings.window)
        self._window_start = (self.clock.wall(), self.clock.idle())
        self._decided = None
        self._change = None  # the change the last full window saw
    def _idle_cpus(self) -> float | None:
        wall, idle = self._window_start
        now, idle_now = self.clock.wall(), self.clock.idle()
        if idle is None or idle_now is None or now <= wall:
            return None
        return (idle_now - idle) / (now - wall)

    def _maybe_recheck(self, kind: int) -> None:
        """After a step at the chosen count: start a recheck when it is due or the machine changed."""
        reference = self._window.cost(kind)
        if reference is None:
            return
        if self._decided is None:  # the first window after a choice: what the next ones are compared with
            if self._window.steps >= self.settings.window:
                self._decided = ({kind: reference}, self._window.share(), self._idle_cpus())
        due = self._elapsed >= self._next_check
        change = None if due else self._machine_changed(kind, reference)
        if self._window.steps >= self.settings.window and not due:  # a change counts when two windows see it
            confirmed = change is not None and self._change is not None and change[1] == self._change[1]
            change, self._change = (change if confirmed else None), change
            self._roll_window()
        if not due and (change is None or self._elapsed < self._earliest):
            return
        reason, direction = ("due", 0) if due else change
        queue = self._candidates(direction)
        if not queue:
            return
        logger.debug("Thread policy: recheck (%s) of %d threads against %s", reason, self.threads, queue)
        self._probe = _Probe(queue, {}, [])

    def _roll_window(self) -> None:
        """After a full window: keep its costs, measure the CPU share and idle CPUs afresh."""
        costs = self._window.costs
        self._window = _Window(costs, self.settings.window)
        self._window_start = (self.clock.wall(), self.clock.idle())

    def _machine_changed(self, kind: int, cost: float) -> tuple[str, int] | None:
        """How the machine looks different from when the count was chosen, over a full window: (what, the
        direction worth trying: -1 fewer threads, +1 more), or None."""
        if self._decided is None or self._window.steps < self.settings.window:
            return None
        costs, share, idle = self._decided
        ratio = self.settings.changed_ratio
        before = costs.get(kind)
        if before is not None and cost > before * ratio:  # more load: fewer threads may wait less
            return "steps cost more", -1
        now_share = self._window.share()
        if share and now_share is not None and now_share < share / ratio:
            return "threads descheduled more", -1
        if before is not None and cost < before / ratio:  # less load: more threads may pay again
            return "steps cost less", 1
        now_idle = self._idle_cpus()
        if idle is not None and now_idle is not None and now_idle > idle + self.settings.idle_cpus_rise:
            return "idle CPUs", 1
        return None

    def _candidates(self, direction: int = 0) -> list[int]:
        """The counts a recheck tries: the next one in the direction of the last change, else the neighbours of
        the chosen count on the ladder (0: both; -1: the one below; +1: the one above)."""
        if self._continue is not None:
            return [self._continue]
        at = self.ladder.index(self.threads)
        sides = {0: (at - 1, at + 1), -1: (at - 1,), 1: (at + 1,)}[direction]
        return [self.ladder[i] for i in sides if 0 <= i < len(self.ladder)]

    def _probe_step(self, kind: int, cost: float, seconds: float) -> None:
        probe = self._probe
        count = probe.queue[0]
        reference = self._window.cost(kind)  # the chosen count's (its window does not change meanwhile)
        if reference is None:  # no step of this kind at the chosen count to compare with: not counted
            return
        relative = cost / reference
        probe.samples.append(relative)
        probe.lost += seconds * (1 - 1 / relative)
        probe.seconds.setdefault(count, []).append(seconds)
        if relative > self.settings.give_up_ratio or len(probe.samples) >= self.settings.probe_steps:
            probe.results[count] = statistics.fmean(probe.samples)
            probe.queue.pop(0)
            probe.samples = []
        if not probe.queue:
            self._decide(probe.results)

    def _switch(self, best: int, why: str, retry_loss: float) -> None:
        """Take ``best`` threads; the next recheck continues in the same direction at once, or comes after the
        first interval, stretched to keep a retry of the count left behind (``retry_loss`` seconds a step) within
        the overhead budget."""
        previous, self.threads, now = self.threads, best, self._elapsed
        self.changes.append((now, previous, best, why))
        logger.debug("Thread policy: %d -> %d threads (%s)", previous, best, why)
        at = self.ladder.index(best)
        beyond = at + (1 if best > previous else -1)
        self._continue = self.ladder[beyond] if 0 <= beyond < len(self.ladder) else None
        self._interval = min(max(self.settings.first_interval_s, retry_loss / self.settings.overhead),
                             self.settings.max_interval_s)
        self._next_check = -math.inf if self._continue is not None else now + self._interval
        self._reset_window()
        self._apply(best)

    def _decide(self, results: dict) -> None:
        """End of a recheck: switch to the cheapest tried count if it beats the chosen one by the margin."""
        probe, self._probe = self._probe, None
        best = min(results, key=results.get)
        now = self._elapsed
        if results[best] < 1 - self.settings.switch_margin:
            # retrying the count left behind would lose about this much per step while the machine stays so
            retry_loss = statistics.fmean(probe.seconds[best]) * (1 / results[best] - 1)
            self._switch(best, f"{results[best]:.2f}x the cost per step", retry_loss)
            return
        lost = probe.lost
        self._continue = None
        budget = lost / self.settings.overhead  # generation time over which this recheck's cost is the overhead
        self._interval = min(max(self._interval * 2, budget), self.settings.max_interval_s)
        self._next_check, self._earliest = now + self._interval, now + min(budget, self.settings.max_interval_s)
        self._reset_window()


class _NoThreadPolicy:
    """Leaves the thread count alone (what the loop calls when no policy is given)."""

    def step_started(self) -> None:
        pass

    def step_finished(self, work: float) -> None:
        pass


NO_THREAD_POLICY = _NoThreadPolicy()
