"""The layouts EAGLE-3 heads are published in, read into the one form :class:`Eagle3DraftHead` takes.

Each publisher's serving or training code defines what its checkpoints mean; this module reads them as that code
does (the sources are named where each rule is applied):

- **EAGLE reference** (``yuhuili/EAGLE3-*``, SafeAILab's trainer): ``LlamaForCausalLM``, ``midlayer.*``, ``d2t``
  and ``t2d``;
- **SpecForge / SGLang** (``lmsys/*``): ``LlamaForCausalLMEagle3``, ``eagle_config`` with the target layers;
  SGLang's ``llama_eagle3.py`` gives ``fc`` a bias when the config sets ``bias`` and shares the target's LM head
  when ``draft_vocab_size`` is null;
- **NVIDIA ModelOpt** (``nvidia/*-Eagle3``): ``modelopt/torch/export/plugins/hf_spec_export.py`` writes no
  ``t2d`` (inference never reads it), ``midlayer.*`` in older exports and ``layers.0.*`` in newer ones,
  ``eagle_config`` with ``use_aux_hidden_state`` (without it: no ``fc``, no ``hidden_norm``),
  ``use_input_layernorm_in_first_layer``, ``use_last_layernorm``, ``use_mtp_layernorm``; several layers as
  ``midlayer.<i>.*`` / ``layers.<i>.*``;
- **speculators** (vLLM's training library, ``Eagle3Speculator``): every LLaMA field nested under
  ``transformer_layer_config``, ``draft_vocab_size``, ``norm_before_residual`` (vLLM's
  ``transformers_utils/configs/speculators/algos.py`` defaults it to true when absent), ``norm_before_fc``,
  ``layers.<i>.*`` and an ``fc`` that may have a bias.

What a layout means for the computation and no head here implements is refused, naming it (fc_norm,
norm_output, parallel draft heads, a non-LLaMA draft layer...), never loaded and ignored.
"""

from __future__ import annotations

import re

import torch

from eagle.model.heads.draft_config import EConfig

REFERENCE, SGLANG, MODELOPT, SPECULATORS, EAGLE1 = ("EAGLE reference", "SpecForge / SGLang", "NVIDIA ModelOpt",
                                                    "speculators (vLLM)", "EAGLE-1 reference")
#: eagle_config fields of ModelOpt exports, with the value this engine's heads compute (others are refused).
MODELOPT_FLAGS = {"use_input_layernorm_in_first_layer": True, "use_last_layernorm": True, "use_mtp_layernorm": False}
#: speculators fields with the value this engine's heads compute (others are refused).
SPECULATORS_FLAGS = {"fc_norm": False, "norm_output": False}


def is_eagle3_config(raw: dict) -> bool:
    """Whether a head's config.json describes an EAGLE-3 head (an EAGLE-1 config has no draft vocabulary)."""
    return "draft_vocab_size" in raw or "speculators_model_type" in raw or "eagle_config" in raw


def read_head_config(raw: dict, use_eagle3: bool = True) -> tuple[EConfig, str]:
    """A head's config.json (as a dict) in any published layout -> (EConfig in this project's form, layout name).
    ``ValueError`` naming the layout and the field for what no head here computes."""
    if not use_eagle3:
        return EConfig(**raw), EAGLE1
    raw, layout = dict(raw), _layout_of(raw)
    if layout == SPECULATORS:
        raw = _flatten_speculators(raw)
    nested = dict(raw.get("eagle_config") or {})
    for field, supported in MODELOPT_FLAGS.items():
        if field in nested and bool(nested[field]) != supported:
            raise ValueError(f"This {layout} head sets eagle_config.{field}={nested[field]!r}; the heads here "
                             f"compute {field}={supported} only.")
    if int(nested.get("parallel_draft_step") or 1) > 1:
        raise ValueError(f"This {layout} head has parallel draft heads (eagle_config.parallel_draft_step="
                         f"{nested['parallel_draft_step']}), which the heads here do not implement.")
    if "norm_before_fc" in nested and "norm_before_fc" not in raw:  # vLLM reads it there for NVIDIA checkpoints
        raw["norm_before_fc"] = nested["norm_before_fc"]
    if raw.get("draft_vocab_size") is None:  # null: the full vocabulary (vLLM, SGLang)
        raw["draft_vocab_size"] = raw.get("vocab_size")
    return EConfig(**raw), layout


