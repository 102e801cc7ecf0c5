"""Chat prompts of the web UI: a conversation (earlier turns + a new message) -> prompt text and token ids.

The formats are :data:`eagle.templates.MODEL_TYPES` (``--model-type``: the reference demo's ``vicuna``,
``llama-2-chat``, ``mixtral``, ``llama-3-instruct``, ``qwen2``, ``qwen3``) and, by default, the tokenizer's own chat
template; this module names them for the UI. Text formats are encoded with the tokenizer's BOS; a chat template
writes every special token itself, so its text is encoded without adding more (the reference added a second BOS
to Llama-3 prompts).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from eagle.templates import DEFAULT_MODEL_TYPE, LLAMA_SYSTEM_PROMPT, MODEL_TYPES, PromptTemplate, prompt_text
from eagle.templates import encode_text as encode_prompt  # noqa: F401  (the name this module always had)

#: One finished exchange: (user message, assistant answer).
Turn = tuple[str, str]
#: A prompt format of the web UI (a record of the one template system).
ModelType = PromptTemplate
#: Meta's default Llama-2-chat system prompt, which the reference demo uses for llama-2-chat and llama-3-instruct.
LLAMA2_SYSTEM_PROMPT = LLAMA_SYSTEM_PROMPT
FASTCHAT_TYPES = [name for name, t in MODEL_TYPES.items() if not t.template_has_special_tokens]


@dataclass(frozen=True)
class Prompt:
    """A prompt ready for generation: ``text`` as the model sees it and ``input_ids`` (list of ints, BOS included
    when the model uses one)."""

    text: str
    input_ids: list[int]


def get_model_type(name: str | None) -> ModelType:
    """The format called ``name``; ``None`` or ``"default"`` -> the tokenizer's own chat template."""
    if name is None or name == "default":
        return DEFAULT_MODEL_TYPE
    try:
        return MODEL_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown model type {name!r}; expected one of: {', '.join(MODEL_TYPES)} "
                         "(or none, for the tokenizer's own chat template)") from None


def build_prompt(tokenizer, history: Sequence[Turn], message: str, model_type: str | ModelType | None = None) -> Prompt:
    """The prompt for answering ``message`` after the finished ``history`` turns, in ``model_type``'s format.

    Raises ``ValueError`` for an unknown model type, or for the default type when the tokenizer has no chat
    template.
    """
    kind = model_type if isinstance(model_type, PromptTemplate) else get_model_type(model_type)
    text = prompt_text(kind, tokenizer, [*history, (message, None)])
    return Prompt(text=text, input_ids=encode_prompt(tokenizer, text, kind.template_has_special_tokens))
