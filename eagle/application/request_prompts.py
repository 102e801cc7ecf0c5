"""Prompt token ids from validated request bodies: chat messages through a prompt format, a completion prompt as
text or as token ids.

:class:`PromptEncoder` refuses a prompt text whose length in characters already rules it out before tokenizing
it (:mod:`eagle.application.prompt_bound`), and token ids the model does not have. Its methods are CPU work (a
chat template, a tokenizer on up to ``--max-body-bytes`` of text): the server runs them off the event loop.
"""

from __future__ import annotations

from .. import templates
from . import openai_schema as schema
from .openai_schema import APIError
from .prompt_bound import character_bound
from .prompts import encode_prompt, get_model_type


class PromptEncoder:
    """Token ids of request prompts for ``model`` (an ``EaModel``: its ``tokenizer`` and ``vocab_size``) with
    contexts of ``max_length`` tokens, prompt and answer together. ``model_type``: the chat prompt format (None =
    the tokenizer's chat template)."""

    def __init__(self, model, model_type: str | None, max_length: int):
        self.tokenizer, self.model_type, self.max_length = model.tokenizer, model_type, max_length
        self.vocab_size = getattr(model, "vocab_size", None) or len(self.tokenizer)
        #: the fewest tokens a text can become (None: the tokenizer gives no such bound)
        self.bound = character_bound(self.tokenizer)

    def chat(self, messages: list[schema.ChatMessage]) -> list[int]:
        """The chat prompt's ids (see :func:`chat_prompt_text`); 400 for a prompt that cannot fit."""
        text, has_special_tokens = chat_prompt_text(self.tokenizer, messages, self.model_type)
        self.check_length(text, "messages")
        return encode_prompt(self.tokenizer, text, has_special_tokens)

    def completion(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's ids: the text tokenized with the tokenizer's special tokens (BOS), or the token
        ids as given (400 for an id the model does not have)."""
        if isinstance(prompt, list):
            bad = next((i for i, token in enumerate(prompt) if token >= self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"Invalid value for 'prompt': token id {prompt[bad]} (at {bad}) is out of range; "
                               f"this model's token ids run from 0 to {self.vocab_size - 1}.", param="prompt",
                               code="invalid_value")
            return list(prompt)
        self.check_length(prompt, "prompt")
        return encode_prompt(self.tokenizer, prompt, False)

    def check_length(self, text: str, param: str) -> None:
        """400 ``context_length_exceeded`` when ``text`` has too many characters to fit in the context whatever
        its tokens (:class:`~eagle.application.prompt_bound.CharacterBound`)."""
        if self.bound is None:
            return
        fewest = self.bound.min_tokens(text)
        if fewest >= self.max_length:
            raise APIError(400, f"The prompt is {len(text)} characters long: at least {fewest} tokens for this "
                           f"model's tokenizer (no token stands for more than {self.bound.per_token} characters), "
                           f"and this server's context holds {self.max_length} tokens, prompt and answer together. "
                           "Send a shorter prompt.", param=param, code="context_length_exceeded")


def chat_prompt_text(tokenizer, messages: list[schema.ChatMessage], model_type: str | None) -> tuple[str, bool]:
    """The chat prompt as text and whether that text holds the special tokens (BOS) already: the tokenizer's chat
    template (``model_type`` None), or one of :data:`eagle.application.prompts.MODEL_TYPES`, which take
    user/assistant turns ending with a user message."""
    kind = get_model_type(model_type)
    conversation = [{"role": m.role, "content": m.text()} for m in messages]
    if model_type is None:
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(500, "The model's tokenizer has no chat template; start the server with --model-type.",
                           type="server_error")
        try:
            text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # noqa: BLE001 - a template's own refusal (say, roles out of order) is the user's
            raise APIError(400, f"The chat template refused these messages: {err}", param="messages") from None
        return text, True
    roles = [m["role"] for m in conversation]
    if roles[-1] != "user" or any(r != ("user" if i % 2 == 0 else "assistant") for i, r in enumerate(roles)):
        raise APIError(400, f"The prompt format '{model_type}' takes user and assistant messages in turn, starting "
                       "and ending with a user message (no system message).", param="messages")
    texts = [m["content"] for m in conversation] + [None]
    return templates.prompt_text(kind, tokenizer, list(zip(texts[0::2], texts[1::2]))), kind.template_has_special_tokens


def chat_prompt_ids(tokenizer, messages: list[schema.ChatMessage], model_type: str | None) -> list[int]:
    """Token ids of the chat prompt (:func:`chat_prompt_text`, then tokenized)."""
    text, has_special_tokens = chat_prompt_text(tokenizer, messages, model_type)
    return encode_prompt(tokenizer, text, has_special_tokens)
