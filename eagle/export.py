"""Export an EAGLE-3 head for another engine. ``--format llama.cpp`` writes a GGUF file that llama.cpp
(llama-server, llama-speculative) loads as an EAGLE-3 draft model (architecture ``eagle3``) next to the target's
GGUF::

    python -m eagle.export --format llama.cpp --output head.gguf                  # the embedded default pair
    python -m eagle.export --format llama.cpp --ea-model-path runs/head/state_9 \\
        --base-model-path target.Q8_0.gguf --output head.gguf
    llama-server -m target.Q8_0.gguf -md head.gguf --spec-type draft-eagle3 --spec-draft-n-max 3

The base model must be the target's GGUF (the file llama.cpp will run as the target): the draft carries the
target's tokenizer, and its layer count and hidden size are checked against the head. The head's weights are
written as float16 (1-D norms as float32), q/k rows in llama.cpp's RoPE order, ``d2t`` as absolute target token
ids (int64), as llama.cpp's own ``convert_hf_to_gguf.py --target-model-dir`` writes them.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import numpy as np
import torch

logger = logging.getLogger("eagle.export")

ARCH = "eagle3"
# Our head's tensor names (the published EAGLE-3 keys) -> llama.cpp's eagle3 tensor names (src/llama-arch.cpp).
TENSOR_NAMES = {
    "fc.weight": "fc.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m eagle.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", required=True, choices=["llama.cpp"], help="Target engine (llama.cpp: GGUF).")
    parser.add_argument("--ea-model-path", default=None,
                        help="EAGLE-3 head directory (config.json + model.safetensors); default: the embedded head.")
    parser.add_argument("--base-model-path", default=None,
                        help="The target's GGUF file (default: the embedded SmolLM2-135M-Instruct GGUF).")
    parser.add_argument("--output", required=True, help="GGUF file to write.")
    return parser


class TargetGGUF:
    """What the draft needs from the target's GGUF: its shape and its tokenizer's key/value fields."""

    def __init__(self, path: str):
        import gguf

        if not (os.path.isfile(path) and path.endswith(".gguf")):
            raise ValueError(f"{path} is not a .gguf file: llama.cpp runs the target from its GGUF, and the draft "
                             "takes the tokenizer from it (convert an HF target with llama.cpp's convert_hf_to_gguf.py).")
        reader = gguf.GGUFReader(path)
        self.fields = reader.fields
        self.arch = self.value("general.architecture")
        self.num_layers = int(self.value(f"{self.arch}.block_count"))
        self.hidden_size = int(self.value(f"{self.arch}.embedding_length"))
        self.vocab_size = len(self.fields["tokenizer.ggml.tokens"].data)

    def value(self, key: str):
        if key not in self.fields:
            raise ValueError(f"The target GGUF has no {key!r} field.")
        return self.fields[key].contents()

    def tokenizer_fields(self):
        """(key, value, type, sub_type) of every ``tokenizer.*`` field, to copy into the draft."""
        for key, field in self.fields.items():
            if key.startswith("tokenizer."):
                sub_type = field.types[1] if len(field.types) > 1 else None
                yield key, field.contents(), field.types[0], sub_type


def rope_rows_to_llamacpp(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder the rows of a q/k projection from HF's rotate-half layout (each head's first half holds the real
    parts) to llama.cpp's RoPE, which rotates adjacent pairs."""
    rows, cols = weight.shape
    head_dim = rows // heads
    return weight.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(rows, cols)


def llamacpp_tensors(state: dict[str, torch.Tensor], config, target_vocab: int) -> dict[str, np.ndarray]:
    """The head's tensors under llama.cpp's names and in its layouts."""
    missing = sorted(set(TENSOR_NAMES) - set(state))
    if missing or "d2t" not in state:
        raise ValueError(f"The head has no {missing or ['d2t']}: not an EAGLE-3 head with the published keys.")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    out = {}
    for name, gguf_name in TENSOR_NAMES.items():
        tensor = state[name].float()
        if name.endswith("q_proj.weight"):
            tensor = rope_rows_to_llamacpp(tensor, heads)
        elif name.endswith("k_proj.weight"):
            tensor = rope_rows_to_llamacpp(tensor, kv_heads)
        out[gguf_name] = tensor.numpy().astype(np.float16 if tensor.dim() == 2 else np.float32)
    ids = state["d2t"].long() + torch.arange(state["d2t"].numel())
    if ids.min() < 0 or ids.max() >= target_vocab or ids.unique().numel() != ids.numel():
        raise ValueError(f"The head's d2t maps to ids outside the target's {target_vocab}-token vocabulary or twice.")
    out["d2t"] = ids.numpy().astype(np.int64)
    return out


