"""The benchmark under load and at chosen thread counts: ``--busy N`` and ``--threads 1,2,policy``.

``--busy N`` starts N busy processes of the benchmark's own (a Python busy loop each, at normal priority, as any
other program a user runs beside it) before the warm-up and stops them after the last timed call, also on Ctrl-C
or an error; each also ends by itself should the benchmark die (it watches its parent). The report records them:
how many, the CPU time each got, the load average before and after.

``--threads`` runs every method once per setting, question by question and interleaved like the methods, so the
settings meet the same load: a number is that fixed torch thread count (the thread policy off), ``policy`` every
default (the engine's methods with its thread policy, see :mod:`eagle.utils.threads`; the Hugging Face methods,
which it does not steer, at torch's default count). A method run at a setting is named ``method@setting`` in the
results (``eagle@1``, ``plain@policy``). The report's thread section reads off the policy's speed against the best
fixed count of each method.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import torch

logger = logging.getLogger(__name__)

POLICY = "policy"
# A Python busy loop that ends once its parent (the benchmark) is gone; Ctrl-C is left to the benchmark, which
# stops it.
BUSY_LOOP = """import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
parent = int(sys.argv[1])
while os.getppid() == parent:
    for _ in range(200000):
        pass
"""


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux ``/proc``), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _load_average() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


class BusyProcesses:
    """``count`` busy processes from ``__enter__`` to ``__exit__`` (always stopped there); :meth:`record` says what
    they were."""

    def __init__(self, count: int):
        if count < 0:
            raise ValueError(f"--busy must be >= 0, got {count}.")
        self.count = count
        self.processes: list[subprocess.Popen] = []
        self._record = {"processes": count}
        self._previous_handler = None

    def __enter__(self) -> "BusyProcesses":
        if not self.count:
            return self
        self._record["load_average_before"] = _load_average()
        self._started = time.monotonic()
        self._previous_handler = _stop_on_sigterm()
        try:
            for _ in range(self.count):
                self.processes.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())],
                                                       stdin=subprocess.DEVNULL))
        except BaseException:
            self.stop()
            raise
        logger.info("Started %d busy process%s (Python busy loops, normal priority)", self.count,
                    "es" * (self.count != 1))
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every busy process (idempotent), recording the CPU time each got."""
        if not self.processes:
            return
        wall = time.monotonic() - self._started
        cpu = [_cpu_seconds(p.pid) for p in self.processes]
        self._record["load_average_after"] = _load_average()
        for process in self.processes:
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._record.update(seconds=round(wall, 2),
                            cpu_share=[None if c is None else round(c / wall, 3) for c in cpu] if wall > 0 else None)
        logger.info("Stopped the busy processes")
        self.processes = []
        if self._previous_handler is not None:
            signal.signal(signal.SIGTERM, self._previous_handler)

    def record(self) -> dict:
        """``{"processes": N}`` and, when N > 0: seconds they ran, the CPU share each got (CPU seconds per second),
        the load average before and after."""
        return dict(self._record)


def parse_thread_settings(text: str | None) -> list[str]:
    """``"1,2,policy"`` -> ``["1", "2", "policy"]`` (duplicates dropped); ``[]`` for None."""
    if text is None:
        return []
    settings = [part.strip() for part in text.split(",") if part.strip()]
    for setting in settings:
        if setting != POLICY and not (setting.isdigit() and int(setting) > 0):
            raise SystemExit(f"--threads: expected positive thread counts and/or '{POLICY}', separated by commas "
                             f"(e.g. 1,2,{POLICY}), got {setting!r}.")
    if not settings:
        raise SystemExit(f"--threads: empty list; e.g. 1,2,{POLICY}.")
    return list(dict.fromkeys(settings))


def split_variant(key: str) -> tuple[str, str | None]:
    """``"eagle@1"`` -> ``("eagle", "1")``; a method without a setting -> ``(method, None)``."""
    method, _, setting = key.partition("@")
    return method, setting or None


def expand_variants(methods: list[str], settings: list[str], fixed: tuple[str, ...] = ()) -> list[str]:
    """Every method at every setting, ``method@setting`` (none when ``settings`` is empty); ``fixed`` methods (with
    their own thread flag: llama.cpp) run once, as they are."""
    if not settings:
        return list(methods)
    return [m if m in fixed else f"{m}@{s}" for m in methods for s in ([None] if m in fixed else settings)]


def variant_label(label: str, setting: str | None) -> str:
    if setting is None:
        return label
    return f"{label}, {'thread policy' if setting == POLICY else setting + ' thread' + 's' * (setting != '1')}"


class ThreadSettings:
    """Applies a ``--threads`` setting before a timed call: a fixed count (the model's thread policy detached), or
    ``policy`` (the policy attached again, at the count it had chosen; without one, torch's count at start)."""

    def __init__(self, model):
        self.model = model
        self.policy = getattr(model, "thread_policy", None)
        self.default = torch.get_num_threads()

    def apply(self, setting: str | None, engine: bool = True) -> None:
        """Before a call at ``setting`` of a method the engine runs (``engine``) or not (Hugging Face's)."""
        if setting is None:
            return
        if setting == POLICY:
            self.model.thread_policy = self.policy
            if self.policy is not None and engine:
                self.policy.resume()  # its own choice again (nothing where OMP_NUM_THREADS pins the count)
            if self.policy is None or not self.policy.active or not engine:
                torch.set_num_threads(self.default)
            return
        self.model.thread_policy = None
        torch.set_num_threads(int(setting))

    def restore(self) -> None:
        self.apply(POLICY)

    def record(self) -> dict:
        """The policy's state for the report: the count it chose, its decisions, or why it stayed out."""
        policy = self.policy
        if policy is None:
            return {"thread_policy": "off"}
        return {"thread_policy": "stayed out: " + policy.stayed_out if policy.stayed_out else "on",
                "policy_threads": policy.threads, "policy_changes": len(policy.changes),
                "torch_default_threads": self.default}


def thread_comparison(totals: dict) -> dict:
    """Per method run at several ``--threads`` settings: tokens/s at each, the best fixed count, and the policy's
    speed over the best fixed count's (the issue's target: >= 0.9 under one busy process)."""
    by_method: dict[str, dict] = {}
    for key, row in totals.items():
        method, setting = split_variant(key)
        if setting is not None:
            by_method.setdefault(method, {})[setting] = row["tokens_per_s"]
    comparison = {}
    for method, speeds in by_method.items():
        fixed = {s: v for s, v in speeds.items() if s != POLICY and v is not None}
        best = max(fixed, key=fixed.get) if fixed else None
        policy = speeds.get(POLICY)
        comparison[method] = {
            "tokens_per_s": speeds, "best_fixed": best,
            "policy_vs_best_fixed": policy / fixed[best] if best is not None and policy is not None else None,
        }
    return comparison


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def _stop_on_sigterm():
    """While busy processes run, SIGTERM raises ``KeyboardInterrupt`` in the main thread, so that the ``finally``
    that stops them runs when the benchmark is terminated. Returns the handler it replaced (None where it cannot
    be replaced: not the main thread; the busy processes still end with their parent)."""
    try:
        return signal.signal(signal.SIGTERM, _interrupt)
    except ValueError:
        return None
