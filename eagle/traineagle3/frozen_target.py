"""Loading the frozen target model (any decoder family transformers ships, or a GGUF file) and reading the
EAGLE-3 features from it."""

from __future__ import annotations

import logging

import torch

from eagle.model.backends.onednn import pack_linear_layers, should_auto_pack
from eagle.model.base.loading import split_gguf_path  # the trainer and EaModel accept the same base model paths

logger = logging.getLogger(__name__)


def load_tokenizer(basepath: str):
    from transformers import AutoTokenizer

    directory, gguf_file = split_gguf_path(basepath)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoTokenizer.from_pretrained(directory, **kwargs)


def load_target(basepath: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """The frozen target (``AutoModelForCausalLM``, eval mode, no gradients) and its tokenizer."""
    from transformers import AutoModelForCausalLM

    directory, gguf_file = split_gguf_path(basepath)
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    logger.info("Loading the target model from %s%s", directory, f" ({gguf_file})" if gguf_file else "")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    if should_auto_pack(model):  # the target only ever runs without gradients: packed CPU weights are faster
        pack_linear_layers(model)
    tokenizer = load_tokenizer(basepath)
    return model, tokenizer


def text_config(model):
    """The decoder's config (multimodal wrappers keep it in ``text_config``)."""
    config = model.config
    return getattr(config, "text_config", None) or config


def feature_layer_ids(num_layers: int) -> list[int]:
    """Indices into HF ``output_hidden_states`` (the inputs of those layers) whose concatenation is the EAGLE-3
    feature: ``[2, L // 2, L - 3]``, the same as the inference engine's."""
    from eagle.model.base.target import eagle3_layer_ids

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