def check_head_fits_target(config, layer_ids: list[int], target: TargetGGUF) -> int:
    """The target hidden size the head reads; raise if the head was not trained for this target."""
    target_hidden = int(getattr(config, "target_hidden_size", None) or config.hidden_size)
    if target_hidden != target.hidden_size:
        raise ValueError(f"The head reads {target_hidden}-wide target features but the target GGUF's hidden size is "
                         f"{target.hidden_size}: not this head's target.")
    if config.vocab_size != target.vocab_size:
        raise ValueError(f"The head was trained for a {config.vocab_size}-token vocabulary; the target GGUF has "
                         f"{target.vocab_size} tokens.")
    if max(layer_ids) > target.num_layers:
        raise ValueError(f"The head reads target layers {layer_ids}, but the target GGUF has {target.num_layers}.")
    return target_hidden


def read_published_head(ea_model_path: str):
    """(config, tensors in this project's names) of the EAGLE-3 head at ``ea_model_path``, in any layout
    :mod:`eagle.model.heads.layouts` reads (EAGLE, SpecForge, ModelOpt, speculators); ``ValueError`` for an
    EAGLE-1 head, or one using what the eagle3 GGUF written here does not carry (biases, several decoder layers, no
    ``fc``, the target's LM head, ``norm_before_fc``), rather than a file llama.cpp would run differently."""
    from eagle.model.heads.checkpoint import load_head_state_dict
    from eagle.model.heads.draft_head import reads_aux_hidden_states
    from eagle.model.heads.layouts import is_eagle3_config, read_head_config, read_head_state
    from eagle.model.heads.loading import load_raw_head_config

    raw = load_raw_head_config(ea_model_path)
    if not is_eagle3_config(raw):
        raise ValueError(f"{ea_model_path} is not an EAGLE-3 head (its config.json has no draft_vocab_size).")
    config, layout = read_head_config(raw)
    state = read_head_state(config, load_head_state_dict(ea_model_path), layout)
    layers = int(getattr(config, "num_hidden_layers", 1) or 1)
    uses = {"an fc bias": config.fc_bias, "q/k/v, o or MLP biases": config.qkv_bias or config.o_proj_bias
            or config.mlp_bias, f"{layers} decoder layers": layers > 1,
            "no aux hidden states (no fc)": not reads_aux_hidden_states(config),
            "no LM head of its own (it drafts with the target's)": config.lm_head_from_target,
            "norm_before_fc": bool(getattr(config, "norm_before_fc", False))}
    unsupported = [name for name, used in uses.items() if used]
    if unsupported:
        raise ValueError(f"{ea_model_path} ({layout} layout) has {', '.join(unsupported)}: the llama.cpp eagle3 "
                         "draft written here holds one bias-free decoder layer over fc-fused target features and "
                         "its own LM head.")
    return config, state


def write_llamacpp_gguf(ea_model_path: str, base_model_path: str, output: str) -> str:
    """Write the EAGLE-3 head in ``ea_model_path`` as a llama.cpp draft GGUF for the target ``base_model_path``."""
    import gguf

    from eagle.model.heads.draft_config import head_layer_ids
    from eagle.model.base.target import eagle3_layer_ids

    config, state = read_published_head(ea_model_path)
    target = TargetGGUF(base_model_path)
    layer_ids = head_layer_ids(config) or eagle3_layer_ids(target.num_layers)
    target_hidden = check_head_fits_target(config, layer_ids, target)
    tensors = llamacpp_tensors(state, config, target.vocab_size)

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer = gguf.GGUFWriter(output + ".part", ARCH)
    writer.add_name("EAGLE-3 draft head")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(1)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    # EAGLE-3 keys (src/models/eagle3.cpp): the target layers whose input feeds the head, the target's width.
    writer.add_array(f"{ARCH}.target_layers", [int(i) for i in layer_ids])
    writer.add_uint32(f"{ARCH}.target_hidden_size", target_hidden)
    writer.add_bool(f"{ARCH}.norm_before_residual", bool(getattr(config, "norm_before_residual", False)))
    writer.add_bool(f"{ARCH}.norm_before_fc", False)
    for key, value, vtype, sub_type in target.tokenizer_fields():
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(output + ".part", output)
    logger.info("Wrote %s (EAGLE-3 draft for %s, target layers %s)", output, base_model_path, layer_ids)
    return output


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from eagle.defaults import default_base_model_path, default_ea_model_path

    try:
        write_llamacpp_gguf(args.ea_model_path or default_ea_model_path(),
                            args.base_model_path or default_base_model_path(), args.output)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
