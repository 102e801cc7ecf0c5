"""Tiny randomly initialised target models and draft heads, saved in the published layouts, for tests.

Everything is built locally (no network): a character-level tokenizer with a ChatML template, a target of any
supported family, and an EAGLE-3 or EAGLE-1 head whose checkpoint has exactly the official keys.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB = 128
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "mixtral", "phi3", "gemma"]
# The families of the checkpoints README.md's table lists, beyond FAMILIES: the transformers model type and tiny
# settings that bring each family's attention boundaries close (Llama 4's 8-token chunks and query temperature
# steps every 4 positions, GPT-OSS's 8-token windows), so that short contexts cross them. "minicpm" is a model
# directory with its own code (tests/remote_code/minicpm_style), loaded with trust_remote_code=True.
CHECKPOINT_FAMILIES = {
    "llama-rope3": ("llama", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 32})),
    "qwen3-tied": ("qwen3", dict(head_dim=16, use_sliding_window=False, tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3_moe", dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)),
    "llama4_text": ("llama4_text", dict(head_dim=16, intermediate_size_mlp=128, num_local_experts=2,
                                        num_experts_per_tok=1, attention_chunk_size=8, floor_scale=4, attn_scale=1.0,
                                        no_rope_layer_interval=2, initializer_range=0.1)),
    "gpt_oss": ("gpt_oss", dict(head_dim=16, sliding_window=8, num_local_experts=4, num_experts_per_tok=2,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                                                 "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                                 "beta_slow": 1.0, "truncate": False})),
    "glm4_moe_lite": ("glm4_moe_lite", dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=32,
                                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                            n_shared_experts=1)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
    "granitemoe": ("granitemoe", dict(num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
                                      residual_multiplier=0.22, logits_scaling=4.0, attention_multiplier=0.125,
                                      tie_word_embeddings=True)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("qwen2", dict(use_sliding_window=False)),
}
REMOTE_CODE = Path(__file__).resolve().parent / "remote_code" / "minicpm_style"


def make_tokenizer(directory: Path):
    """A character-level fast tokenizer with VOCAB ids (specials first) and a ChatML chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {tok: i for i, tok in enumerate(SPECIALS + chars)}
    filler = 0
    while len(vocab) < VOCAB:
        vocab[f"<extra_{filler}>"] = len(vocab)
        filler += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="<|im_end|>", unk_token="<unk>", pad_token="<pad>",
        additional_special_tokens=["<|im_start|>", "</s>"],
    )
    fast.chat_template = CHATML
    fast.save_pretrained(directory)
    return fast


def target_config(family: str, layers: int = 6, **overrides):
    """A tiny config of ``family`` with VOCAB tokens; eos = <|im_end|> (id 5)."""
    from transformers import AutoConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=5, pad_token_id=0, tie_word_embeddings=False, initializer_range=0.5)
    extra = {
        "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
        "mistral": dict(sliding_window=None),
        "qwen2": dict(use_sliding_window=False),
        "qwen3": dict(head_dim=16, use_sliding_window=False),
        "phi3": dict(pad_token_id=0, sliding_window=None),
        "gemma": dict(head_dim=16),
    }.get(family, {})
    model_type = family
    if family in CHECKPOINT_FAMILIES:
        model_type, extra = CHECKPOINT_FAMILIES[family]
    kwargs = {**common, **extra, **overrides}
    return AutoConfig.for_model(model_type, **kwargs)


def make_target(directory: Path, family: str = "llama", seed: int = 0, layers: int = 6, **overrides):
    """Save a random tiny target (float32, SDPA) and the tokenizer to ``directory``; return the model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = target_config(family, layers=layers, **overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    make_tokenizer(directory)
    return model


def make_remote_target(directory: Path, seed: int = 0, **overrides):
    """Save a tiny MiniCPM-style model whose code lives in its directory (``auto_map``: the transformers 4 forward
    of tests/remote_code/minicpm_style) and the tokenizer to ``directory``; return the model (loaded with
    ``trust_remote_code=True``, as a user would only when asked)."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    for name in ("configuration_minicpm.py", "modeling_minicpm.py"):
        shutil.copy(REMOTE_CODE / name, directory / name)
    config = {"model_type": "minicpm", "architectures": ["MiniCPMForCausalLM"],
              "auto_map": {"AutoConfig": "configuration_minicpm.MiniCPMConfig",
                           "AutoModelForCausalLM": "modeling_minicpm.MiniCPMForCausalLM"},
              "vocab_size": VOCAB, **overrides}
    (directory / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory, trust_remote_code=True),
                                             trust_remote_code=True).eval()
    model.save_pretrained(directory)
    make_tokenizer(directory)
    return AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()


