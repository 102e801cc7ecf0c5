"""Log-probabilities in the OpenAI API's two formats, from the engine's
:class:`~eagle.model.engine.logprobs.TokenLogprobs` (the target's, after the request's temperature: see that module).

- chat (``/v1/chat/completions``, ``logprobs: true``, ``top_logprobs: k``): ``{"content": [{"token", "logprob",
  "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}``;
- legacy (``/v1/completions``, ``logprobs: k``): ``{"tokens": [...], "token_logprobs": [...], "top_logprobs":
  [{token: logprob, ...}, ...], "text_offset": [...]}``, each ``top_logprobs`` entry the k likeliest tokens and the
  chosen one (k + 1 entries when it is not among them, as OpenAI writes it); with ``echo`` the prompt's tokens come
  first, the first of them with ``null`` logprobs (nothing precedes it).

A token's text is the tokenizer's decoding of that token alone (special tokens included); ``bytes`` its UTF-8
bytes; ``text_offset`` where each token starts in the choice's text (echo: the prompt's text first), counted from
the tokens' texts.
"""

from __future__ import annotations

import torch

from eagle.model.engine.logprobs import TokenLogprobs


class LogprobWriter:
    """Writes one answer's logprobs, part by part (a streamed answer's chunks, or the whole): ``chat`` picks the
    format; the text offsets run on across parts."""

    def __init__(self, tokenizer, chat: bool):
        self.tokenizer, self.chat = tokenizer, chat
        self.offset = 0
        self._texts: dict[int, str] = {}

    def token_text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def part(self, logprobs: TokenLogprobs, unscored_first: bool = False) -> dict:
        """One part's logprobs in the answer's format. ``unscored_first``: the first token has no logprob (a
        prompt's first token, legacy format only)."""
        return self._chat(logprobs) if self.chat else self._legacy(logprobs, unscored_first)

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def _chat(self, logprobs: TokenLogprobs) -> dict:
        content = []
        for token, chosen, ids, values in _rows(logprobs):
            entry = self._entry(token, chosen)
            entry["top_logprobs"] = [self._entry(i, v) for i, v in zip(ids, values)]
            content.append(entry)
        return {"content": content}

    def _legacy(self, logprobs: TokenLogprobs, unscored_first: bool) -> dict:
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for index, (token, chosen, ids, values) in enumerate(_rows(logprobs)):
            text = self.token_text(token)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(text)
            if index == 0 and unscored_first:
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(chosen)
            top = {self.token_text(i): v for i, v in zip(ids, values)}
            top.setdefault(text, chosen)  # the chosen token is always there, as OpenAI's legacy format has it
            top_logprobs.append(top)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def _rows(logprobs: TokenLogprobs):
    """(token id, logprob, top ids, top logprobs) per token, as Python values."""
    return zip(logprobs.token_ids.tolist(), logprobs.chosen.tolist(), logprobs.top_ids.tolist(),
               logprobs.top_logprobs.tolist())


def with_first_token(first_token: int, logprobs: TokenLogprobs) -> TokenLogprobs:
    """A prompt's logprobs (its tokens 1..S-1) with its first token in front, unscored (a 0 placeholder that
    :meth:`LogprobWriter.part` writes as ``null`` with ``unscored_first``)."""
    ids = logprobs.token_ids
    first = torch.tensor([first_token], dtype=ids.dtype, device=ids.device)
    return TokenLogprobs(torch.cat([first, ids]), torch.cat([logprobs.chosen.new_zeros(1), logprobs.chosen]),
                         torch.cat([logprobs.top_ids.new_zeros(1, logprobs.top_ids.shape[1]), logprobs.top_ids]),
                         torch.cat([logprobs.top_logprobs.new_zeros(1, logprobs.top_logprobs.shape[1]),
                                    logprobs.top_logprobs]))
