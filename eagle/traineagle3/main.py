"""Train an EAGLE-3 draft head for any decoder-only target, with DeepSpeed and training-time test.

    cd eagle/traineagle3 && deepspeed main.py --deepspeed_config ds_config.json \\
        --basepath MODEL --trainpath train.jsonl --testpath test.jsonl --savedir out
    python -m eagle.traineagle3.main --basepath MODEL --trainpath train.jsonl --savedir out   # one process

The data are ShareGPT-style conversations (``python -m eagle.traineagle3.gen_data`` writes them from the
target's own answers). After every epoch ``savedir/state_<epoch>/`` holds ``config.json`` and
``model.safetensors`` in the published EAGLE-3 layout, loadable with
``EaModel.from_pretrained(use_eagle3=True, ea_model_path=...)``; ``savedir/checkpoints/`` holds the DeepSpeed
state a later run resumes from (automatically, unless ``--no-resume``).

DeepSpeed configuration (``ds_config.json``): ``"auto"`` for ``bf16.enabled``/``fp16.enabled`` means bf16 on
GPUs that support it, else fp16, and neither on the CPU. On the CPU (DeepSpeed's CPU accelerator, gloo
backend) half precision and ZeRO offload are switched off and ZeRO stage 3 is refused; stages 0-2 work. The
optimizer is torch's AdamW and the schedule linear warm-up then linear decay, built here from the flags
(``optimizer``/``scheduler`` sections of the config are not used and are reported).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import socket
import sys
import time

if __package__ in (None, ""):  # run as a script from its folder: import the package from the repository root
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))

import torch

logger = logging.getLogger("eagle.traineagle3.main")

HERE = os.path.dirname(os.path.abspath(__file__))
HEAD_KEYS_EXCLUDED = ("embed_tokens.weight",)
CALIBRATION_BATCHES = 10  # micro batches timed before --time_budget plans the rest of the run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deepspeed main.py",
        description="Train an EAGLE-3 draft head (training-time test) for a frozen target model.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--basepath", required=True, help="Target model: a local directory, a .gguf file, or a directory holding one .gguf.")
    add("--trainpath", required=True, help="Training conversations, ShareGPT-style JSON or JSONL.")
    add("--testpath", default=None, help="Held-out conversations (same format); evaluated after every epoch.")
    add("--savedir", default="0", help="Output folder: state_<epoch>/ heads and checkpoints/ for resuming.")
    add("--epochs", "--num_epochs", dest="epochs", type=int, default=10, help="Number of epochs.")
    add("--lr", type=float, default=1e-4, help="Peak learning rate (AdamW, betas 0.9/0.95, no weight decay).")
    add("--warmup_steps", type=int, default=None, help="Linear warm-up optimizer steps (default: 5%% of all steps).")
    add("--draft_vocab_size", "--draft-vocab-size", dest="draft_vocab_size", type=int, default=32000,
        help="Draft vocabulary size Vd: the most frequent assistant tokens of the training data. At most the "
        "target's vocabulary size (equal = full-vocabulary head, no mapping).")
    add("--ttt_length", "--ttt-length", dest="ttt_length", type=int, default=7, help="Training-time-test steps.")
    add("--ttt_decay", type=float, default=0.8, help="Loss weight of step k is ttt_decay**k.")
    add("--max_len", "--max-len", dest="max_len", type=int, default=2048,
        help="Conversations longer than this many tokens are skipped (and counted).")
    add("--seed", type=int, default=0, help="Random seed (initialisation, shuffling).")
    add("--batch_size", type=int, default=None, help="Micro batch per process (overrides the DeepSpeed config).")
    add("--grad_accum", type=int, default=None, help="Gradient accumulation steps (overrides the DeepSpeed config).")
    add("--max_steps", type=int, default=None, help="Stop each epoch after this many micro batches (smoke tests).")
    add("--time_budget", type=float, default=None, help="Train for about this many minutes: after the first "
        f"{CALIBRATION_BATCHES} micro batches the run plans how many more fit, ends there (the last epoch cut "
        "short, its head saved as usual) and the learning rate decays to zero at that point. Held-out evaluation "
        "and saving come on top.")
    add("--lm_head_init", default="random", choices=["target", "random"], help="Initial draft LM head: the "
        "target's output-embedding rows of the draft vocabulary and its final norm weight (a head that learns to "
        "produce target-like hidden states starts with a decoder; untested benefit), or random (the reference).")
    add("--init_head", default=None, help="Start from the weights and draft vocabulary of a saved head "
        "(e.g. savedir/state_N of an earlier run on other data) instead of a random head.")
    add("--vocab_cache_dir", default=None, help="Where draft vocabulary maps are cached (default "
        "~/.cache/eagle/vocab_maps; the key is a hash of the data file, tokenizer, sizes).")
    add("--save_dtype", default="float16", choices=["float16", "bfloat16", "float32"], help="Dtype of saved heads.")
    add("--resume", dest="resume", action="store_true", default=None,
        help="Resume from savedir/checkpoints (error if there is none). Default: resume when one exists.")
    add("--no-resume", "--no_resume", dest="resume", action="store_false", help="Start from scratch.")
    add("--cache_target", action="store_true", help="Keep the target's outputs (features in float16, the top "
        "--cache_top_k draft tokens of its distribution) after the first epoch, in memory and in "
        "savedir/target_cache/, so later epochs (and restarted runs) skip the target. Worth it on a CPU; needs "
        "about 6 bytes x 3 x hidden size per training token of RAM and disk.")
    add("--cache_top_k", type=int, default=16, help="Draft tokens kept per position by --cache_target.")
    add("--checkpoint_every", type=int, default=0, help="Also save a resumable DeepSpeed checkpoint every N "
        "optimizer steps within an epoch (0 = at epoch ends only); a restarted run continues from it.")
    add("--num_workers", type=int, default=0, help="DataLoader workers.")
    add("--wandb", action="store_true", help="Log to Weights & Biases (needs `wandb`, and `wandb login`).")
    add("--wandb_project", default="eagle3", help="W&B project name.")
    add("--local_rank", type=int, default=-1, help="Set by the DeepSpeed launcher.")
    add("--log_level", default="INFO", help="Logging level.")
    try:
        import deepspeed

        parser = deepspeed.add_config_arguments(parser)
    except ImportError:
        add("--deepspeed_config", default=None, help="DeepSpeed JSON config.")
    return parser


# -- setup --------------------------------------------------------------------------------------------------


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
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage == 3:
        raise ValueError("ZeRO stage 3 is not supported (the head is small; use stage 2, which shards optimizer "
                         "state and gradients).")
    if batch_size is not None:
        config["train_micro_batch_size_per_gpu"] = batch_size
    if grad_accum is not None:
        config["gradient_accumulation_steps"] = grad_accum
    config.pop("train_batch_size", None)  # derived by DeepSpeed from micro batch x accumulation x world size
    config.setdefault("train_micro_batch_size_per_gpu", 1)
    config.setdefault("gradient_accumulation_steps", 1)
    return config


def head_config(target, draft_vocab_size: int, layer_ids: list[int]):
    """The head's EConfig from the target's config: same hidden size, heads, KV heads, intermediate size,
    vocabulary, RMS eps and RoPE base; one layer."""
    from eagle.model.configs import EConfig
    from eagle.traineagle3.target import text_config

    tc = text_config(target)
    hidden = tc.hidden_size
    heads = tc.num_attention_heads
    vocab = target.get_input_embeddings().weight.shape[0]
    if draft_vocab_size > vocab:
        raise ValueError(
            f"--draft_vocab_size {draft_vocab_size} is larger than the target's vocabulary ({vocab} tokens); use at "
            f"most {vocab} (equal means a full-vocabulary head)."
        )
    rope = getattr(tc, "rope_parameters", None) or {}
    if isinstance(rope, dict) and "rope_theta" not in rope:  # per-layer-type RoPE (e.g. Gemma 3): take the global one
        rope = rope.get("full_attention") or next((v for v in rope.values() if isinstance(v, dict)), {})
    rope_theta = float(rope.get("rope_theta", getattr(tc, "rope_theta", None) or 10000.0))
    eos = getattr(tc, "eos_token_id", None)
    return EConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=getattr(tc, "intermediate_size", None) or 4 * hidden,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=hidden // heads,
        hidden_act="silu",
        max_position_embeddings=getattr(tc, "max_position_embeddings", None) or 2048,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", None) or 1e-6),
        rope_theta=rope_theta,
        tie_word_embeddings=False,
        bos_token_id=getattr(tc, "bos_token_id", None),
        eos_token_id=eos,
        pad_token_id=getattr(tc, "pad_token_id", None),
        draft_vocab_size=draft_vocab_size,
        eagle_layer_ids=layer_ids,
    )


def save_head(head, config, directory: str, dtype: torch.dtype, extra: dict | None = None) -> None:
    """``config.json`` + ``model.safetensors`` (published EAGLE-3 keys, no embedding; d2t/t2d included)."""
    save_head_state(head.state_dict(), config, directory, dtype, extra)


def save_head_state(head_state: dict[str, torch.Tensor], config, directory: str, dtype: torch.dtype,
                    extra: dict | None = None) -> None:
    """:func:`save_head` for a head's state dict (e.g. read back from a DeepSpeed checkpoint)."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    state = {}
    for name, tensor in head_state.items():
        if name in HEAD_KEYS_EXCLUDED:
            continue
        tensor = tensor.detach().to("cpu")
        if tensor.is_floating_point():
            tensor = tensor.to(dtype)
        state[name] = tensor.contiguous().clone()
    config.dtype = str(dtype).replace("torch.", "")
    config.save_pretrained(directory)
    tmp = os.path.join(directory, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(directory, "model.safetensors"))
    if extra:
        with open(os.path.join(directory, "training_args.json"), "w") as f:
            json.dump(extra, f, indent=2, sort_keys=True)


