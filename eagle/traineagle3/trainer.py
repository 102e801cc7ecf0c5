"""The trainer's epoch loop: training-time-test steps through the DeepSpeed engine, the ``--time_budget`` plan,
mid-epoch and epoch-end checkpoints, held-out evaluation, per-step statistics, logging, and the head saved after
every epoch."""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from dataclasses import dataclass, field

import torch

from eagle.traineagle3.save_head import save_head_state
from eagle.traineagle3.resume import all_ranks_sum, full_head_state
from eagle.traineagle3.schedule import Budget

logger = logging.getLogger("eagle.traineagle3.main")


class StepStats:
    """Per-TTT-step sums for exact averages over an epoch (and over processes)."""

    def __init__(self, length: int, device):
        self.loss = torch.zeros(length, dtype=torch.float64, device=device)
        self.batches = torch.zeros(length, dtype=torch.float64, device=device)
        self.correct = torch.zeros(length, dtype=torch.float64, device=device)
        self.counted = torch.zeros(length, dtype=torch.float64, device=device)

    def add(self, out) -> None:
        for k, loss in enumerate(out.losses):
            self.loss[k] += float(loss.detach())
            self.batches[k] += 1
            self.correct[k] += float(out.correct[k])
            self.counted[k] += float(out.counted[k])

    def reduce(self) -> "StepStats":
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_world_size() > 1:
            for tensor in (self.loss, self.batches, self.correct, self.counted):
                dist.all_reduce(tensor)
        return self

    def accuracy(self) -> list[float]:
        return (self.correct / self.counted.clamp(min=1)).tolist()

    def mean_loss(self) -> list[float]:
        return (self.loss / self.batches.clamp(min=1)).tolist()


def run_batch(engine, target_outputs, batch, device):
    features, probs, in_draft = target_outputs(batch, device)
    return engine(features, batch["input_ids"].to(device), probs, in_draft, batch["loss_mask"].to(device))


def format_table(train: StepStats, test: StepStats | None) -> str:
    lines = ["step  train_acc  train_loss" + ("  test_acc  test_loss" if test else "")]
    train_acc, train_loss = train.accuracy(), train.mean_loss()
    test_acc, test_loss = (test.accuracy(), test.mean_loss()) if test else (None, None)
    for k in range(len(train_acc)):
        line = f"{k:4d}  {train_acc[k]:9.4f}  {train_loss[k]:10.4f}"
        if test:
            line += f"  {test_acc[k]:8.4f}  {test_loss[k]:9.4f}"
        lines.append(line)
    return "\n".join(lines)


@dataclass
class EpochResult:
    stats: StepStats  # summed over processes
    tokens: int  # tokens all processes trained on
    elapsed: float  # seconds


