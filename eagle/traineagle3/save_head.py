"""The trained head's saved form: ``config.json`` + ``model.safetensors`` in the published EAGLE-3 layout, written
by the trainer after every epoch (:func:`save_head`), and the command that exports the head held in any DeepSpeed
checkpoint of ``eagle.traineagle3.main`` (an epoch end, or a ``--checkpoint_every`` point within an epoch) as such a
loadable head directory, e.g. to try a run's head before its epoch ends::

    python -m eagle.traineagle3.save_head --savedir runs/head --output runs/head/export
    python -m eagle.traineagle3.save_head --savedir runs/head --tag epoch_0_batch_400 --output out --dtype float32

ZeRO stage 0-2 checkpoints hold the full module weights (``mp_rank_00_model_states.pt``); ZeRO-3 ones
(``ds_config_zero3.json``) are joined from their partitions with DeepSpeed's ``zero_to_fp32``. Heads are written in
the layout vLLM, SGLang, llama.cpp and SpecForge read (:func:`eagle.model.heads.draft_config.to_engine_layout`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import torch

logger = logging.getLogger("eagle.traineagle3.save_head")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle.traineagle3.save_head", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--savedir", required=True, help="The trainer's --savedir (holds checkpoints/).")
    parser.add_argument("--tag", default=None, help="Checkpoint tag (default: the one named in checkpoints/latest).")
    parser.add_argument("--output", required=True, help="Directory to write config.json and model.safetensors to.")
    parser.add_argument("--config", default=None, help="The head's config.json (default: savedir/config.json, "
                        "written by the trainer when it starts).")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                        help="Precision of the exported weights.")
    return parser


HEAD_KEYS_EXCLUDED = ("embed_tokens.weight",)  # the target's embedding: loaded from the target, never saved


def head_config(target, draft_vocab_size: int, layer_ids: list[int]):
    """The head's EConfig from the target's config: same hidden size, heads, KV heads, intermediate size,
    vocabulary, RMS eps and RoPE base; one layer; in the layout the serving engines read."""
    from eagle.model.heads.draft_config import EConfig, to_engine_layout
    from eagle.traineagle3.frozen_target import text_config

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
    config = EConfig(
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
    )
    return to_engine_layout(config, layer_ids, target_hidden_size=hidden)


def write_head_config(config, directory: str, dtype: torch.dtype | None = None) -> None:
    """``directory/config.json`` of a head (the one place the trainer and the export write it); ``dtype``, when
    given, is recorded as the weights' precision. An EAGLE-3 config is written in the serving engines' layout (one
    in this project's older layout, ``eagle_layer_ids``, is converted)."""
    from eagle.model.heads.draft_config import head_layer_ids, to_engine_layout

    if getattr(config, "draft_vocab_size", None) is not None:
        layer_ids = head_layer_ids(config)
        if layer_ids is None:
            raise ValueError("The head's config names no target layers (eagle_aux_hidden_state_layer_ids).")
        to_engine_layout(config, layer_ids)
    if dtype is not None:
        config.dtype = str(dtype).replace("torch.", "")
    config.save_pretrained(directory)


def read_head_config(path: str):
    """The EConfig of a ``config.json`` written by :func:`write_head_config`."""
    from eagle.model.heads.draft_config import EConfig

    with open(path) as f:
        return EConfig(**json.load(f))


def save_head(head, config, directory: str, dtype: torch.dtype, extra: dict | None = None) -> None:
    """``config.json`` + ``model.safetensors`` (published EAGLE-3 keys, no embedding; d2t/t2d included)."""
    save_head_state(head.state_dict(), config, directory, dtype, extra)


def save_head_state(head_state: dict[str, torch.Tensor], config, directory: str, dtype: torch.dtype,
                    extra: dict | None = None) -> None:
    """:func:`save_head` for a head's state dict (e.g. read back from a DeepSpeed checkpoint); ``extra`` goes to
    ``training_args.json``."""
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
    write_head_config(config, directory, dtype)
    tmp = os.path.join(directory, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(directory, "model.safetensors"))
    if extra:
        with open(os.path.join(directory, "training_args.json"), "w") as f:
            json.dump(extra, f, indent=2, sort_keys=True)


def read_module_state(checkpoint_dir: str, tag: str | None) -> tuple[str, dict[str, torch.Tensor]]:
    """(tag, the head's weights) from a DeepSpeed checkpoint directory."""
    if tag is None:
        latest = os.path.join(checkpoint_dir, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(f"No DeepSpeed checkpoint in {checkpoint_dir} (no 'latest' file); give --tag.")
        with open(latest) as f:
            tag = f.read().strip()
    path = os.path.join(checkpoint_dir, tag, "mp_rank_00_model_states.pt")
    if os.path.isfile(os.path.join(checkpoint_dir, tag, "zero_pp_rank_0_mp_rank_00_model_states.pt")):
        module = zero3_module_state(checkpoint_dir, tag)
    elif os.path.isfile(path):
        states = torch.load(path, map_location="cpu", weights_only=True)
        module = states.get("module") if isinstance(states, dict) else None
    else:
        raise FileNotFoundError(f"{path} does not exist: not a checkpoint of this trainer.")
    if not module:
        raise ValueError(f"{path} holds no module weights.")
    head = {name[len("head."):]: tensor for name, tensor in module.items() if name.startswith("head.")}
    if not head:
        raise ValueError(f"{path} holds no EAGLE-3 head weights (no 'head.' keys).")
    return tag, head


def zero3_module_state(checkpoint_dir: str, tag: str) -> dict[str, torch.Tensor]:
    """The module weights of a ZeRO-3 checkpoint, joined from every rank's partition (DeepSpeed's
    ``zero_to_fp32``, which turns buffers into floats: the vocabulary maps get their types back)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=tag)
    for name in list(state):
        if name.endswith(".d2t"):
            state[name] = state[name].round().long()
        elif name.endswith(".t2d"):
            state[name] = state[name] != 0
    return state


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config_path = args.config or os.path.join(args.savedir, "config.json")
    if not os.path.isfile(config_path):
        raise SystemExit(f"No head config at {config_path}: pass --config (the config.json of the head being trained).")
    tag, state = read_module_state(os.path.join(args.savedir, "checkpoints"), args.tag)
    config = read_head_config(config_path)
    if "d2t" in state and state["d2t"].shape[0] != config.draft_vocab_size:
        raise SystemExit(f"{config_path} says draft_vocab_size={config.draft_vocab_size} but the checkpoint's d2t "
                         f"has {state['d2t'].shape[0]} entries: not this run's config.")
    save_head_state(state, config, args.output, getattr(torch, args.dtype))
    logger.info("Exported the head of checkpoint %s to %s", tag, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
