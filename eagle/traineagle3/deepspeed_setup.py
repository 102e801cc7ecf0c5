"""DeepSpeed setup of the trainer: torch.distributed with or without a launcher, and the DeepSpeed config adapted
to the device (see the docstring of ``eagle.traineagle3.main``)."""

from __future__ import annotations

import json
import logging
import os
import socket

import torch

logger = logging.getLogger("eagle.traineagle3.main")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed():
    """Initialise torch.distributed through DeepSpeed, also when not started by a launcher (one process)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:
        os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "1"})
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    accelerator = get_accelerator()
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accelerator.device_name() == "cpu":
        return torch.device("cpu"), False
    accelerator.set_device(local_rank)
    return torch.device(accelerator.device_name(local_rank)), True


def resolve_ds_config(path: str, on_gpu: bool, batch_size: int | None, grad_accum: int | None) -> dict:
    """Read the DeepSpeed config and adapt it to the device (see the module docstring)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"DeepSpeed config {path} does not exist (the default is ds_config.json next to main.py).")
    with open(path) as f:
        config = json.load(f)
    for section in ("optimizer", "scheduler"):
        if config.pop(section, None) is not None:
            logger.warning("Ignoring the '%s' section of %s: AdamW and the schedule come from --lr/--warmup_steps.", section, path)
    bf16 = config.setdefault("bf16", {})
    fp16 = config.setdefault("fp16", {})
    if on_gpu:
        bf16_ok = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        if bf16.get("enabled") == "auto":
            bf16["enabled"] = bf16_ok
        if fp16.get("enabled") == "auto":
            fp16["enabled"] = not bf16["enabled"]
    else:
        if bf16.get("enabled") is True or fp16.get("enabled") is True:
            logger.warning("Training on the CPU: fp16/bf16 switched off (float32).")
        bf16["enabled"] = False
        fp16["enabled"] = False
        zero = config.get("zero_optimization", {})
        for key in ("offload_optimizer", "offload_param"):
            if zero.pop(key, None) is not None:
                logger.warning("Training on the CPU: ZeRO %s removed (it needs an accelerator).", key)
    if bf16.get("enabled") and fp16.get("enabled"):
        raise ValueError(f"{path} enables both bf16 and fp16; enable one (or set both to \"auto\").")
    if batch_size is not None:
        config["train_micro_batch_size_per_gpu"] = batch_size
    if grad_accum is not None:
        config["gradient_accumulation_steps"] = grad_accum
    config.pop("train_batch_size", None)  # derived by DeepSpeed from micro batch x accumulation x world size
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    config.setdefault("gradient_accumulation_steps", 1)
    return config
