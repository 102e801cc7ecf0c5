"""Batched generation for data synthesis: left-padded prefill, then one token per step for the rows still
running. Finished rows leave the batch (their cache rows are dropped), so a long answer does not make the
short ones keep paying for forward passes."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass
class Generated:
    token_ids: list[int]  # the generated tokens, without the stop token
    finished: bool  # True when a stop token ended the text, False when max_new_tokens cut it


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> torch.Tensor:
    """logits (n, V) float32 -> next tokens (n,)."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits / temperature, dim=-1)
    if 0 < top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs > top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def _left_padded(tokenizer, prompts: list[str], stop_ids: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """The rendered prompts tokenized and left-padded (so that every row's next token is at the same column):
    ids and attention mask (B, S)."""
    encoded = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in prompts]
    if any(len(ids) == 0 for ids in encoded):
        raise ValueError("Cannot generate from an empty prompt.")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (stop_ids[0] if stop_ids else 0)
    width = max(len(ids) for ids in encoded)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, ids in enumerate(encoded):
        input_ids[row, width - len(ids):] = torch.tensor(ids)
        attention[row, width - len(ids):] = 1
    return input_ids.to(device), attention.to(device)


def generate_batch(
    model,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    stop_ids: list[int],
    temperature: float = 0.0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
) -> list[Generated]:
    """Continue each rendered prompt (special tokens are expected in the text; none are added).

    Greedy (``temperature <= 0``) gives, row by row, the tokens of ``model.generate(do_sample=False)``."""
    from transformers import DynamicCache

    if not prompts:
        return []
    device = next(model.parameters()).device
    input_ids, attention = _left_padded(tokenizer, prompts, stop_ids, device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    stop = torch.tensor(sorted(set(stop_ids)) or [-1], device=device)

    cache = DynamicCache(config=model.config)
    parameters = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in parameters else "past_key_values"  # renamed in recent transformers
    prefill_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                **{cache_arg: cache}, **prefill_kwargs)
    logits = out.logits[:, -1].float()
    next_position = positions[:, -1] + 1

    results: list[Generated | None] = [None] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    rows = torch.arange(len(prompts), device=device)  # original row of every row still in the batch
    for step in range(max_new_tokens):
        chosen = _pick(logits, temperature, top_p, generator)
        done = torch.isin(chosen, stop)
        for row, token, is_done in zip(rows.tolist(), chosen.tolist(), done.tolist()):
            if is_done:
                results[row] = Generated(tokens[row], True)
            else:
                tokens[row].append(token)
        keep = (~done).nonzero().squeeze(-1)
        if step == max_new_tokens - 1 or keep.numel() == 0:
            break
        if keep.numel() < rows.numel():
            cache.batch_select_indices(keep)
            rows, chosen, attention, next_position = rows[keep], chosen[keep], attention[keep], next_position[keep]
        attention = torch.cat([attention, attention.new_ones((rows.numel(), 1))], dim=1)
        out = model(input_ids=chosen[:, None], attention_mask=attention, position_ids=next_position[:, None],
                    use_cache=True, **{cache_arg: cache})
        logits = out.logits[:, -1].float()
        next_position = next_position + 1
    return [result if result is not None else Generated(tokens[row], False) for row, result in enumerate(results)]
