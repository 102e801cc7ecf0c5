"""A generation request: the prompts of one call, checked once, with its settings, frozen.

The engine builds one (:func:`build_request`) before anything runs, so bad input fails with a ``ValueError`` that
says what was expected and leaves the model as it was; the generation loop then reads each row's prompt from it
(it pads the rows it prefills together itself) and the caller's output layout comes from it.

Prompts come as ids (S,) or (B, S), with an optional ``attention_mask`` of the same shape (1 = token, 0 =
padding, left padding only, as a tokenizer with ``padding_side="left"`` returns it), or as a list of 1-D id
sequences of different lengths, which are left-padded here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eagle.model.engine.acceptance import Sampler
from eagle.model.engine.greedy import GREEDY_TEMPERATURE


@dataclass(frozen=True)
class GenerationRequest:
    """input_ids: (B, S) the prompts as the caller gave them, left-padded (padding slots hold ``pad_token_id`` when
    this module padded them), kept for the output's layout; prompts: each row's real tokens (n_b,) on the model's
    device, what the engine reads; budgets: the most new tokens of each row (``max_new_tokens``, and no row longer
    than ``max_length``); drafter: what proposes the drafts (``"head"``: the model's own head, ``"none"``: plain
    decoding, or a spec of :func:`~eagle.model.drafting.registry.build_drafter`)."""

    input_ids: torch.Tensor
    prompts: tuple[torch.Tensor, ...]
    budgets: tuple[int, ...]
    temperature: float
    top_p: float
    top_k: int
    drafter: str
    stop_token_ids: frozenset[int]
    pad_token_id: int
    generator: torch.Generator | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def lengths(self) -> list[int]:
        """Real prompt tokens of each row."""
        return [prompt.shape[0] for prompt in self.prompts]

    def sampler(self) -> Sampler | None:
        """The sampler of this request, or None for greedy decoding (temperature <= :data:`GREEDY_TEMPERATURE`)."""
        return make_sampler(self.temperature, self.top_p, self.top_k, self.generator)

    def output_ids(self, new_tokens: list[list[int]]) -> torch.Tensor:
        """(B, S + T): each row's prompt then its new tokens, rows with fewer than T filled with ``pad_token_id``
        on the right (as Hugging Face ``generate`` returns a batch)."""
        width = max((len(tokens) for tokens in new_tokens), default=0)
        new = torch.full((self.batch_size, width), self.pad_token_id, dtype=torch.long)
        for row, tokens in enumerate(new_tokens):
            new[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        return torch.cat([self.input_ids, new.to(self.input_ids.device)], dim=1)


def make_sampler(temperature: float, top_p: float, top_k: int, generator=None) -> Sampler | None:
    """The sampler of these settings, or None for greedy decoding (temperature <= :data:`GREEDY_TEMPERATURE`)."""
    return Sampler(temperature, top_p, top_k, generator) if temperature > GREEDY_TEMPERATURE else None


def build_request(input_ids, attention_mask=None, *, vocab_size: int, device, temperature=0.0, top_p=0.0, top_k=0,
                  max_new_tokens=512, max_length: int | None = 2048, drafter: str = "head", stop_token_ids=frozenset(),
                  pad_token_id: int = 0, generator=None) -> GenerationRequest:
    """Check and pad a call's prompts and settings (see the module docstring). ``max_length=None``: the longest
    prompt plus ``max_new_tokens`` plus one."""
    _check_settings(temperature, top_p, top_k, max_new_tokens)
    ids, mask = _as_padded_batch(input_ids, attention_mask, pad_token_id)
    lengths = mask.sum(1).tolist()
    real = ids[mask]
    low, high = int(real.min()), int(real.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"input_ids contains token id {low if low < 0 else high}, outside the vocabulary [0, {vocab_size}).")
    if max_length is None:
        max_length = max(lengths) + max_new_tokens + 1
    too_long = [row for row, n in enumerate(lengths) if n >= max_length]
    if too_long:
        row = too_long[0]
        raise ValueError(
            f"The prompt{f' of row {row}' if len(lengths) > 1 else ''} has {lengths[row]} tokens, which does not fit "
            f"max_length={max_length} (prompt plus new tokens); shorten the prompt or raise max_length."
        )
    on_device = ids.to(device)
    return GenerationRequest(
        input_ids=on_device, prompts=tuple(row[row.shape[0] - n:] for row, n in zip(on_device, lengths)),
        budgets=tuple(min(max_new_tokens, max_length - n) for n in lengths),
        temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), drafter=drafter,
        stop_token_ids=frozenset(stop_token_ids), pad_token_id=int(pad_token_id), generator=generator,
    )


def _check_settings(temperature, top_p, top_k, max_new_tokens) -> None:
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}.")
    if not 0.0 <= top_p <= 1.0:
        raise ValueError(f"top_p must be in [0, 1] (0 or 1 = off), got {top_p}.")
    if top_k < 0 or int(top_k) != top_k:
        raise ValueError(f"top_k must be a non-negative integer (0 = off), got {top_k}.")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}.")


def _as_ids(value, what: str) -> torch.Tensor:
    """A tensor or (nested) list of token ids as a long tensor, refusing other dtypes."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{what} must hold integer token ids, got dtype {value.dtype}.")
        return value.long()
    if isinstance(value, (list, tuple)):
        try:
            tensor = torch.tensor(value)
        except (TypeError, ValueError) as error:
            raise TypeError(f"{what} must be integer token ids: {error}") from None
        if tensor.numel() and (tensor.is_floating_point() or tensor.dtype == torch.bool):
            raise TypeError(f"{what} must hold integer token ids, got {tensor.dtype}.")
        return tensor.long()
    raise TypeError(f"{what} must be a torch.LongTensor of shape (batch, seq_len) or a list of 1-D id sequences, got "
                    f"{type(value).__name__}.")


