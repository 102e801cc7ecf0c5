"""Loading an EAGLE head for a base model, strictly, with the checks that make a mismatch an error instead of garbage."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Collection

import torch

from eagle.model.heads.checkpoint import load_head_state_dict, resolve_file
from eagle.model.heads.draft_config import EConfig
from eagle.model.heads.layouts import is_eagle3_config, read_head_config, read_head_state
from eagle.model.backends.onednn import native_bfloat16

logger = logging.getLogger(__name__)


def load_raw_head_config(ea_model_path: str) -> dict:
    """The head's ``config.json`` as published: ``ea_model_path`` may be a directory, a Hub id, or the file."""
    config_file = ea_model_path if os.path.isfile(ea_model_path) else resolve_file(ea_model_path, "config.json")
    with open(config_file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"The draft head's config {config_file} is not valid JSON: {err}.") from err


def head_dir_of(ea_model_path: str) -> str:
    return os.path.dirname(ea_model_path) if os.path.isfile(ea_model_path) else ea_model_path


def build_head(config: EConfig, use_eagle3: bool):
    """An untrained head of the kind ``use_eagle3`` says, shaped by ``config`` (its tree lives in ``EaModel``)."""
    from eagle.model.heads.draft_head import Eagle1DraftHead, Eagle3DraftHead

    if use_eagle3:
        if not hasattr(config, "draft_vocab_size"):
            raise ValueError(
                "use_eagle3=True but the head's config.json has no `draft_vocab_size`: this looks like an EAGLE-1/2 "
                "head; pass use_eagle3=False."
            )
        return Eagle3DraftHead(config)
    bias = getattr(config, "bias", True)
    return Eagle1DraftHead(config, bias=bias)


def check_head_matches_base(head, base_model) -> None:
    """Sizes must agree: hidden size (the features the head reads) and vocabulary."""
    base = base_model.config.get_text_config()
    base_vocab = base_model.get_output_embeddings().weight.shape[0]
    head_vocab = head.config.vocab_size
    if head_vocab != base_vocab:
        raise ValueError(
            f"The draft head's vocab_size is {head_vocab} but the base model's vocabulary has {base_vocab} tokens: "
            "this head was trained for another base model."
        )
    expected = getattr(head.config, "target_hidden_size", None) or head.config.hidden_size
    if head.eagle_version == 1 or not getattr(head, "reads_aux_hidden_states", True):
        expected = head.config.hidden_size  # it reads the target's final hidden state as its own
    if expected != base.hidden_size:
        raise ValueError(
            f"The draft head reads target hidden states of size {expected} but the base model's hidden_size is "
            f"{base.hidden_size}: this head was trained for another base model."
        )


def optional_keys(head) -> set[str]:
    """Entries a published checkpoint may omit: the embedding (taken from the base model, unless the head's
    hidden size differs from the target's), d2t/t2d of a full-vocabulary EAGLE-3 head, and the ``hidden_norm``
    of a head without aux hidden states (ModelOpt exports none; vLLM and SGLang then normalise with unit weights,
    the RMSNorm's initial value)."""
    keys = set()
    if head.eagle_version == 1 or getattr(head.config, "target_hidden_size", None) in (None, head.config.hidden_size):
        keys.add("embed_tokens.weight")
    if head.eagle_version == 3 and not head.reduced_vocab:
        keys.update({"d2t", "t2d"})
    if head.eagle_version == 3 and not head.reads_aux_hidden_states:
        keys.add("midlayer.hidden_norm.weight")
    return keys


def linear_weight_names(head) -> set[str]:
    """The state-dict names of ``head``'s ``nn.Linear`` weights."""
    return {f"{name}.weight" for name, module in head.named_modules() if isinstance(module, torch.nn.Linear)}


def load_head_weights(head, state_dict: dict[str, torch.Tensor], source: str, kept: Collection[str] = ()) -> bool:
    """Strict load: a missing (non-optional) or unexpected tensor, or a wrong shape, is an error naming it.
    Returns whether the checkpoint carried its own embedding. The tensors are taken out of ``state_dict`` one at a
    time as they are copied into the head, so each is freed once copied (the checkpoint and the head, in its own
    dtype, are never both whole in memory). ``kept``: state-dict names (:func:`linear_weight_names`) whose
    parameters become the checkpoint's tensors themselves, in the checkpoint's dtype (for a head quantized next,
    read from them)."""
    expected = head.state_dict()
    optional = optional_keys(head)
    missing = sorted(k for k in expected if k not in state_dict and k not in optional)
    unexpected = sorted(k for k in state_dict if k not in expected)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {', '.join(unexpected)}")
        names = (" Tensor names as read here: the first decoder layer is `midlayer.*` (`layers.0.*` in vLLM, "
                 "speculators and newer ModelOpt exports)." if any(k.startswith("midlayer.") for k in missing) else "")
        raise ValueError(f"The draft-head weights in {source} do not match the head described by its config.json "
                         f"({'; '.join(parts)}).{names}")
    for key, tensor in state_dict.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"Tensor {key} in {source} has shape {tuple(tensor.shape)}, but the head's config.json implies "
                f"{tuple(expected[key].shape)}."
            )
    has_embedding = "embed_tokens.weight" in state_dict
    for key in list(state_dict):  # completeness was checked above
        head.load_state_dict({key: state_dict.pop(key)}, strict=False, assign=key in kept)
    return has_embedding


