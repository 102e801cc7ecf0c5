"""Conversations and chat templates: normalising ShareGPT records, rendering them with the target's own chat
template, and the assistant-only loss mask.

The loss mask is derived from the template itself, whatever it is (no per-family token offsets): the
conversation is rendered prefix by prefix, and for every assistant message the characters between

- the end of ``render(messages[:i], add_generation_prompt=True)`` (the prompt, assistant header included), and
- the end of ``render(messages[:i + 1])`` (the same conversation with the answer)

are the text the model produces for that turn. Inside that span the mask stops after the first special token
(``<|im_end|>``, ``<|eot_id|>``, ``</s>``, ``<end_of_turn>``...): the model emits the answer and its end-of-turn
token, and what the template writes after that (a newline, the next header) is not something it ever predicts.
A template without a special end token has the whole span masked.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

USER, ASSISTANT, SYSTEM = "user", "assistant", "system"
_ROLE_ALIASES = {
    "human": USER,
    "user": USER,
    "gpt": ASSISTANT,
    "assistant": ASSISTANT,
    "chatgpt": ASSISTANT,
    "bard": ASSISTANT,
    "bing": ASSISTANT,
    "model": ASSISTANT,
    "system": SYSTEM,
}

Message = dict  # {"role": "user" | "assistant" | "system", "content": str}


class ChatTemplateError(ValueError):
    """The tokenizer has no chat template, or its template cannot be split into turns."""


def normalize_conversation(record: dict) -> list[Message]:
    """A ShareGPT record (``{"conversations": [{"from": "human", "value": ...}, ...]}``) or a record that is
    already a list of ``{"role", "content"}`` messages (``{"messages": [...]}``) -> chat messages.

    A leading system message is kept; other turns before the first user turn are dropped (as the reference
    does). Raises ``ValueError`` when a turn has an unknown role or the record has no conversation."""
    turns = record.get("conversations")
    if turns is None:
        turns = record.get("messages")
    if not isinstance(turns, list):
        raise ValueError(
            f"A conversation record needs a 'conversations' list of {{'from', 'value'}} turns (ShareGPT) or a "
            f"'messages' list of {{'role', 'content'}} turns; got keys {sorted(record)}."
        )
    messages: list[Message] = []
    for turn in turns:
        if not isinstance(turn, dict):
            raise ValueError(f"A conversation turn must be an object, got {type(turn).__name__}.")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if role is None or content is None:
            raise ValueError(f"A conversation turn needs 'from'/'value' (or 'role'/'content'); got keys {sorted(turn)}.")
        normalized = _ROLE_ALIASES.get(str(role).lower())
        if normalized is None:
            raise ValueError(f"Unknown speaker {role!r} in a conversation; expected one of {sorted(_ROLE_ALIASES)}.")
        messages.append({"role": normalized, "content": str(content)})
    system = [messages[0]] if messages and messages[0]["role"] == SYSTEM else []
    rest = messages[len(system):]
    while rest and rest[0]["role"] != USER:
        rest = rest[1:]
    return system + rest


def require_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"The tokenizer of this base model ({getattr(tokenizer, 'name_or_path', '?')}) has no chat template, but "
            "one is needed to render conversations (and to synthesize prompts). Use an instruction-tuned model, or "
            "set `tokenizer.chat_template` (e.g. save a chat_template.jinja next to the tokenizer files)."
        )


def render(tokenizer, messages: list[Message], add_generation_prompt: bool = False) -> str:
    """The conversation as text, through the tokenizer's chat template."""
    require_chat_template(tokenizer)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: list[Message]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and, for each assistant message, the ``(start, end)`` character span of the
    text the model produces for it (answer and closing text up to the next turn; see the module docstring).

    Raises :class:`ChatTemplateError` when the template does not render conversations prefix-consistently
    (e.g. it rewrites earlier turns), so that a wrong mask is never produced silently."""
    full = render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        prompt = render(tokenizer, messages[:i], add_generation_prompt=True) if i else ""
        through = render(tokenizer, messages[: i + 1])
        if not full.startswith(through) or not through.startswith(prompt):
            raise ChatTemplateError(
                "The chat template does not render conversations prefix by prefix (the rendering of the first "
                f"{i + 1} messages is not a prefix of the whole conversation), so the assistant tokens cannot be "
                "located. Templates that rewrite earlier turns are not supported for training data."
            )
        start = len(prompt)
        if i and prompt == render(tokenizer, messages[:i]):
            # The template ignores add_generation_prompt: skip the assistant header by finding the answer text.
            found = through.find(message["content"].strip()[:64], start) if message["content"].strip() else -1
            if found >= 0:
                start = found
        spans.append((start, len(through)))
    return full, spans


def _special_ids(tokenizer) -> set[int]:
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            ids.add(int(token_id))
    return ids


@dataclass
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]  # 1 = a token the model produced (assistant answer and its end-of-turn token)


def tokenize_conversation(tokenizer, messages: list[Message]) -> TokenizedConversation:
    """Render with the chat template, tokenize (the template already writes BOS and other special tokens, so no
    special tokens are added) and build the assistant-only loss mask."""
    text, spans = assistant_char_spans(tokenizer, messages)
    specials = _special_ids(tokenizer)
    if getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        starts = [start for start, _ in encoded["offset_mapping"]]
    else:
        ids, starts = _tokenize_with_starts_slow(tokenizer, text, spans)
    mask = [0] * len(ids)
    for span_start, span_end in spans:
        for index, (token_id, start) in enumerate(zip(ids, starts)):
            if span_start <= start < span_end:
                mask[index] = 1
                if token_id in specials:
                    break  # the end-of-turn token: predicted, but nothing after it is
    return TokenizedConversation(ids, mask)


def _tokenize_with_starts_slow(tokenizer, text: str, spans: list[tuple[int, int]]):
    """Fallback for tokenizers without offsets: tokenize the pieces between span boundaries separately, so every
    boundary is a token boundary, and give each token the start of its piece (good enough to decide
    membership)."""
    cuts = sorted({0, len(text), *[b for span in spans for b in span]})
    ids, starts = [], []
    for left, right in zip(cuts, cuts[1:]):
        piece = tokenizer(text[left:right], add_special_tokens=False)["input_ids"]
        ids.extend(piece)
        starts.extend([left] * len(piece))
    return ids, starts


def user_turn_prefix(tokenizer, history: list[Message]) -> str:
    """The rendered text of ``history`` followed by the opening of a new user message, i.e. everything the
    template writes before the content of the next user turn. Used to let the model write user prompts."""
    sentinel = "\u2063SENTINEL\u2063"
    text = render(tokenizer, history + [{"role": USER, "content": sentinel}])
    position = text.find(sentinel)
    if position < 0:
        raise ChatTemplateError("The chat template does not echo the user's message; cannot synthesize prompts.")
    return text[:position]


def _first_special_after(tokenizer, messages: list[dict], sentinel: str) -> int | None:
    """The first special token the template writes after ``sentinel`` (the last message's text), or None."""
    text = render(tokenizer, messages)
    tail = text[text.rfind(sentinel) + len(sentinel):]
    specials = _special_ids(tokenizer)
    for token_id in tokenizer(tail, add_special_tokens=False)["input_ids"]:
        if token_id in specials:
            return int(token_id)
    return None


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn under this template: the first special token the template writes
    after an answer (e.g. ``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``), plus the tokenizer's EOS."""
    ids = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    try:
        sentinel = "SENTINELANSWER"
        end = _first_special_after(tokenizer, [{"role": USER, "content": "hi"}, {"role": ASSISTANT, "content": sentinel}],
                                   sentinel)
        if end is not None:
            ids.append(end)
    except ChatTemplateError:
        pass
    return list(dict.fromkeys(ids))


def user_end_ids(tokenizer) -> list[int]:
    """Token ids that end a user turn under this template (the first special token after the user's text)."""
    ids = []
    sentinel = "SENTINELQUESTION"
    end = _first_special_after(tokenizer, [{"role": USER, "content": sentinel}], sentinel)
    if end is not None:
        ids.append(end)
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    return list(dict.fromkeys(ids))
