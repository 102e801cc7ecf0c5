"""Log-probabilities of emitted tokens and of a prompt's tokens, from the target's logits alone.

Which distribution: the target's logits at the position that produced the token, divided by the request's
temperature (when sampling; a greedy request's, temperature 0, are the model's own distribution, as at temperature
1), through a log-softmax over the whole vocabulary. Top-p and top-k truncation is not applied, so no logprob is
``-inf``. The draft never enters: a drafted token that verification accepted gets the target's logprob at its
position, exactly what plain decoding computes there (on the GGUF kernels, bit for bit, since tree verification's
logits equal plain decoding's).

Nothing here runs unless a request asks for logprobs: the generation loop calls :func:`token_logprobs` only for the
rows that want them, over the rows of logits acceptance has already read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle.model.engine.greedy import GREEDY_TEMPERATURE

#: The most alternatives (top logprobs) a token reports.
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of n consecutive tokens: ``token_ids`` (n,), ``chosen`` (n,) float each token's logprob,
    ``top_ids`` (n, k) and ``top_logprobs`` (n, k) float the k likeliest tokens at each position, likeliest first."""

    token_ids: torch.Tensor
    chosen: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor

    def __len__(self) -> int:
        return self.token_ids.shape[0]

    def head(self, n: int) -> "TokenLogprobs":
        """The first ``n`` tokens' entries."""
        return TokenLogprobs(self.token_ids[:n], self.chosen[:n], self.top_ids[:n], self.top_logprobs[:n])


def check_top(top) -> int:
    """``top`` (alternatives per token) checked: an integer in [0, :data:`MAX_TOP_LOGPROBS`]."""
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ValueError(f"logprobs (the alternatives reported per token) must be an integer from 0 to "
                         f"{MAX_TOP_LOGPROBS}, got {top!r}.")
    return top


def logprob_temperature(temperature: float) -> float:
    """The temperature logprobs are computed at: the request's when it samples, 1 (the model's own distribution)
    when it is greedy (temperature <= :data:`~eagle.model.engine.greedy.GREEDY_TEMPERATURE`)."""
    return float(temperature) if temperature > GREEDY_TEMPERATURE else 1.0


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int, temperature: float) -> TokenLogprobs:
    """logits (n, V): the target's logits at the positions that produced ``tokens`` (n,). Each row is normalised on
    its own, so a row's logprobs do not depend on how many rows are computed together."""
    scale = logprob_temperature(temperature)
    rows = [torch.log_softmax(row[None].float() / scale if scale != 1.0 else row[None].float(), dim=-1)[0]
            for row in logits]
    if not rows:
        empty = torch.zeros(0, top, device=logits.device)
        return TokenLogprobs(tokens.new_zeros(0), empty.new_zeros(0), empty.long(), empty)
    logprobs = torch.stack(rows)
    tokens = tokens.to(logprobs.device)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    top_logprobs, top_ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], tokens.new_zeros(len(rows), 0))
    return TokenLogprobs(tokens, chosen, top_ids, top_logprobs)


def prompt_logprobs(target, prompt: torch.Tensor, top: int, temperature: float) -> TokenLogprobs:
    """The logprobs of ``prompt`` (S,)'s tokens 1..S-1, each after the tokens before it: one causal forward pass over
    the prompt in a cache of its own (the target's other caches are left alone), every position's logits kept."""
    cache = target.new_cache(prompt.shape[0])
    logits = target.prefill(prompt[None].to(target.device), cache, features=False, logits_to_keep=0).logits[0]
    return token_logprobs(logits[:-1], prompt[1:], top, temperature)
