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
backend) half precision and ZeRO offload are switched off. ZeRO stages 0-3 work (``ds_config_zero2.json``,
``ds_config_zero3.json``: GPU configs); a stage 0-2 checkpoint resumes on another number of ranks. The
optimizer is torch's AdamW and the schedule linear warm-up then linear decay, built here from the flags
(``optimizer``/``scheduler`` sections of the config are not used and are reported).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import random
import sys

if __package__ in (None, ""):  # run as a script from its folder: import the package from the repository root
    _here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    sys.path.insert(0, os.path.dirname(os.path.dirname(_here)))

import torch

from eagle.traineagle3.deepspeed_setup import init_distributed, resolve_ds_config
from eagle.traineagle3.save_head import HEAD_KEYS_EXCLUDED, head_config, write_head_config
from eagle.traineagle3.schedule import CALIBRATION_BATCHES, make_schedule
from eagle.traineagle3.trainer import Trainer

logger = logging.getLogger("eagle.traineagle3.main")

HERE = os.path.dirname(os.path.abspath(__file__))


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


# -- the steps of a run, in order -----------------------------------------------------------------------------


def configure_logging(level: str) -> None:
    """``--log_level`` on the main process; warnings only on the others."""
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=level.upper() if rank == 0 else "WARNING",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def half_precision(ds_config: dict) -> torch.dtype | None:
    """The DeepSpeed config's half precision (bf16 or fp16), None for float32."""
    if ds_config["bf16"]["enabled"]:
        return torch.bfloat16
    return torch.float16 if ds_config["fp16"]["enabled"] else None


def target_vocab_size(target, draft_vocab_size: int) -> int:
    """The target's vocabulary size, checked against ``--draft_vocab_size``."""
    vocab = target.get_input_embeddings().weight.shape[0]
    if draft_vocab_size > vocab:
        raise SystemExit(
            f"--draft_vocab_size {draft_vocab_size} is larger than the target's vocabulary ({vocab}); use at "
            f"most {vocab} (equal = full-vocabulary head)."
        )
    return vocab


def load_conversations(args, tokenizer):
    """(training set, held-out set or None): the tokenized conversations with their loss masks."""
    from eagle.traineagle3.data import ConversationDataset

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
    return train_set, test_set


def draft_vocabulary(args, train_set, tokenizer, vocab: int, is_main: bool):
    """``(init_state, d2t, t2d)``: the ``--init_head`` weights (None without it) and the draft vocabulary map,
    the init head's or built from the training data (by the main process first, which caches it for the others).
    An init head's vocabulary size overrides ``args.draft_vocab_size``."""
    import torch.distributed as dist

    from eagle.traineagle3.data import default_cache_dir, load_or_build_vocab_map

    init_state = load_init_head(args.init_head, vocab) if args.init_head else None
    if init_state is not None:
        d2t, t2d = init_state["d2t"], init_state["t2d"]
        if d2t.numel() != args.draft_vocab_size:
            logger.warning("--init_head has a %d-token draft vocabulary: using it (not --draft_vocab_size %d).",
                           d2t.numel(), args.draft_vocab_size)
            args.draft_vocab_size = d2t.numel()
        return init_state, d2t, t2d
    cache_dir = args.vocab_cache_dir or default_cache_dir()
    if is_main:
        d2t, t2d = load_or_build_vocab_map(train_set, tokenizer, vocab, args.draft_vocab_size, args.max_len, cache_dir)
    dist.barrier()
    if not is_main:
        d2t, t2d = load_or_build_vocab_map(train_set, tokenizer, vocab, args.draft_vocab_size, args.max_len, cache_dir)
    return None, d2t, t2d


def load_init_head(directory: str, vocab_size: int) -> dict[str, torch.Tensor]:
    """Weights of a saved EAGLE-3 head (``model.safetensors``), to start from (``--init_head``)."""
    from eagle.model.heads.checkpoint import load_head_state_dict

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


def build_head(args, config, target, d2t: torch.Tensor, t2d: torch.Tensor, init_state: dict | None):
    """The EAGLE-3 head to train: the target's (frozen) embedding, the draft vocabulary map, and the weights of
    ``--init_head`` or the ``--lm_head_init`` initialisation."""
    from eagle.model.heads.draft_head import Eagle3DraftHead

    head = Eagle3DraftHead(config)
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
    return head


def target_cache_dir(savedir: str, data_path: str, key: list) -> str:
    """savedir/target_cache/<hash of the data file, target, feature layers, precision, top-k, draft vocabulary>."""
    from eagle.traineagle3.data import file_fingerprint

    digest = hashlib.sha256(json.dumps([file_fingerprint(data_path), *key]).encode()).hexdigest()[:24]
    return os.path.join(savedir, "target_cache", digest)


def make_target_outputs(args, target, head, layer_ids: list[int], half: torch.dtype | None, d2t: torch.Tensor):
    """(training, held-out) :class:`TargetOutputs`: the target's features and draft-vocabulary distribution per
    batch, cached after the first epoch with ``--cache_target``."""
    from eagle.traineagle3.target_outputs import TargetOutputs

    top_k = args.cache_top_k if args.cache_target else None
    cache_key = [args.basepath, layer_ids, str(half), top_k, d2t.tolist()]
    train_cache = target_cache_dir(args.savedir, args.trainpath, cache_key) if top_k else None
    test_cache = target_cache_dir(args.savedir, args.testpath, cache_key) if top_k and args.testpath else None
    return (TargetOutputs(target, head, layer_ids, top_k, cache_dir=train_cache),
            TargetOutputs(target, head, layer_ids, top_k, cache_dir=test_cache))


