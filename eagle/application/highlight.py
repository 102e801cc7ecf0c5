"""Which parts of an answer came from accepted EAGLE drafts, as text segments and as chat-ready HTML/Markdown.

Every step of ``EaModel.ea_generate`` adds ``accept_length + 1`` tokens: the accepted draft tokens followed by one
token the target chose. :func:`draft_flags` turns the step sizes into one flag per token; :func:`draft_segments`
turns tokens and flags into text segments (decoding whole prefixes, so multi-token characters and the tokenizer's
space handling come out exactly as in the plain decoded text); :func:`render_highlighted` marks the draft
segments for the chatbot.
"""

from __future__ import annotations

import html
import re
from collections.abc import Sequence

#: Inline style of a highlighted (accepted draft) span; a style attribute survives Gradio's HTML sanitiser.
DRAFT_STYLE = "background-color: #ffd8a8; color: inherit; border-radius: 3px; padding: 0 1px"

_BLOCK_MARKER = re.compile(r"^[ \t]*(?:(?:[-*+]|\d+[.)]|#{1,6}|>)[ \t]+)*")
_INLINE_CODE = re.compile(r"`+[^`]*`+")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
# Markdown emphasis/link delimiters stay outside marks, so a mark never straddles one (which would break both).
_NEVER_MARKED = set("\r\n*_~[]\\")
_LINK_TARGET = re.compile(r"\]\([^)]*\)|(?:https?|ftp)://\S+|www\.\S+")  # a mark inside would break the link


def draft_flags(step_sizes: Sequence[int], first_step_is_prefill: bool = True) -> list[bool]:
    """One flag per generated token: True where the token is an accepted draft token.

    ``step_sizes`` are the numbers of tokens each yield added. In every EAGLE step all tokens but the last are
    accepted drafts; the prefill's single token (the first step) is the target's own.
    """
    flags: list[bool] = []
    for i, size in enumerate(step_sizes):
        if size <= 0:
            continue
        if i == 0 and first_step_is_prefill:
            flags += [False] * size
        else:
            flags += [True] * (size - 1) + [False]
    return flags


def draft_segments(tokenizer, token_ids: Sequence[int], from_draft: Sequence[bool],
                   prefix_cache: dict[int, str] | None = None) -> list[tuple[str, bool]]:
    """Split the decoded text of ``token_ids`` into ``(text, is_draft)`` runs.

    The texts join to exactly ``tokenizer.decode(token_ids, skip_special_tokens=True)``. Boundaries are placed by
    decoding each prefix that ends at a change of flag; ``prefix_cache`` (boundary -> decoded prefix) may be passed
    between calls on a growing answer to avoid decoding the same prefixes again.
    """
    if len(token_ids) != len(from_draft):
        raise ValueError(f"need one draft flag per token: got {len(from_draft)} flags for {len(token_ids)} tokens")
    token_ids = list(token_ids)
    full = tokenizer.decode(token_ids, skip_special_tokens=True)
    cache = {} if prefix_cache is None else prefix_cache
    cuts = [0]
    for end in range(1, len(token_ids)):
        if from_draft[end] != from_draft[end - 1]:
            if end not in cache:
                cache[end] = tokenizer.decode(token_ids[:end], skip_special_tokens=True)
            prefix = cache[end]
            # A prefix ending inside a multi-byte character decodes with a replacement character: cut before it.
            cut = len(prefix) if full.startswith(prefix) else _common_prefix_length(prefix, full)
            cuts.append(max(cut, cuts[-1]))
    cuts.append(len(full))
    starts = [0] + [i for i in range(1, len(token_ids)) if from_draft[i] != from_draft[i - 1]]
    segments: list[tuple[str, bool]] = []
    for (begin, end), start_token in zip(zip(cuts, cuts[1:]), starts):
        text = full[begin:end]
        if not text:
            continue
        flag = bool(from_draft[start_token])
        if segments and segments[-1][1] == flag:
            segments[-1] = (segments[-1][0] + text, flag)
        else:
            segments.append((text, flag))
    return segments


def _common_prefix_length(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def render_highlighted(segments: Sequence[tuple[str, bool]]) -> str:
    """Chat Markdown in which draft text is wrapped in ``<mark class="eagle-draft">``.

    Everything outside code is HTML-escaped (so a model writing ``<b>`` shows the characters). Marks never span a
    line break and never cover Markdown block markers (list bullets, ``#``, ``>``), emphasis or link delimiters
    (``*_~[]``), link targets, URLs or surrounding whitespace; code blocks and inline code stay unmarked (a tag
    there would show as text).
    """
    text = "".join(t for t, _ in segments)
    flags = [flag for t, flag in segments for _ in t]
    out: list[str] = []
    in_fence = False
    position = 0
    for line in text.splitlines(keepends=True):
        line_flags = flags[position:position + len(line)]
        position += len(line)
        if _FENCE.match(line):
            in_fence = not in_fence
            out.append(line)
        elif in_fence:
            out.append(line)
        else:
            out.append(_render_line(line, line_flags))
    return "".join(out)


def _render_line(line: str, flags: list[bool]) -> str:
    marker = _BLOCK_MARKER.match(line).end()
    flags = [False] * marker + flags[marker:]
    raw = [False] * len(line)  # inside inline code: emit as is, never mark
    for match in _INLINE_CODE.finditer(line):
        for i in range(match.start(), match.end()):
            raw[i] = True
            flags[i] = False
    for match in _LINK_TARGET.finditer(line):
        flags[match.start():match.end()] = [False] * (match.end() - match.start())
    for i, ch in enumerate(line):
        if ch in _NEVER_MARKED:
            flags[i] = False
    pieces: list[str] = []
    i = 0
    while i < len(line):
        j = i
        while j < len(line) and flags[j] == flags[i] and raw[j] == raw[i]:
            j += 1
        chunk = line[i:j]
        if raw[i]:
            pieces.append(chunk)
        elif flags[i] and chunk.strip():
            body = chunk.strip()
            lead, trail = chunk[:len(chunk) - len(chunk.lstrip())], chunk[len(chunk.rstrip()):]
            pieces.append(f'{html.escape(lead, quote=False)}<mark class="eagle-draft" style="{DRAFT_STYLE}">'
                          f"{html.escape(body, quote=False)}</mark>{html.escape(trail, quote=False)}")
        else:
            pieces.append(html.escape(chunk, quote=False))
        i = j
    return "".join(pieces)