@dataclass
class Trainer:
    """What the epochs share: the engine and its schedule, the data, the target's outputs, and where the run
    ends (``end``: the global micro-batch index, lowered by ``--time_budget`` once it has timed the first
    batches)."""

    args: argparse.Namespace
    engine: object  # deepspeed.DeepSpeedEngine around the Eagle3TTTModel
    scheduler: torch.optim.lr_scheduler.LambdaLR
    train_loader: object
    test_loader: object | None
    train_outputs: object  # TargetOutputs
    test_outputs: object
    config: object  # the head's EConfig, saved with every head
    device: torch.device
    world: int
    is_main: bool  # rank 0: prints, logs and saves heads
    batches_per_epoch: int  # micro batches per epoch and process (after --max_steps)
    accum: int  # gradient accumulation steps
    warmup: int  # warm-up optimizer steps
    checkpoint_dir: str
    run_args: dict  # saved as training_args.json next to every head
    wandb_run: object | None = None
    end: int = field(init=False, default=0)
    budget: Budget | None = field(init=False, default=None)

    def fit(self, start_epoch: int, skip_batches: int) -> None:
        """Train epochs ``start_epoch``.. (the first one after its first ``skip_batches`` micro batches, when
        resuming mid-epoch), evaluating, saving the head and checkpointing after each."""
        self.end = self.args.epochs * self.batches_per_epoch
        self.budget = Budget(self.args.time_budget, self.world, self.device) if self.args.time_budget else None
        for epoch in range(start_epoch, self.args.epochs):
            if epoch * self.batches_per_epoch >= self.end:
                break
            result = self.train_epoch(epoch, skip_batches)
            skip_batches = 0
            test_stats = self.evaluate()
            head_state = full_head_state(self.engine)  # every rank: ZeRO-3 gathers the partitioned weights
            if self.is_main:
                self.report(epoch, result, test_stats)
                self.save_epoch_head(epoch, result, test_stats, head_state)
            self.checkpoint(epoch, batch=None)

    def epoch_batches(self, epoch: int) -> int:
        """Micro batches of ``epoch`` before the run's end."""
        return min(self.batches_per_epoch, self.end - epoch * self.batches_per_epoch)

    def train_epoch(self, epoch: int, skip_batches: int) -> EpochResult:
        from tqdm import tqdm

        epoch_batches = self.epoch_batches(epoch)
        self.engine.train()
        self.train_loader.sampler.set_epoch(epoch)
        stats = StepStats(self.args.ttt_length, self.device)
        tokens, started = 0, time.time()
        bar = tqdm(self.train_loader, total=epoch_batches, desc=f"epoch {epoch}", disable=not self.is_main)
        for index, batch in enumerate(bar):
            if index >= epoch_batches:
                break
            if index < skip_batches:  # done before the restart (same order: the sampler is seeded per epoch)
                continue
            out = run_batch(self.engine, self.train_outputs, batch, self.device)
            self.engine.backward(out.loss)
            self.engine.step()
            stats.add(out)
            if self.budget is not None and self.budget.tick():
                self.plan_end(epoch * self.batches_per_epoch + index + 1)
                epoch_batches = bar.total = self.epoch_batches(epoch)
            every = self.accum * self.args.checkpoint_every
            if every and (index + 1) % every == 0 and index + 1 < epoch_batches:
                self.checkpoint(epoch, batch=index + 1)
            tokens += int(batch["attention_mask"].sum())
            if self.is_main:
                self.log_batch(bar, stats, out, tokens * self.world / (time.time() - started))
        bar.close()
        elapsed = max(time.time() - started, 1e-6)
        return EpochResult(stats.reduce(), all_ranks_sum(tokens, self.device), elapsed)

    def plan_end(self, position: int) -> None:
        """``--time_budget``: end the run where the budget runs out (``position``: the global micro-batch index
        reached) and make the learning rate reach zero there."""
        self.end = self.budget.plan(position, self.end)
        steps = max(1, math.ceil(self.end / self.accum))
        self.scheduler.lr_lambdas[0].total = steps
        logger.info("--time_budget %g min: %.3f s per micro batch; training ends after %d micro batches "
                    "(%.2f epochs, %d optimizer steps).", self.args.time_budget, self.budget.per_batch, self.end,
                    self.end / self.batches_per_epoch, steps)
        if steps <= self.warmup:
            logger.warning("--time_budget: the run ends within the warm-up (%d optimizer steps), so the learning "
                           "rate never decays; lower --warmup_steps or raise --time_budget.", self.warmup)

    def log_batch(self, bar, stats: StepStats, out, tokens_per_s: float) -> None:
        acc = stats.accuracy()
        bar.set_postfix(loss=f"{float(out.loss.detach()):.3f}", acc0=f"{acc[0]:.3f}", acc_last=f"{acc[-1]:.3f}",
                        tok_s=f"{tokens_per_s:.0f}")
        if self.wandb_run is not None:
            log = {"train/lr": self.scheduler.get_last_lr()[0], "train/loss": float(out.loss.detach())}
            log.update({f"train/ploss_{k}": float(loss.detach()) for k, loss in enumerate(out.losses)})
            log.update({f"train/acc_{k}": float(c) / max(1.0, float(n)) for k, (c, n) in enumerate(zip(out.correct, out.counted))})
            self.wandb_run.log(log)

    def evaluate(self) -> StepStats | None:
        """Per-step accuracy and loss on the held-out conversations (None without --testpath)."""
        from tqdm import tqdm

        if self.test_loader is None:
            return None
        self.engine.eval()
        test_stats = StepStats(self.args.ttt_length, self.device)
        with torch.no_grad():
            for batch in tqdm(self.test_loader, desc="test", disable=not self.is_main, leave=False):
                test_stats.add(run_batch(self.engine, self.test_outputs, batch, self.device))
        return test_stats.reduce()

    def report(self, epoch: int, result: EpochResult, test_stats: StepStats | None) -> None:
        tokens = result.tokens  # of all ranks
        print(f"epoch {epoch}: {tokens} tokens in {result.elapsed:.0f}s ({tokens / result.elapsed:.1f} tokens/s)")
        print(format_table(result.stats, test_stats), flush=True)
        if self.wandb_run is not None:
            log = {f"epoch/train_acc_{k}": a for k, a in enumerate(result.stats.accuracy())}
            if test_stats:
                log.update({f"epoch/test_acc_{k}": a for k, a in enumerate(test_stats.accuracy())})
            self.wandb_run.log(log)

    def save_epoch_head(self, epoch: int, result: EpochResult, test_stats: StepStats | None,
                        head_state: dict[str, torch.Tensor]) -> None:
        """``savedir/state_<epoch>/``: the head, and the run's arguments and results in training_args.json
        (``epoch_tokens``: the tokens all ranks trained on in the epoch)."""
        state_dir = os.path.join(self.args.savedir, f"state_{epoch}")
        extra = dict(self.run_args, epoch=epoch, end_micro_batch=self.end, last_lr=self.scheduler.get_last_lr()[0],
                     train_acc=result.stats.accuracy(), train_loss=result.stats.mean_loss(),
                     test_acc=test_stats.accuracy() if test_stats else None,
                     tokens_per_s=result.tokens / result.elapsed, epoch_tokens=result.tokens)
        save_head_state(head_state, self.config, state_dir, getattr(torch, self.args.save_dtype), extra)
        logger.info("Saved the head to %s", state_dir)

    def checkpoint(self, epoch: int, batch: int | None) -> None:
        """A resumable DeepSpeed checkpoint: at the end of ``epoch`` (``batch`` None) or within it, after ``batch``
        micro batches. Only the newest is kept."""
        import torch.distributed as dist

        tag = f"epoch_{epoch}" if batch is None else f"epoch_{epoch}_batch_{batch}"
        self.engine.save_checkpoint(self.checkpoint_dir, tag=tag, client_state={"epoch": epoch, "batch": batch})
        if batch is None:
            dist.barrier()
        if self.is_main:
            drop_old_checkpoints(self.checkpoint_dir, keep=tag)


def drop_old_checkpoints(directory: str, keep: str) -> None:
    import shutil

    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith("epoch_") and name != keep and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)