def head_config_dict(target_cfg, eagle3: bool, draft_vocab_size: int | None = None) -> dict:
    text = target_cfg.get_text_config()
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "vocab_size": text.vocab_size,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 5,
        "rope_theta": 10000.0,
        "torch_dtype": "float16",
        "tie_word_embeddings": False,
    }
    if eagle3:
        cfg["draft_vocab_size"] = draft_vocab_size or text.vocab_size
    else:
        cfg["bias"] = True
    return cfg


def make_head(directory: Path, target_model, eagle3: bool = True, draft_vocab_size: int | None = None, seed: int = 1,
              fmt: str = "safetensors", state_dict: dict | None = None, extra_config: dict | None = None):
    """Save a random head for ``target_model`` in the official layout (no embedding); return its state dict.
    ``extra_config``: fields added to its config.json (``qkv_bias``, ``num_hidden_layers``...)."""
    from eagle.model import cnets, cnets1
    from eagle.model.configs import EConfig

    cfg = {**head_config_dict(target_model.config, eagle3, draft_vocab_size), **(extra_config or {})}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    if state_dict is None:
        torch.manual_seed(seed)
        config = EConfig(**cfg)
        head = cnets.Model(config) if eagle3 else cnets1.Model(config)
        for name, param in head.named_parameters():
            if name.endswith("weight") and param.dim() == 2:
                torch.nn.init.normal_(param, std=0.2)
        if eagle3 and cfg["draft_vocab_size"] < cfg["vocab_size"]:
            used = torch.randperm(cfg["vocab_size"])[: cfg["draft_vocab_size"]].sort().values
            head.d2t.copy_(used - torch.arange(cfg["draft_vocab_size"]))
            head.t2d.zero_()
            head.t2d[used] = True
        state_dict = {k: v for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}
        if eagle3 and cfg["draft_vocab_size"] == cfg["vocab_size"]:
            state_dict = {k: v for k, v in state_dict.items() if k not in ("d2t", "t2d")}
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in state_dict.items()}, str(directory / "model.safetensors"))
    else:
        torch.save(state_dict, directory / "pytorch_model.bin")
    return state_dict


def make_tiny_pair(tmp_path: Path, family: str = "llama", eagle3: bool = True, draft_vocab_size: int | None = None,
                   seed: int = 0, fmt: str = "safetensors") -> tuple[Path, Path]:
    """Save a tiny target and a head for it under ``tmp_path``; return ``(base_dir, head_dir)``."""
    base_dir = Path(tmp_path) / f"{family}-base"
    head_dir = Path(tmp_path) / f"{family}-{'eagle3' if eagle3 else 'eagle1'}-{draft_vocab_size or 'full'}"
    model = make_target(base_dir, family, seed=seed) if not (base_dir / "config.json").exists() else None
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(base_dir)
    make_head(head_dir, model, eagle3=eagle3, draft_vocab_size=draft_vocab_size, seed=seed + 1, fmt=fmt)
    return base_dir, head_dir