# The dtype names the library and its CLIs accept (draft_dtype here; --dtype/--draft-dtype of the evaluation scripts).
DTYPES_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_draft_dtype(draft_dtype, base_dtype: torch.dtype, device: torch.device, eagle_version: int) -> torch.dtype:
    """The dtype the draft head runs in. ``"auto"`` (or None): bfloat16 for an EAGLE-3 head of a float32 model on a
    CPU that computes in bfloat16 natively (AVX512-BF16 or AMX: half the bytes to read per draft pass, and the
    head's proposals are as good, see docs/USAGE.md), otherwise the base model's dtype. A dtype (or its
    name: "float32", "bfloat16", "float16") is taken as given. Verification by the target decides every emitted
    token, so the head's precision changes the speed, never the output."""
    if draft_dtype is None or draft_dtype == "auto":
        if device.type == "cpu" and base_dtype == torch.float32 and eagle_version == 3 and native_bfloat16():
            return torch.bfloat16
        return base_dtype
    if isinstance(draft_dtype, str):
        if draft_dtype not in DTYPES_BY_NAME:
            quantized = (f" ({draft_dtype!r} quantizes a loaded float32 head: EaModel.from_pretrained does it)"
                         if draft_dtype in ("q8_0", "q4_0") else "")
            raise ValueError(f"draft_dtype must be 'auto', 'q8_0', 'q4_0', a torch dtype or one of "
                             f"{sorted(DTYPES_BY_NAME)}, not {draft_dtype!r}{quantized}.")
        draft_dtype = DTYPES_BY_NAME[draft_dtype]
    if not isinstance(draft_dtype, torch.dtype) or not draft_dtype.is_floating_point:
        raise ValueError(f"draft_dtype must be 'auto' or a floating-point torch dtype, not {draft_dtype!r}.")
    if eagle_version == 1 and draft_dtype != base_dtype:
        raise ValueError(f"An EAGLE-1 head shares the base model's LM head, so it runs in the base model's dtype "
                         f"({base_dtype}); draft_dtype={draft_dtype} is not possible.")
    return draft_dtype


def load_ea_layer(ea_model_path: str, base_model, use_eagle3: bool, draft_dtype="auto", keep_linear_dtype=False):
    """Build the draft head for ``base_model`` from a head directory / Hub id, strictly, on the base's device,
    in the dtype :func:`resolve_draft_dtype` gives; with ``keep_linear_dtype`` its linear layers' weights stay in
    the checkpoint's dtype (:func:`load_head_weights`; a head quantized next,
    :func:`eagle.model.heads.quantized.apply_draft_quantization`, which casts what it leaves)."""
    from transformers.initialization import no_init_weights

    raw = load_raw_head_config(ea_model_path)
    if use_eagle3 and not is_eagle3_config(raw):
        raise ValueError("use_eagle3=True but the head's config.json has no `draft_vocab_size`: this looks like an "
                         "EAGLE-1/2 head; pass use_eagle3=False.")
    config, layout = read_head_config(raw, use_eagle3)
    state_dict = read_head_state(config, load_head_state_dict(head_dir_of(ea_model_path)), layout)
    with no_init_weights():  # every weight is the checkpoint's or the target's: no random values to draw
        head = build_head(config, use_eagle3)
    check_head_matches_base(head, base_model)
    kept = linear_weight_names(head) if keep_linear_dtype else set()
    has_embedding = load_head_weights(head, state_dict, f"{ea_model_path} ({layout} layout)", kept)
    embedding = base_model.get_input_embeddings()
    device = embedding.weight.device
    dtype = resolve_draft_dtype(draft_dtype, embedding.weight.dtype, device, head.eagle_version)
    if dtype != embedding.weight.dtype:
        logger.info("The draft head runs in %s, the base model in %s (draft_dtype=%r).", dtype,
                    embedding.weight.dtype, draft_dtype)
    head.to(device=device)
    for module_name, module in head.named_modules():  # floating weights only; d2t/t2d keep their dtypes
        for name, param in list(module.named_parameters(recurse=False)):
            if param.is_floating_point() and f"{module_name}.{name}" not in kept:
                param.data = param.data.to(dtype)
    if not has_embedding:
        head.tie_embedding(embedding)
    if head.eagle_version == 1 or getattr(head, "lm_head", True) is None:
        head.attach_target_lm_head(base_model.get_output_embeddings())
    head.eval()
    return head
