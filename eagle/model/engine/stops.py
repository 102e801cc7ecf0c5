"""Where generation stops and what fills a batch's rows after they end."""

from __future__ import annotations

import torch


def token_id_set(value) -> set[int]:
    """One token id or a collection of them (int, list, tuple, set, tensor) as a set of ints."""
    if isinstance(value, (set, frozenset)):
        value = list(value)
    return {int(i) for i in torch.as_tensor(value).flatten().tolist()}


def stop_token_ids(base_model, tokenizer, is_llama3: bool = False) -> set[int]:
    """EOS of the tokenizer, of the model's ``generation_config`` and config, and ``<|eot_id|>`` where the
    vocabulary has it (``is_llama3=True`` insists on it)."""
    ids: set[int] = set()
    generation_eos = getattr(getattr(base_model, "generation_config", None), "eos_token_id", None)
    config_eos = getattr(base_model.config, "eos_token_id", None)
    for value in (generation_eos, getattr(tokenizer, "eos_token_id", None), config_eos):
        if value is not None:
            ids.update(token_id_set(value))
    if tokenizer is not None:
        eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
        unk = getattr(tokenizer, "unk_token_id", None)
        if isinstance(eot, int) and eot != unk and eot >= 0:
            ids.add(eot)
        elif is_llama3:
            raise ValueError("is_llama3=True but the tokenizer has no <|eot_id|> token.")
    return ids


def pad_token_id(base_model, tokenizer, vocab_size: int, stop_ids) -> int:
    """The id that fills a batch's rows after they end: the tokenizer's pad token, else the generation config's,
    else an end-of-sequence token (as Hugging Face ``generate`` does)."""
    for value in (getattr(tokenizer, "pad_token_id", None),
                  getattr(getattr(base_model, "generation_config", None), "pad_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int) and 0 <= value < vocab_size:
            return value
    return min(stop_ids) if stop_ids else 0
