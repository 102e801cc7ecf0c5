"""Export the head held in a DeepSpeed checkpoint of ``eagle.traineagle3.main`` (an epoch end, or a
``--checkpoint_every`` point within an epoch) as a loadable head directory (``config.json`` +
``model.safetensors``, the published EAGLE-3 key names), e.g. to try a run's head before its epoch ends::

    python -m eagle.traineagle3.export --savedir runs/head --output runs/head/export
    python -m eagle.traineagle3.export --savedir runs/head --tag epoch_0_batch_400 --output out --dtype float32

Only the ZeRO stage 0-2 layout is read (``mp_rank_00_model_states.pt``: the full module weights), which is what
the trainer's DeepSpeed config uses.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

logger = logging.getLogger("eagle.traineagle3.export")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle.traineagle3.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--savedir", required=True, help="The trainer's --savedir (holds checkpoints/).")
    parser.add_argument("--tag", default=None, help="Checkpoint tag (default: the one named in checkpoints/latest).")
    parser.add_argument("--output", required=True, help="Directory to write config.json and model.safetensors to.")
    parser.add_argument("--config", default=None, help="The head's config.json (default: savedir/config.json, "
                        "written by the trainer when it starts).")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                        help="Precision of the exported weights.")
    return parser


def read_module_state(checkpoint_dir: str, tag: str | None) -> tuple[str, dict[str, torch.Tensor]]:
    """(tag, the head's weights) from a DeepSpeed checkpoint directory."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"No DeepSpeed checkpoint in {checkpoint_dir} (no 'latest' file); give --tag.")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(checkpoint_dir, tag, "mp_rank_00_model_states.pt")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} does not exist: not a checkpoint of this trainer (ZeRO stage 0-2).")
    states = torch.load(path, map_location="cpu", weights_only=True)
    module = states.get("module") if isinstance(states, dict) else None
    if not module:
        raise ValueError(f"{path} holds no module weights.")
    head = {name[len("head."):]: tensor for name, tensor in module.items() if name.startswith("head.")}
    if not head:
        raise ValueError(f"{path} holds no EAGLE-3 head weights (no 'head.' keys).")
    return tag, head


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from eagle.model.configs import EConfig

    from .main import save_head_state

    config_path = args.config or os.path.join(args.savedir, "config.json")
    if not os.path.isfile(config_path):
        raise SystemExit(f"No head config at {config_path}: pass --config (the config.json of the head being trained).")
    tag, state = read_module_state(os.path.join(args.savedir, "checkpoints"), args.tag)
    with open(config_path) as f:
        config = EConfig(**json.load(f))
    if "d2t" in state and state["d2t"].shape[0] != config.draft_vocab_size:
        raise SystemExit(f"{config_path} says draft_vocab_size={config.draft_vocab_size} but the checkpoint's d2t "
                         f"has {state['d2t'].shape[0]} entries: not this run's config.")
    save_head_state(state, config, args.output, getattr(torch, args.dtype))
    logger.info("Exported the head of checkpoint %s to %s", tag, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
