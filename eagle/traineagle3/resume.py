"""Resuming the trainer's DeepSpeed checkpoints, also on another number of ranks; the head's full weights
under any ZeRO stage.

DeepSpeed refuses to load a ZeRO stage 1/2 checkpoint written by another data-parallel world size (each rank's
file holds its slice of the flat optimizer state). The head is small, so :func:`load_checkpoint` does it here when
the world size changed: it loads the module weights, the learning-rate schedule and the trainer's position
(``load_module_only``), joins the saved slices of the fp32 master weights and of AdamW's moments, and hands
each rank its slice under the new partitioning. With the same world size DeepSpeed's own loading is used.
"""

from __future__ import annotations

import glob
import logging
import os
import re

import torch

logger = logging.getLogger("eagle.traineagle3.resume")

ZERO_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")


def checkpoint_tag(checkpoint_dir: str) -> str:
    with open(os.path.join(checkpoint_dir, "latest")) as f:
        return f.read().strip()


def zero_files(tag_dir: str) -> list[str]:
    """The ZeRO optimizer-state files of a checkpoint, by rank (empty for ZeRO stage 0)."""
    found = {}
    for path in glob.glob(os.path.join(tag_dir, "zero_pp_rank_*_mp_rank_00_optim_states.pt")):
        found[int(ZERO_FILE.search(path).group(1))] = path
    if found and sorted(found) != list(range(len(found))):
        raise ValueError(f"{tag_dir} misses the ZeRO optimizer state of some ranks: has ranks {sorted(found)}.")
    return [found[rank] for rank in sorted(found)]


def joined_zero_state(paths: list[str]) -> list[dict[str, torch.Tensor]]:
    """Per parameter group: the whole flat fp32 weights and AdamW moments (the ranks' slices joined, the
    partitioning's padding dropped) and the step count."""
    # DeepSpeed's ZeRO files hold DeepSpeed objects (its loss scaler, slice mappings), so they cannot load with
    # weights_only=True; DeepSpeed's own load_checkpoint unpickles the same files: resume only runs you trust.
    states = [torch.load(p, map_location="cpu", weights_only=False)["optimizer_state_dict"] for p in paths]
    if any(s.get("zero_stage") not in (1, 2) for s in states):
        raise ValueError("Only ZeRO stage 1/2 checkpoints move to another number of ranks: resume this one with as "
                         "many ranks as wrote it, or export its head (python -m eagle.traineagle3.save_head) and start "
                         "a new run from it with --init_head.")
    groups = []
    for index in range(len(states[0]["single_partition_of_fp32_groups"])):
        padding = sum(int(s["group_paddings"][index]) for s in states)
        base = [s["base_optimizer_state"]["state"].get(index, {}) for s in states]

        def join(parts):
            flat = torch.cat([p.float().flatten() for p in parts])
            return flat[: flat.numel() - padding]

        group = {"fp32": join([s["single_partition_of_fp32_groups"][index] for s in states])}
        if all("exp_avg" in b for b in base):
            group.update(exp_avg=join([b["exp_avg"] for b in base]), exp_avg_sq=join([b["exp_avg_sq"] for b in base]),
                         step=base[0]["step"])
        groups.append(group)
    return groups


def _slice(flat: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    part = torch.zeros(size, dtype=flat.dtype)
    piece = flat[rank * size: (rank + 1) * size]
    part[: piece.numel()] = piece
    return part


def load_repartitioned(engine, scheduler, checkpoint_dir: str, tag: str, paths: list[str]) -> dict:
    """Load a ZeRO stage 1/2 checkpoint written by ``len(paths)`` ranks into ``engine`` (another world size)."""
    import torch.distributed as dist

    _, client = engine.load_checkpoint(checkpoint_dir, tag=tag, load_module_only=True)
    if client is None:
        raise ValueError(f"Could not load the checkpoint {tag} in {checkpoint_dir}.")
    if client.get("lr_scheduler") is not None:
        scheduler.load_state_dict(client["lr_scheduler"])
    engine.global_steps = int(client.get("global_steps", engine.global_steps))
    engine.global_samples = int(client.get("global_samples", engine.global_samples))
    optimizer = engine.optimizer
    groups = joined_zero_state(paths)
    if len(groups) != len(optimizer.single_partition_of_fp32_groups):
        raise ValueError(f"The checkpoint has {len(groups)} parameter groups; this run has "
                         f"{len(optimizer.single_partition_of_fp32_groups)}.")
    for index, (group, master) in enumerate(zip(groups, optimizer.single_partition_of_fp32_groups)):
        rank, size = dist.get_rank(group=optimizer.real_dp_process_group[index]), master.numel()
        with torch.no_grad():
            master.copy_(_slice(group["fp32"], rank, size).to(master.dtype))
        if "exp_avg" in group:
            optimizer.optimizer.state[master] = {
                "step": group["step"].clone() if torch.is_tensor(group["step"]) else group["step"],
                "exp_avg": _slice(group["exp_avg"], rank, size).to(master.device),
                "exp_avg_sq": _slice(group["exp_avg_sq"], rank, size).to(master.device),
            }
    optimizer.update_lp_params()  # the model's (half-precision) weights from the restored fp32 masters
    return client


def full_head_state(engine) -> dict[str, torch.Tensor]:
    """The head's weights in full, on every rank (ZeRO-3 partitions them: gathered here, a collective call)."""
    head = engine.module.head
    if engine.zero_optimization_stage() != 3:
        return head.state_dict()
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(head.parameters()), modifier_rank=None):
        return {name: tensor.detach().cpu().clone() for name, tensor in head.state_dict().items()}


def all_ranks_sum(value: int, device) -> int:
    """``value`` summed over the ranks (e.g. the tokens each trained on in an epoch)."""
    import torch.distributed as dist

    total = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(total)
    return int(total.item())


def load_checkpoint(engine, scheduler, checkpoint_dir: str) -> dict:
    """Load the trainer's latest checkpoint into ``engine``; returns its client state (epoch, batch)."""
    import torch.distributed as dist

    tag = checkpoint_tag(checkpoint_dir)
    paths = zero_files(os.path.join(checkpoint_dir, tag))
    world = dist.get_world_size()
    if paths and len(paths) != world:
        logger.info("The checkpoint %s was written by %d ranks; re-partitioning its optimizer state over %d.", tag,
                    len(paths), world)
        return load_repartitioned(engine, scheduler, checkpoint_dir, tag, paths)
    _, client = engine.load_checkpoint(checkpoint_dir, tag=tag)
    return client