def _layout_of(raw: dict) -> str:
    if "speculators_model_type" in raw:
        return SPECULATORS
    nested = raw.get("eagle_config") or {}
    if any(field in nested for field in MODELOPT_FLAGS):
        return MODELOPT
    if "LlamaForCausalLMEagle3" in (raw.get("architectures") or []) or nested:
        return SGLANG
    return REFERENCE


def _flatten_speculators(raw: dict) -> dict:
    """speculators' config -> a flat LLaMA head config, as vLLM's ``SpeculatorsConfig`` builds it."""
    if raw["speculators_model_type"] != "eagle3":
        raise ValueError(f"This speculators checkpoint is a {raw['speculators_model_type']!r} draft, not an EAGLE-3 "
                         "head.")
    layer = raw.get("transformer_layer_config") or raw.get("transformer_config")
    if not isinstance(layer, dict):
        raise ValueError("This speculators EAGLE-3 config has no transformer_layer_config: the draft layer's sizes "
                         "(hidden_size, vocab_size, heads...) are missing.")
    if layer.get("model_type", "llama") != "llama":
        raise ValueError(f"This speculators head's draft layer is a {layer['model_type']!r} layer; the heads here "
                         "implement LLaMA layers only.")
    for field, supported in SPECULATORS_FLAGS.items():
        if bool(raw.get(field, supported)) != supported:
            raise ValueError(f"This speculators head sets {field}={raw[field]!r}, which the heads here do not "
                             "implement.")
    flat = {**layer, "draft_vocab_size": raw.get("draft_vocab_size"),
            "norm_before_residual": raw.get("norm_before_residual", True),
            "norm_before_fc": raw.get("norm_before_fc", False)}
    for field in ("target_hidden_size", "eagle_aux_hidden_state_layer_ids", "eagle_tree"):
        if raw.get(field) is not None:
            flat[field] = raw[field]
    return flat


def _renamed(key: str) -> str:
    """A checkpoint key in this project's names: the first decoder layer is ``midlayer.``, the others
    ``layers.<i>.`` (vLLM maps ``midlayer.`` to ``layers.0.``; ModelOpt's older several-layer exports write
    ``midlayer.<i>.``)."""
    match = re.match(r"(?:model\.)?(?:layers|midlayer)\.(\d+)\.(.*)", key)
    if match:
        index, rest = int(match.group(1)), match.group(2)
        return f"midlayer.{rest}" if index == 0 else f"layers.{index}.{rest}"
    return key


def read_head_state(config: EConfig, state: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors in this project's names, and ``config`` completed from them (in place): biases
    where the checkpoint has them, ``lm_head_from_target`` for a full-vocabulary head without an LM head, a
    ``t2d`` rebuilt from ``d2t`` where it is missing (the draft vocabulary's target ids)."""
    if layout == EAGLE1:
        return state
    state = {_renamed(key): tensor for key, tensor in state.items()}
    config.fc_bias = "fc.bias" in state
    config.qkv_bias = any(re.search(r"self_attn\.[qkv]_proj\.bias$", key) for key in state)
    config.o_proj_bias = any(key.endswith("self_attn.o_proj.bias") for key in state)
    config.mlp_bias = any(re.search(r"mlp\.\w+_proj\.bias$", key) for key in state)
    config.lm_head_from_target = "lm_head.weight" not in state and config.draft_vocab_size == config.vocab_size
    if config.lm_head_from_target and getattr(config, "tie_word_embeddings", False):
        raise ValueError(f"This {layout} head has no lm_head and sets tie_word_embeddings: SGLang then drafts with "
                         "the head's input embedding as its LM head, which the heads here do not implement.")
    if "d2t" in state and "t2d" not in state and config.draft_vocab_size != config.vocab_size:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[torch.arange(state["d2t"].numel()) + state["d2t"].long()] = True
        state["t2d"] = t2d
    return state
