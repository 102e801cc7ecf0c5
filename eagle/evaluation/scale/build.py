"""Writing a widened pair (see :mod:`eagle.evaluation.scale.widen`) as a Hugging Face model directory and an EAGLE-3
head directory, tensor by tensor: the source model (small) is held in float32, each widened tensor is built, added
to a safetensors shard of at most ``shard_bytes`` and dropped once the shard is written, so a widened 8B model never
exists in memory as a whole."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from eagle.evaluation.scale.widen import (UNTIED_FAMILIES, Shape, Widener, check_family, widened_head_tensors,
                                          widened_model_tensors)

logger = logging.getLogger(__name__)

RECORD = "widening.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ShardWriter:
    """Safetensors shards ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``."""

    def __init__(self, directory: Path, shard_bytes: int):
        self.directory, self.shard_bytes = directory, shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.files: list[tuple[Path, list[str]]] = []
        self.total = self.pending_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.shard_bytes:
            self.flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += size
        self.total += size

    def flush(self) -> None:
        path = self.directory / f"shard-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Write the last shard, name the shards by their count and write the index."""
        if self.pending:
            self.flush()
        count, weight_map = len(self.files), {}
        for i, (path, names) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{count:05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_tensors(tensors, directory: Path, count: int, shard_bytes: int, desc: str) -> None:
    writer = ShardWriter(directory, shard_bytes)
    for name, tensor in tqdm(tensors, total=count, desc=desc, unit="tensor"):
        writer.add(name, tensor)
    writer.finish()


def load_source(base_model_path: str):
    """The source model in float32 (a GGUF file is dequantized by transformers) and its tokenizer."""
    from eagle.model.base.loading import load_base_model

    model, tokenizer = load_base_model(base_model_path, dtype=torch.float32)
    if model.config.model_type != "llama":
        raise ValueError(f"{base_model_path} is a {model.config.model_type!r} model; the widening handles the Llama "
                         "architecture (model_type 'llama').")
    if getattr(model.config, "attention_bias", False) or getattr(model.config, "mlp_bias", False):
        raise ValueError(f"{base_model_path} has attention or MLP biases; the widening handles Llama without biases.")
    return model, tokenizer


#: each family's transformers class
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
#: what a Llama config and the other families' configs share
SHARED_FIELDS = ("vocab_size", "hidden_act", "max_position_embeddings", "initializer_range", "rope_parameters",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_dropout")


def family_fields(shape: Shape, family: str) -> dict:
    """The config fields of ``family`` beyond a Llama config's: full attention everywhere, and for ``qwen2_moe``
    every layer sparse with the shape's experts, routing without renormalisation (as llama.cpp's qwen2moe)."""
    fields = {"use_sliding_window": False}
    if family in UNTIED_FAMILIES:
        fields["tie_word_embeddings"] = False
    if family == "qwen2_moe":
        fields.update(num_experts=shape.experts, num_experts_per_tok=shape.experts_per_token,
                      moe_intermediate_size=shape.expert_size, shared_expert_intermediate_size=shape.intermediate_size,
                      norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True)
    return fields


def widened_config(config, shape: Shape, widener: Widener, dtype: torch.dtype):
    """The widened model's transformers config: the source's (a copy, or for another family its shared fields) with
    the widened sizes and RMSNorm epsilon."""
    from transformers import AutoConfig

    fields = config.to_dict()
    fields.pop("quantization_config", None)  # transformers' record of a GGUF source: the weights are plain here
    sizes = {field: getattr(shape, field) for field in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                         "intermediate_size", "num_hidden_layers", "head_dim")}
    if widener.family == "llama":
        out = config.__class__.from_dict(fields)
        for field, value in sizes.items():
            setattr(out, field, value)
    else:
        shared = {field: fields[field] for field in SHARED_FIELDS if field in fields}
        out = AutoConfig.for_model(widener.family, **{**shared, **sizes, **family_fields(shape, widener.family)})
    out.rms_norm_eps = widener.eps(config.rms_norm_eps)
    out.architectures = [ARCHITECTURES[widener.family]]
    out.dtype = dtype
    return out


def build_model(model, tokenizer, shape: Shape, directory: Path, dtype: torch.dtype, seed: int,
                shard_bytes: int, family: str = "llama") -> Widener:
    """Write the widened model (an architecture of ``family``), its config, generation config and tokenizer to
    ``directory``."""
    widener = Widener(Shape.of_config(model.config), shape, seed, dtype, str(model.config.name_or_path), family)
    directory.mkdir(parents=True, exist_ok=True)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    count = 2 + widener.tensors_per_layer() * shape.num_hidden_layers + (0 if tied and family not in UNTIED_FAMILIES
                                                                         else 1)
    write_tensors(widened_model_tensors(state, widener, tied), directory, count, shard_bytes, f"model {shape.name}")
    widened_config(model.config, shape, widener, dtype).save_pretrained(directory)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return widener


def head_source_shape(config: dict, ea_model_path: str, target: Shape) -> Shape:
    """The shape of an EAGLE-3 head (from its ``config.json``), checked to read the source target's features."""
    if "draft_vocab_size" not in config:
        raise ValueError(f"The head at {ea_model_path} has no `draft_vocab_size` in its config.json: the widening "
                         "handles EAGLE-3 heads.")
    heads = config["num_attention_heads"]
    shape = Shape("head", config["hidden_size"], heads, config.get("num_key_value_heads", heads),
                  config["intermediate_size"], 1, config.get("head_dim") or config["hidden_size"] // heads)
    reads = config.get("target_hidden_size") or shape.hidden_size
    if reads != target.hidden_size or shape.hidden_size != target.hidden_size:
        raise ValueError(f"The head at {ea_model_path} has hidden_size {shape.hidden_size} and reads target "
                         f"features of {reads}; the widening expects both to be the source model's "
                         f"{target.hidden_size}.")
    return shape


def widened_head_config(config: dict, shape: Shape, widener: Widener, target: Shape, dtype: torch.dtype) -> dict:
    """The head's ``config.json`` with the widened sizes and RMSNorm epsilon; the target layers it reads named."""
    from eagle.model.base.target import eagle3_layer_ids
    from eagle.model.heads.draft_config import head_layer_ids

    config = {**config, "hidden_size": shape.hidden_size, "num_attention_heads": shape.num_attention_heads,
              "num_key_value_heads": shape.num_key_value_heads, "intermediate_size": shape.intermediate_size,
              "head_dim": shape.head_dim, "target_hidden_size": shape.hidden_size,
              "rms_norm_eps": widener.eps(config["rms_norm_eps"]), "dtype": str(dtype).removeprefix("torch.")}
    config.pop("torch_dtype", None)
    if head_layer_ids(SimpleNamespace(**config)) is None:  # the default ids depend on the layer count: keep them
        config["eagle_aux_hidden_state_layer_ids"] = eagle3_layer_ids(target.num_hidden_layers)
    return config


def build_head(ea_model_path: str, target: Shape, shape: Shape, directory: Path, dtype: torch.dtype, seed: int
               ) -> None:
    """Write the widened EAGLE-3 head (config.json and model.safetensors) to ``directory``; ``target``: the source
    model's shape, ``shape``: the widened one (the head takes its width, heads and intermediate size: a mixture of
    experts' shared expert width)."""
    from eagle.model.heads.checkpoint import load_head_state_dict
    from eagle.model.heads.loading import load_raw_head_config

    config = load_raw_head_config(ea_model_path)
    source = head_source_shape(config, ea_model_path, target)
    layer = dataclasses.replace(shape, num_hidden_layers=1, experts=0, experts_per_token=0, expert_size=0)
    widener = Widener(source, layer, seed + 1, dtype, ea_model_path)  # a Llama layer, dense, without biases
    state = {name: tensor.float() if tensor.is_floating_point() else tensor
             for name, tensor in load_head_state_dict(ea_model_path).items()}
    directory.mkdir(parents=True, exist_ok=True)
    tensors = dict(tqdm(widened_head_tensors(state, widener), total=len(state), desc="head", unit="tensor"))
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = widened_head_config(config, shape, widener, target, dtype)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def build_record(shape: Shape, family: str, base_model_path, ea_model_path, dtype: torch.dtype, seed: int) -> dict:
    """What ``widening.json`` records of a build (a Llama pair's record names no family and no experts)."""
    fields = {k: v for k, v in dataclasses.asdict(shape).items()
              if v or k not in ("experts", "experts_per_token", "expert_size")}
    record = {"shape": fields, "base_model_path": str(base_model_path), "ea_model_path": str(ea_model_path),
              "dtype": str(dtype).removeprefix("torch."), "seed": seed}
    return record if family == "llama" else {**record, "family": family}


def build_pair(shape: Shape, out: str | os.PathLike, base_model_path: str | None = None,
               ea_model_path: str | None = None, dtype: torch.dtype = torch.float16, seed: int = 0,
               shard_bytes: int = 2 * 2**30, force: bool = False, family: str = "llama") -> tuple[Path, Path]:
    """Build the widened pair under ``out`` (``out/model``: a Hugging Face model directory of ``family``'s
    architecture; ``out/head``: its EAGLE-3 head) from a Llama model and its head (default: the embedded pair). A
    pair already built there with the same settings (its ``widening.json``) is kept unless ``force``. Returns
    ``(model_dir, head_dir)``."""
    from eagle.defaults import resolve_model_paths

    check_family(shape, family)
    base_model_path, ea_model_path = resolve_model_paths(base_model_path, ea_model_path)
    out = Path(out).expanduser()
    record = build_record(shape, family, base_model_path, ea_model_path, dtype, seed)
    model_dir, head_dir = out / "model", out / "head"
    if not force and (out / RECORD).is_file() and json.loads((out / RECORD).read_text()) == record:
        logger.info("The widened pair %s is already built in %s", shape.name, out)
        return model_dir, head_dir
    for directory in (model_dir, head_dir, out / RECORD):
        if directory.is_dir():
            shutil.rmtree(directory)
        elif directory.exists():
            directory.unlink()
    logger.info("Loading the source model %s", base_model_path)
    model, tokenizer = load_source(base_model_path)
    source = Shape.of_config(model.config)
    build_model(model, tokenizer, shape, model_dir, dtype, seed, shard_bytes, family)
    del model
    build_head(ea_model_path, source, shape, head_dir, dtype, seed)
    (out / RECORD).write_text(json.dumps(record, indent=2) + "\n")
    logger.info("Built the widened pair %s: %s and %s", shape.name, model_dir, head_dir)
    return model_dir, head_dir