def target_cache_dir(savedir: str, data_path: str, key: list) -> str:
    """savedir/target_cache/<hash of the data file, target, feature layers, precision, top-k, draft vocabulary>."""
    import hashlib

    from eagle.traineagle3.data import file_fingerprint

    digest = hashlib.sha256(json.dumps([file_fingerprint(data_path), *key]).encode()).hexdigest()[:24]
    return os.path.join(savedir, "target_cache", digest)


def load_init_head(directory: str, vocab_size: int) -> dict[str, torch.Tensor]:
    """Weights of a saved EAGLE-3 head (``model.safetensors``), to start from (``--init_head``)."""
    from eagle.model.checkpoint import load_head_state_dict

    state = load_head_state_dict(directory)
    for key in ("d2t", "t2d"):
        if key not in state:
            raise SystemExit(f"--init_head {directory}: its weights have no {key!r} (not an EAGLE-3 head with a draft vocabulary).")
    if state["t2d"].numel() != vocab_size:
        raise SystemExit(f"--init_head {directory} was trained for a {state['t2d'].numel()}-token vocabulary; this "
                         f"target has {vocab_size}.")
    return {name: tensor.float() if tensor.is_floating_point() else tensor for name, tensor in state.items()}


@torch.no_grad()
def init_lm_head_from_target(head, target) -> None:
    """Copy the target's output-embedding rows of the draft vocabulary into the head's LM head, and the target's
    final RMSNorm weight into the head's norm (skipped for Gemma-style ``1 + w`` norms)."""
    output = target.get_output_embeddings()
    if output is None or output.weight.shape[1] != head.lm_head.weight.shape[1]:
        logger.warning("The target's LM head does not fit the draft head: random LM head initialisation.")
        return
    ids = torch.arange(head.draft_vocab_size) + head.d2t.cpu() if head.reduced_vocab else torch.arange(head.vocab_size)
    head.lm_head.weight.copy_(output.weight[ids.to(output.weight.device)].float())
    norm = getattr(target.base_model, "norm", None)
    weight = getattr(norm, "weight", None)
    if weight is not None and weight.shape == head.norm.weight.shape and "gemma" not in type(norm).__name__.lower():
        head.norm.weight.copy_(weight.float())


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