def _as_padded_batch(input_ids, attention_mask, pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, S), mask (B, S) bool), left-padded, checked."""
    if isinstance(input_ids, (list, tuple)) and input_ids and not isinstance(input_ids[0], int):
        if attention_mask is not None:
            raise ValueError("Pass attention_mask with an input_ids tensor; a list of prompts is padded here.")
        rows = [_as_ids(row, f"input_ids[{i}]").flatten() for i, row in enumerate(input_ids)]
        empty = [i for i, row in enumerate(rows) if row.numel() == 0]
        if empty:
            raise ValueError(f"Prompt {empty[0]} is empty: every prompt must contain at least one token.")
        width = max(row.numel() for row in rows)
        ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, width - row.numel():] = row.cpu()
            mask[i, width - row.numel():] = True
        return ids, mask
    ids = _as_ids(input_ids, "input_ids")
    ids = ids[None] if ids.dim() == 1 else ids
    if ids.dim() != 2 or ids.shape[0] == 0:
        raise ValueError(f"input_ids must have shape (batch, seq_len), got {tuple(ids.shape)}.")
    if ids.shape[1] == 0:
        raise ValueError("The prompt is empty: input_ids must contain at least one token.")
    if attention_mask is None:
        return ids, torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
    return ids, _check_mask(torch.as_tensor(attention_mask, device=ids.device), ids.shape)


def _check_mask(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    mask = mask[None] if mask.dim() == 1 else mask
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but input_ids has shape {tuple(shape)}; they "
                         "must match.")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("attention_mask must hold 0 (padding) and 1 (token) only.")
    mask = mask.bool()
    empty = (~mask.any(1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"Row {empty[0]} of attention_mask is all zeros: every row needs at least one token.")
    if bool((mask[:, :-1] & ~mask[:, 1:]).any()):
        raise ValueError("attention_mask has padding after a token (right padding or a hole); EaModel needs left "
                         "padding: a tokenizer with padding_side='left', or a list of prompts to pad here.")
    return mask