def make_loaders(args, train_set, test_set, micro_batch: int, rank: int, world: int):
    """(training loader, held-out loader or None), each process reading its share (training: shuffled per
    epoch from ``--seed``)."""
    from torch.utils.data import DataLoader, DistributedSampler

    from eagle.traineagle3.data import collate

    train_sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    train_loader = DataLoader(train_set, batch_size=micro_batch, sampler=train_sampler, collate_fn=collate,
                              num_workers=args.num_workers)
    if test_set is None:
        return train_loader, None
    test_sampler = DistributedSampler(test_set, num_replicas=world, rank=rank, shuffle=False)
    return train_loader, DataLoader(test_set, batch_size=micro_batch, sampler=test_sampler, collate_fn=collate,
                                    num_workers=args.num_workers)


def make_engine(args, model, ds_config: dict, device: torch.device, on_gpu: bool, total_steps: int, warmup: int):
    """(DeepSpeed engine, LR scheduler): AdamW over the trainable parameters, warm-up then linear decay."""
    import deepspeed

    model.to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = {"fused": True} if on_gpu else {}
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0, **fused)
    scheduler = make_schedule(optimizer, total_steps, warmup)
    engine, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=trainable, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    return engine, scheduler


def resume(args, engine, scheduler, checkpoint_dir: str, d2t: torch.Tensor, total_steps: int,
           warmup: int) -> tuple[int, int]:
    """Load the newest checkpoint of ``savedir/checkpoints`` unless ``--no-resume``. Returns (first epoch to
    train, micro batches of it already done)."""
    has_checkpoint = os.path.isfile(os.path.join(checkpoint_dir, "latest"))
    if args.resume and not has_checkpoint:
        raise SystemExit(f"--resume: no DeepSpeed checkpoint in {checkpoint_dir}.")
    start_epoch, skip_batches = 0, 0
    if has_checkpoint and args.resume is not False:
        from eagle.traineagle3.resume import load_checkpoint

        client = load_checkpoint(engine, scheduler, checkpoint_dir)  # also one written by another number of ranks
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
    return start_epoch, skip_batches


def open_wandb(args):
    try:
        import wandb
    except ImportError as err:
        raise SystemExit("--wandb needs the `wandb` package (pip install wandb).") from err
    return wandb.init(project=args.wandb_project, config=vars(args))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    import torch.distributed as dist

    from eagle.traineagle3.frozen_target import feature_layer_ids, load_target, text_config
    from eagle.traineagle3.ttt import Eagle3TTTModel

    device, on_gpu = init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    ds_config = resolve_ds_config(args.deepspeed_config or os.path.join(HERE, "ds_config.json"), on_gpu,
                                  args.batch_size, args.grad_accum)
    half = half_precision(ds_config)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    target, tokenizer = load_target(args.basepath, half or torch.float32, device)
    layer_ids = feature_layer_ids(text_config(target).num_hidden_layers)
    vocab = target_vocab_size(target, args.draft_vocab_size)
    train_set, test_set = load_conversations(args, tokenizer)
    init_state, d2t, t2d = draft_vocabulary(args, train_set, tokenizer, vocab, is_main)
    config = head_config(target, args.draft_vocab_size, layer_ids)
    if is_main:  # lets `python -m eagle.traineagle3.save_head` turn any checkpoint of this run into a head directory
        os.makedirs(args.savedir, exist_ok=True)
        write_head_config(config, args.savedir)
    head = build_head(args, config, target, d2t, t2d, init_state)
    model = Eagle3TTTModel(head, length=args.ttt_length, decay=args.ttt_decay)
    train_outputs, test_outputs = make_target_outputs(args, target, head, layer_ids, half, d2t)

    micro, accum = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    train_loader, test_loader = make_loaders(args, train_set, test_set, micro, rank, world)
    batches_per_epoch = len(train_loader) if args.max_steps is None else min(len(train_loader), args.max_steps)
    total_steps = max(1, math.ceil(batches_per_epoch / accum) * args.epochs)
    warmup = args.warmup_steps if args.warmup_steps is not None else max(1, total_steps // 20)
    engine, scheduler = make_engine(args, model, ds_config, device, on_gpu, total_steps, warmup)
    checkpoint_dir = os.path.join(args.savedir, "checkpoints")
    start_epoch, skip_batches = resume(args, engine, scheduler, checkpoint_dir, d2t, total_steps, warmup)
    wandb_run = open_wandb(args) if args.wandb and is_main else None

    run_args = {k: v for k, v in vars(args).items() if k not in ("local_rank",)}
    run_args.update(world_size=world, micro_batch=micro, grad_accum=accum, layer_ids=layer_ids)
    trainer = Trainer(args, engine, scheduler, train_loader, test_loader, train_outputs, test_outputs, config, device,
                      world, is_main, batches_per_epoch, accum, warmup, checkpoint_dir, run_args, wandb_run)
    trainer.fit(start_epoch, skip_batches)
    if wandb_run is not None:
        wandb_run.finish()
    dist.barrier()
    # Tear the process group down before the interpreter exits: left to exit-time destructors, a communication
    # thread still running can abort the rank (std::terminate) after the head was saved.
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
