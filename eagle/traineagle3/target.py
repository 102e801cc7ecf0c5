"""Loading the frozen target model (any decoder family transformers ships, or a GGUF file) and reading the
EAGLE-3 features from it."""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def resolve_gguf(basepath: str) -> tuple[str, str | None]:
    """``(directory_or_id, gguf_file_name or None)`` for ``from_pretrained``.

    A ``.gguf`` file, or a directory that holds exactly one ``.gguf`` and no ``config.json``, is read through
    transformers' GGUF support (``from_pretrained(dir, gguf_file=name)``)."""
    if os.path.isfile(basepath):
        if not basepath.endswith(".gguf"):
            raise ValueError(f"--basepath {basepath} is a file but not a .gguf file; pass a model directory or a .gguf.")
        return os.path.dirname(os.path.abspath(basepath)), os.path.basename(basepath)
    if os.path.isdir(basepath) and not os.path.isfile(os.path.join(basepath, "config.json")):
        ggufs = sorted(name for name in os.listdir(basepath) if name.endswith(".gguf"))
        if len(ggufs) == 1:
            return basepath, ggufs[0]
        if len(ggufs) > 1:
            raise ValueError(f"{basepath} holds several .gguf files ({', '.join(ggufs)}); pass the one to use.")
        raise FileNotFoundError(f"{basepath} has neither a config.json nor a .gguf file: not a model directory.")
    return basepath, None


def load_tokenizer(basepath: str):
    from transformers import AutoTokenizer

    directory, gguf_file = resolve_gguf(basepath)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(directory, **kwargs)


def load_target(basepath: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The frozen target (``AutoModelForCausalLM``, eval mode, no gradients) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    directory, gguf_file = resolve_gguf(basepath)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    logger.info("Loading the target model from %s%s", directory, f" ({gguf_file})" if gguf_file else "")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    tokenizer = load_tokenizer(basepath)
    return model, tokenizer


def text_config(model):
    """The decoder's config (multimodal wrappers keep it in ``text_config``)."""
    config = model.config
    return getattr(config, "text_config", None) or config


def feature_layer_ids(num_layers: int) -> list[int]:
    """Indices into HF ``output_hidden_states`` (the inputs of those layers) whose concatenation is the EAGLE-3
    feature: ``[2, L // 2, L - 3]``, the same as the inference engine's."""
    from eagle.model.target import eagle3_layer_ids

    return list(eagle3_layer_ids(num_layers))


@torch.no_grad()
def target_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, layer_ids: list[int]):
    """One no-grad target pass.

    Returns ``features`` (B, S, 3*Ht), the concatenated hidden states of ``layer_ids``, and ``logits``
    (B, S, V) in float32: ``logits[:, t]`` is the target's distribution for token ``t + 1``."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    hidden = out.hidden_states
    features = torch.cat([hidden[i] for i in layer_ids], dim=-1)
    return features, out.logits.float()