# -- the loop -----------------------------------------------------------------------------------------------


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=args.log_level.upper() if rank == 0 else "WARNING",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import deepspeed
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler
    from tqdm import tqdm

    from eagle.model.cnets import Model

    from eagle.traineagle3.data import ConversationDataset, collate, default_cache_dir, load_or_build_vocab_map
    from eagle.traineagle3.target import feature_layer_ids, load_target, text_config
    from eagle.traineagle3.target_outputs import TargetOutputs
    from eagle.traineagle3.ttt import Eagle3TTTModel

    device, on_gpu = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    ds_path = args.deepspeed_config or os.path.join(HERE, "ds_config.json")
    ds_config = resolve_ds_config(ds_path, on_gpu, args.batch_size, args.grad_accum)
    half = torch.bfloat16 if ds_config["bf16"]["enabled"] else torch.float16 if ds_config["fp16"]["enabled"] else None
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    target, tokenizer = load_target(args.basepath, half or torch.float32, device)
    num_layers = text_config(target).num_hidden_layers
    layer_ids = feature_layer_ids(num_layers)
    vocab = target.get_input_embeddings().weight.shape[0]
    if args.draft_vocab_size > vocab:
        raise SystemExit(
            f"--draft_vocab_size {args.draft_vocab_size} is larger than the target's vocabulary ({vocab}); use at "
            f"most {vocab} (equal = full-vocabulary head)."
        )

    train_set = ConversationDataset(args.trainpath, tokenizer, args.max_len)
    logger.info(train_set.report.summary())
    if len(train_set) == 0:
        raise SystemExit(
            f"No usable training conversations in {args.trainpath}: {train_set.report.summary()} Check the file "
            "format (ShareGPT `conversations` with `from`/`value`) and --max_len."
        )
    test_set = None
    if args.testpath:
        test_set = ConversationDataset(args.testpath, tokenizer, args.max_len)
        logger.info(test_set.report.summary())
        if len(test_set) == 0:
            logger.warning("No usable test conversations in %s: evaluation skipped.", args.testpath)
            test_set = None

    init_state = load_init_head(args.init_head, vocab) if args.init_head else None
    if init_state is not None:
        d2t, t2d = init_state["d2t"], init_state["t2d"]
        if d2t.numel() != args.draft_vocab_size:
            logger.warning("--init_head has a %d-token draft vocabulary: using it (not --draft_vocab_size %d).",
                           d2t.numel(), args.draft_vocab_size)
            args.draft_vocab_size = d2t.numel()
    else:
        cache_dir = args.vocab_cache_dir or default_cache_dir()
        if is_main:
            d2t, t2d = load_or_build_vocab_map(train_set, tokenizer, vocab, args.draft_vocab_size, args.max_len, cache_dir)
        dist.barrier()
        if not is_main:
            d2t, t2d = load_or_build_vocab_map(train_set, tokenizer, vocab, args.draft_vocab_size, args.max_len, cache_dir)

    config = head_config(target, args.draft_vocab_size, layer_ids)
    if is_main:  # lets `python -m eagle.traineagle3.export` turn any checkpoint of this run into a head directory
        os.makedirs(args.savedir, exist_ok=True)
        config.to_json_file(os.path.join(args.savedir, "config.json"))
    head = Model(config)
    with torch.no_grad():
        head.embed_tokens.weight.copy_(target.get_input_embeddings().weight.float())
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
    if init_state is None and args.lm_head_init == "target":
        init_lm_head_from_target(head, target)
    if init_state is not None:
        missing, unexpected = head.load_state_dict(init_state, strict=False)
        if unexpected or set(missing) - set(HEAD_KEYS_EXCLUDED):
            raise SystemExit(f"--init_head {args.init_head} does not match this target: missing "
                             f"{sorted(set(missing) - set(HEAD_KEYS_EXCLUDED))}, unexpected {sorted(unexpected)}.")
        logger.info("Initialised the head from %s", args.init_head)
    head.embed_tokens.weight.requires_grad_(False)
    model = Eagle3TTTModel(head, length=args.ttt_length, decay=args.ttt_decay)
    top_k = args.cache_top_k if args.cache_target else None
    cache_key = [args.basepath, layer_ids, str(half), top_k, d2t.tolist()]
    train_outputs = TargetOutputs(target, head, layer_ids, top_k,
                                  cache_dir=target_cache_dir(args.savedir, args.trainpath, cache_key) if top_k else None)
    test_outputs = TargetOutputs(target, head, layer_ids, top_k,
                                 cache_dir=target_cache_dir(args.savedir, args.testpath, cache_key) if top_k and args.testpath else None)

    micro = ds_config["train_micro_batch_size_per_gpu"]
    accum = ds_config["gradient_accumulation_steps"]
    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=micro, sampler=train_sampler, collate_fn=collate, num_workers=args.num_workers)
    test_loader = None
    if test_set is not None:
        test_sampler = DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False)
        test_loader = DataLoader(test_set, batch_size=micro, sampler=test_sampler, collate_fn=collate, num_workers=args.num_workers)
    batches_per_epoch = len(train_loader) if args.max_steps is None else min(len(train_loader), args.max_steps)
    total_steps = max(1, math.ceil(batches_per_epoch / accum) * args.epochs)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total_steps // 20)

    model.to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if on_gpu else {}
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, **fused)
    scheduler = make_schedule(optimizer, total_steps, warmup)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=trainable, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )

    start_epoch = 0
    checkpoint_dir = os.path.join(args.savedir, "checkpoints")
    has_checkpoint = os.path.isfile(os.path.join(checkpoint_dir, "latest"))
    if args.resume and not has_checkpoint:
        raise SystemExit(f"--resume: no DeepSpeed checkpoint in {checkpoint_dir}.")
    skip_batches = 0
    if has_checkpoint and args.resume is not False:
        _, client = engine.load_checkpoint(checkpoint_dir)
        # The schedule's shape comes from this run's flags (e.g. more --epochs), not from the checkpoint.
        scheduler.lr_lambdas[0].total, scheduler.lr_lambdas[0].warmup = total_steps, warmup
        if not torch.equal(engine.module.head.d2t.cpu(), d2t):
            raise SystemExit(f"The checkpoint in {checkpoint_dir} was trained with another draft vocabulary (other data or "
                             "--draft_vocab_size); use another --savedir or --no-resume.")
        if client.get("batch"):  # saved within an epoch
            start_epoch, skip_batches = int(client["epoch"]), int(client["batch"])
            logger.info("Resumed from %s: continuing epoch %d after batch %d.", checkpoint_dir, start_epoch, skip_batches)
        else:
            start_epoch = int(client["epoch"]) + 1
            logger.info("Resumed from %s: continuing at epoch %d.", checkpoint_dir, start_epoch)
    if start_epoch >= args.epochs:
        logger.info("Already trained for %d epochs in %s.", args.epochs, args.savedir)

    wandb_run = None
    if args.wandb and is_main:
        try:
            import wandb
        except ImportError as err:
            raise SystemExit("--wandb needs the `wandb` package (pip install wandb).") from err
        wandb_run = wandb.init(project=args.wandb_project, config=vars(args))

    run_args = {k: v for k, v in vars(args).items() if k not in ("local_rank",)}
    run_args.update(world_size=world, micro_batch=micro, grad_accum=accum, layer_ids=layer_ids)
    end = args.epochs * batches_per_epoch  # global micro-batch index at which training stops
    budget = Budget(args.time_budget, world, device) if args.time_budget else None
    for epoch in range(start_epoch, args.epochs):
        if epoch * batches_per_epoch >= end:
            break
        epoch_batches = min(batches_per_epoch, end - epoch * batches_per_epoch)
        engine.train()
        train_sampler.set_epoch(epoch)
        stats = StepStats(args.ttt_length, device)
        tokens, started = 0, time.time()
        bar = tqdm(train_loader, total=epoch_batches, desc=f"epoch {epoch}", disable=not is_main)
        for index, batch in enumerate(bar):
            if index >= epoch_batches:
                break
            if index < skip_batches:  # done before the restart (same order: the sampler is seeded per epoch)
                continue
            out = run_batch(engine, train_outputs, batch, device)
            engine.backward(out.loss)
            engine.step()
            stats.add(out)
            if budget is not None and budget.tick():
                end = budget.plan(epoch * batches_per_epoch + index + 1, end)
                steps = max(1, math.ceil(end / accum))
                scheduler.lr_lambdas[0].total = steps
                epoch_batches = min(batches_per_epoch, end - epoch * batches_per_epoch)
                bar.total = epoch_batches
                logger.info("--time_budget %g min: %.3f s per micro batch; training ends after %d micro batches "
                            "(%.2f epochs, %d optimizer steps).", args.time_budget, budget.per_batch, end,
                            end / batches_per_epoch, steps)
                if steps <= warmup:
                    logger.warning("--time_budget: the run ends within the warm-up (%d optimizer steps), so the learning "
                                   "rate never decays; lower --warmup_steps or raise --time_budget.", warmup)
            if args.checkpoint_every and (index + 1) % (accum * args.checkpoint_every) == 0 and index + 1 < epoch_batches:
                tag = f"epoch_{epoch}_batch_{index + 1}"
                engine.save_checkpoint(checkpoint_dir, tag=tag, client_state={"epoch": epoch, "batch": index + 1})
                if is_main:
                    _drop_old_checkpoints(checkpoint_dir, keep=tag)
            tokens += int(batch["attention_mask"].sum())
            if is_main:
                acc = stats.accuracy()
                bar.set_postfix(loss=f"{float(out.loss.detach()):.3f}", acc0=f"{acc[0]:.3f}", acc_last=f"{acc[-1]:.3f}",
                                tok_s=f"{tokens * world / (time.time() - started):.0f}")
                if wandb_run is not None:
                    log = {"train/lr": scheduler.get_last_lr()[0], "train/loss": float(out.loss.detach())}
                    log.update({f"train/ploss_{k}": float(loss.detach()) for k, loss in enumerate(out.losses)})
                    log.update({f"train/acc_{k}": float(c) / max(1.0, float(n)) for k, (c, n) in enumerate(zip(out.correct, out.counted))})
                    wandb_run.log(log)
        bar.close()
        skip_batches = 0
        elapsed = max(time.time() - started, 1e-6)
        stats.reduce()
        test_stats = None
        if test_loader is not None:
            engine.eval()
            test_stats = StepStats(args.ttt_length, device)
            with torch.no_grad():
                for batch in tqdm(test_loader, desc="test", disable=not is_main, leave=False):
                    test_stats.add(run_batch(engine, test_outputs, batch, device))
            test_stats.reduce()
        if is_main:
            print(f"epoch {epoch}: {tokens * world} tokens in {elapsed:.0f}s ({tokens * world / elapsed:.1f} tokens/s)")
            print(format_table(stats, test_stats), flush=True)
            if wandb_run is not None:
                log = {f"epoch/train_acc_{k}": a for k, a in enumerate(stats.accuracy())}
                if test_stats:
                    log.update({f"epoch/test_acc_{k}": a for k, a in enumerate(test_stats.accuracy())})
                wandb_run.log(log)
            state_dir = os.path.join(args.savedir, f"state_{epoch}")
            extra = dict(run_args, epoch=epoch, end_micro_batch=end, last_lr=scheduler.get_last_lr()[0],
                         train_acc=stats.accuracy(), train_loss=stats.mean_loss(),
                         test_acc=test_stats.accuracy() if test_stats else None, tokens_per_s=tokens * world / elapsed)
            save_head(engine.module.head, config, state_dir, getattr(torch, args.save_dtype), extra)
            logger.info("Saved the head to %s", state_dir)
        engine.save_checkpoint(checkpoint_dir, tag=f"epoch_{epoch}", client_state={"epoch": epoch, "batch": None})
        dist.barrier()
        if is_main:
            _drop_old_checkpoints(checkpoint_dir, keep=f"epoch_{epoch}")
    if wandb_run is not None:
        wandb_run.finish()
    dist.barrier()
    return 0


def _drop_old_checkpoints(directory: str, keep: str) -> None:
    import shutil

    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if name.startswith("epoch_") and name != keep and os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
