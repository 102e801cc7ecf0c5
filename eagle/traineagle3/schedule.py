"""The trainer's learning-rate schedule (linear warm-up, then linear decay to zero) and ``--time_budget``, which
times the first micro batches and plans where the run ends so that the decay reaches zero there."""

from __future__ import annotations

import time

import torch

CALIBRATION_BATCHES = 10  # micro batches timed before --time_budget plans the rest of the run


class WarmupLinearDecay:
    """Learning-rate factor: linear warm-up over ``warmup`` optimizer steps, then linear decay to zero at
    ``total`` (which ``--time_budget`` lowers mid-run; a callable object, so LambdaLR checkpoints it)."""

    def __init__(self, total: int, warmup: int):
        self.total, self.warmup = total, warmup

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        return max(0.0, (self.total - step) / max(1, self.total - self.warmup))


def make_schedule(optimizer, total_steps: int, warmup_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupLinearDecay(total_steps, warmup_steps))


class Budget:
    """``--time_budget``: times this process's first micro batches (the first two, which carry one-off costs,
    excluded from the pace), then plans once where training ends; processes agree on the earliest end."""

    def __init__(self, minutes: float, world: int, device):
        self.seconds, self.world, self.device = minutes * 60.0, world, device
        self.started, self.done, self.mark, self.per_batch = time.time(), 0, None, None

    def tick(self) -> bool:
        """Count one micro batch; True once, when it is time to plan."""
        self.done += 1
        if self.done == 2:
            self.mark = time.time()
        return self.done == CALIBRATION_BATCHES

    def plan(self, position: int, end: int) -> int:
        now = time.time()
        self.per_batch = (now - self.mark) / (self.done - 2)
        planned = plan_time_budget(self.seconds - (now - self.started), self.per_batch, position, end)
        if self.world > 1:
            import torch.distributed as dist

            agreed = torch.tensor([planned], dtype=torch.long, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            planned = int(agreed.item())
        return planned


def plan_time_budget(left_s: float, per_batch_s: float, position: int, planned_end: int) -> int:
    """The global micro-batch index at which a ``--time_budget`` run ends: from ``position`` (the index
    reached), as many more micro batches as fit in ``left_s`` seconds at ``per_batch_s`` each, never beyond
    ``planned_end``."""
    more = int(max(0.0, left_s) / max(per_batch_s, 1e-9))
    return min(planned_end, position + more)