def train_head_quickly(base_dir: Path, head_dir: Path, eagle3: bool = True, steps: int = 150, seed: int = 0,
                       num_sequences: int = 32, length: int = 40, lr: float = 3e-3) -> torch.Tensor:
    """Fit the head at ``head_dir`` for a few seconds to its tiny target's own greedy continuations of random
    4-token prompts (teacher forcing on the target's features, plus one step on the head's own features), and
    save it in place. Returns the prompts (num_sequences, 4): on them the head is accepted often, which is what
    tests of multi-token acceptance need. This is a test utility, not the project's trainer.
    """
    import torch.nn.functional as F
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from eagle.model import cnets, cnets1
    from eagle.model.configs import EConfig
    from eagle.model.base.target import eagle3_layer_ids

    torch.manual_seed(seed)
    target = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    prompts = torch.randint(6, target.config.vocab_size, (num_sequences, 4))
    with torch.no_grad():
        seqs = target.generate(prompts, max_new_tokens=length, min_new_tokens=length, do_sample=False, pad_token_id=0)
        out = target(seqs, output_hidden_states=True)
    layers = eagle3_layer_ids(target.config.num_hidden_layers) if eagle3 else [-1]
    features = torch.cat([out.hidden_states[i] for i in layers], dim=-1)
    labels = out.logits.argmax(-1)  # the target's choice after each position

    config = EConfig.from_json_file(str(head_dir / "config.json"))
    head = cnets.Model(config) if eagle3 else cnets1.Model(config)
    head.load_state_dict(load_file(str(head_dir / "model.safetensors")), strict=False)
    head.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.data)
    if not eagle3:
        head.attach_target_lm_head(target.get_output_embeddings())
    params = [p for n, p in head.named_parameters() if not n.startswith("embed_tokens")]
    with torch.no_grad():  # start near zero: the random test head's outputs are far too large to learn from quickly
        for param in params:
            if param.dim() == 2:
                param.mul_(0.1)
    optim = torch.optim.Adam(params, lr=lr)
    # pair (feature of t, token t+1) -> the target's choice after t+1
    feats, next_tokens, targets = features[:, :-1], seqs[:, 1:], labels[:, 1:]
    if eagle3 and head.reduced_vocab:
        # draft vocabulary = the most frequent target choices; other positions are left out of the loss
        counts = torch.bincount(targets.flatten(), minlength=head.vocab_size)
        used = counts.argsort(descending=True, stable=True)[: head.draft_vocab_size].sort().values
        head.d2t.copy_(used - torch.arange(head.draft_vocab_size))
        head.t2d.zero_()
        head.t2d[used] = True
        to_draft = torch.full((head.vocab_size,), -100, dtype=torch.long)
        to_draft[used] = torch.arange(head.draft_vocab_size)
        targets = to_draft[targets]
    for _ in range(steps):
        hidden = head(feats, next_tokens)
        loss = F.cross_entropy(head.compute_logits(hidden).flatten(0, 1), targets.flatten())
        hidden2 = head(hidden[:, :-1], next_tokens[:, 1:])  # second draft step reads the head's own states
        loss = loss + F.cross_entropy(head.compute_logits(hidden2).flatten(0, 1), targets[:, 1:].flatten())
        optim.zero_grad()
        loss.backward()
        optim.step()
    state = {k: v.detach().clone() for k, v in head.state_dict().items() if not k.startswith("embed_tokens")}
    if eagle3 and not head.reduced_vocab:
        state = {k: v for k, v in state.items() if k not in ("d2t", "t2d")}
    save_file({k: v.contiguous() for k, v in state.items()}, str(head_dir / "model.safetensors"))
    return prompts


def write_gguf_target(model, path: Path, architecture: str, type_name: str = "Q8_0") -> Path:
    """Write ``model`` (a tiny float32 causal LM) as a GGUF file of ``architecture`` (gguf-py's name: ``llama``,
    ``qwen2``, ``qwen3``, ``gemma3``) that transformers loads back: its matrices in ``type_name`` blocks, norms and
    the embedding in float32, stored as llama.cpp stores them (Llama's Q / K rows interleaved, Gemma's norms plus
    one). No tokenizer: the model alone is loaded."""
    import gguf
    import numpy as np

    from eagle.model.backends.gguf import hf_to_gguf_names, llama_permuted

    config = model.config.get_text_config()
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name(architecture)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(model.model.layers[0].self_attn.head_dim)
    writer.add_value_length(model.model.layers[0].self_attn.head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters.get("rope_theta", 10000.0)
                                    if "full_attention" not in config.rope_parameters else
                                    config.rope_parameters["full_attention"]["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if getattr(config, "sliding_window", None) and architecture == "gemma3":
        writer.add_sliding_window(config.sliding_window)
    if getattr(config, "num_experts", None):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    permuted = llama_permuted(architecture)
    for hf_name, gguf_name in hf_to_gguf_names(model, architecture).items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        tensor = model.state_dict()[hf_name].detach().float().numpy()
        if hf_name.endswith("shared_expert_gate.weight"):  # llama.cpp stores it as a vector
            tensor = tensor[0]
        if architecture == "gemma3" and hf_name.endswith("norm.weight"):
            tensor = tensor + 1
        if permuted and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            tensor = tensor.reshape(heads, 2, tensor.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(tensor.shape)
        if tensor.ndim == 2 and "embed" not in hf_name:
            kind = getattr(gguf.GGMLQuantizationType, type_name)
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(tensor, dtype=np.float32))
    _write_experts(writer, model, type_name)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _write_experts(writer, model, type_name: str) -> None:
    """A mixture-of-experts model's stacked expert matrices as llama.cpp stores them: per layer
    ``ffn_{gate,up,down}_exps`` of shape (experts, out, in), from transformers' fused ``gate_up_proj`` (gate rows
    first) and ``down_proj``."""
    import gguf

    kind = getattr(gguf.GGMLQuantizationType, type_name)
    for index, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            continue
        gate, up = experts.gate_up_proj.detach().float().chunk(2, dim=1)
        for name, tensor in (("gate", gate), ("up", up), ("down", experts.down_proj.detach().float())):
            writer.add_tensor(f"blk.{index}.ffn_{name}_exps.weight",
                              gguf.quants.quantize(tensor.contiguous().numpy(), kind), raw_dtype=kind)
