"""Hugging Face ``generate`` arguments ``EaModel.generate`` cannot honour: refused, never silently ignored."""

from __future__ import annotations

# Arguments that change nothing here: dropped silently.
HARMLESS_GENERATE_ARGS = {"token_type_ids", "bos_token_id", "use_cache"}
# Arguments honoured only at their neutral value (a different one would be silently ignored otherwise).
NEUTRAL_GENERATE_ARGS = {"num_beams": 1, "num_return_sequences": 1, "repetition_penalty": 1.0, "min_new_tokens": 0,
                         "return_dict_in_generate": False, "output_scores": False, "output_logits": False,
                         "output_attentions": False, "output_hidden_states": False}


def check_generate_extras(extras: dict) -> None:
    """Refuse ``generate`` arguments that would be silently ignored, saying what is supported instead."""
    refused = sorted(
        name for name, value in extras.items()
        if name not in HARMLESS_GENERATE_ARGS and value is not None
        and not (name in NEUTRAL_GENERATE_ARGS and value == NEUTRAL_GENERATE_ARGS[name])
    )
    if refused:
        raise ValueError(
            f"EaModel.generate() cannot honour {', '.join(refused)}. It supports input_ids, attention_mask (left "
            "padding), max_new_tokens, max_length, do_sample, temperature, top_p, top_k, eos_token_id, pad_token_id, "
            "drafter and use_eagle; "
            "for streaming use ea_generate(), for anything else the base model's own generate() (model.base_model)."
        )
