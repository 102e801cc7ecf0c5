"""What the engine knows about a target model's attention: the layer types its tree masks express, and the
features it knows it cannot reproduce exactly.

Tree verification runs every drafted token through the target at once, under a 4-D mask that gives each node its
ancestors and the committed tokens (:meth:`~eagle.model.base.target.Target.attention_mask`), at its own position.
That reproduces plain decoding only for attention the mask can express. A model whose layers keep another kind of
state (a recurrent or convolution state that every drafted token would update, accepted or not) or select keys by
a learned index cannot be served losslessly this way; rather than diverge silently, :func:`check_attention_known`
refuses it, unless the caller asks otherwise (``allow_unknown_attention=True``, with a warning).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

#: Layer types the tree mask expresses (transformers' ``config.layer_types`` names), with what a node sees.
MASKED_LAYER_TYPES = {
    "full_attention": "the committed tokens and its tree ancestors",
    "sliding_attention": "those within `sliding_window` positions back",
    "chunked_attention": "those in the same `attention_chunk_size` chunk of positions (Llama 4)",
}

#: Layer types known not to be expressible, with the reason.
UNSERVABLE_LAYER_TYPES = {
    "linear_attention": "a recurrent state (Mamba, gated delta net, lightning attention) that every drafted token "
                        "updates, accepted or not",
    "conv": "a convolution state over the previous tokens that every drafted token updates",
    "hybrid": "attention combined with a recurrent state that every drafted token updates",
    "hybrid_sliding": "sliding attention combined with a recurrent state that every drafted token updates",
    "indexed_attention": "keys selected by a learned indexer over the whole cache",
    "compressed_sparse_attention": "keys compressed and selected over the whole cache",
    "heavily_compressed_attention": "keys compressed over the whole cache",
    "minimax_m3_sparse": "keys selected by a lightning index over the whole cache",
    "window_attention": "non-overlapping windows of slots",
    "reference_sliding_attention": "a ring buffer of generated tokens",
}

#: Config fields whose (truthy) value means attention the engine cannot reproduce, with the reason.
UNSERVABLE_FEATURES = {
    "sparse_config": "sparse attention over key blocks chosen per query (MiniCPM4's InfLLM v2)",
    "alibi": "ALiBi position biases built from the 2-D padding mask, not from tree positions",
    "use_alibi": "ALiBi position biases built from the 2-D padding mask, not from tree positions",
}

#: Model types whose attention is ALiBi-biased whatever their config says.
ALIBI_MODEL_TYPES = ("bloom", "mpt")


def attention_problems(config) -> list[str]:
    """What in ``config`` (a text config) the tree mask cannot express, one sentence each; empty when none."""
    problems = []
    for kind in dict.fromkeys(getattr(config, "layer_types", None) or []):
        if kind not in MASKED_LAYER_TYPES:
            reason = UNSERVABLE_LAYER_TYPES.get(kind, "a layer type this engine does not know")
            problems.append(f"layers of type {kind!r} ({reason})")
    for field, reason in UNSERVABLE_FEATURES.items():
        if getattr(config, field, None):
            problems.append(f"{field}={getattr(config, field)!r} ({reason})")
    if getattr(config, "model_type", None) in ALIBI_MODEL_TYPES:
        problems.append(f"model type {config.model_type!r} (ALiBi position biases built from the 2-D padding mask)")
    return problems


def check_attention_known(model, allow_unknown: bool = False) -> None:
    """Refuse a model whose attention the tree mask cannot express (``ValueError`` naming what and why); with
    ``allow_unknown``, log a warning instead."""
    config = model.config.get_text_config()
    problems = attention_problems(config)
    if not problems:
        return
    message = (f"{type(model).__name__} has {'; '.join(problems)}: EAGLE's tree verification cannot reproduce its "
               f"plain decoding exactly. The engine's tree masks express {', '.join(MASKED_LAYER_TYPES)} layers.")
    if not allow_unknown:
        raise ValueError(message + " Pass allow_unknown_attention=True to run it anyway (its output may then differ "
                                   "from plain decoding).")
    logger.warning("%s Running it anyway (allow_unknown_attention=True): the output may differ from plain "
                   "decoding.", message)
