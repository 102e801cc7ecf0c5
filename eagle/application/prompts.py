"""Chat prompts per model type: a conversation (earlier turns + a new message) -> prompt text and token ids.

Two kinds of template, kept as data in :data:`MODEL_TYPES`:

* FastChat conversation templates (``vicuna``, ``llama-2-chat``, ``mixtral``), for models whose tokenizer carries
  no chat template. The text has no BOS; the tokenizer adds its own.
* The tokenizer's own chat template (``llama-3-instruct``, ``qwen2``, ``qwen3`` and the default, ``None``). The
  template writes every special token itself, so the text is encoded without adding more (the reference added a
  second BOS to Llama-3 prompts).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: One finished exchange: (user message, assistant answer).
Turn = tuple[str, str]

#: Meta's default Llama-2-chat system prompt, which the reference demo uses for llama-2-chat and llama-3-instruct.
LLAMA2_SYSTEM_PROMPT = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being safe."
    "  Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal content."
    " Please ensure that your responses are socially unbiased and positive in nature.\n\n"
    "If a question does not make any sense, or is not factually coherent, explain why instead of answering something"
    " not correct. If you don't know the answer to a question, please don't share false information."
)


@dataclass(frozen=True)
class Prompt:
    """A prompt ready for generation: ``text`` as the model sees it and ``input_ids`` (list of ints, BOS included
    when the model uses one)."""

    text: str
    input_ids: list[int]


@dataclass(frozen=True)
class ModelType:
    """How one model family is prompted. ``build_text(tokenizer, history, message) -> str``;
    ``template_has_special_tokens``: the text already holds BOS etc., so encoding must not add them."""

    name: str
    description: str
    build_text: Callable[[object, Sequence[Turn], str], str]
    template_has_special_tokens: bool
    is_llama3: bool = False


def _fastchat_text(template_name: str, history: Sequence[Turn], message: str, *, system: str | None = None,
                   sep2: str | None = None, space_before_answers: bool = False, trailing: str = "") -> str:
    from fastchat.conversation import get_conv_template  # fschat is installed without its extras: import only this

    conv = get_conv_template(template_name)
    if system is not None:
        conv.set_system_message(system)
    if sep2 is not None:
        conv.sep2 = sep2
    for user, answer in history:
        conv.append_message(conv.roles[0], user)
        conv.append_message(conv.roles[1], (" " + answer) if space_before_answers else answer)
    conv.append_message(conv.roles[0], message)
    conv.append_message(conv.roles[1], None)
    return conv.get_prompt() + trailing


def _vicuna(tokenizer, history, message):
    return _fastchat_text("vicuna_v1.1", history, message)


def _llama2_chat(tokenizer, history, message):
    return _fastchat_text("llama-2", history, message, system=LLAMA2_SYSTEM_PROMPT, space_before_answers=True,
                          trailing=" ")


def _mixtral(tokenizer, history, message):
    return _fastchat_text("llama-2", history, message, system="", sep2="</s>", space_before_answers=True,
                          trailing=" ")


def _chat_messages(history: Sequence[Turn], message: str, system: str | None = None) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": system}] if system else []
    for user, answer in history:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    messages.append({"role": "user", "content": message})
    return messages


def _apply_chat_template(tokenizer, messages: list[dict[str, str]]) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}, {getattr(tokenizer, 'name_or_path', '?')!r}) has no chat "
            f"template; pass a model type that brings its own template: one of {', '.join(FASTCHAT_TYPES)}"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _llama3_instruct(tokenizer, history, message):
    return _apply_chat_template(tokenizer, _chat_messages(history, message, system=LLAMA2_SYSTEM_PROMPT))


def _own_template(tokenizer, history, message):
    return _apply_chat_template(tokenizer, _chat_messages(history, message))


MODEL_TYPES: dict[str | None, ModelType] = {
    t.name: t
    for t in [
        ModelType("vicuna", "FastChat vicuna_v1.1 template (USER: ... ASSISTANT:)", _vicuna, False),
        ModelType("llama-2-chat", "[INST] <<SYS>> ... [/INST] with the Llama-2 system prompt", _llama2_chat, False),
        ModelType("mixtral", "[INST] ... [/INST], no system prompt", _mixtral, False),
        ModelType("llama-3-instruct", "tokenizer chat template with the Llama-2 system prompt", _llama3_instruct,
                  True, is_llama3=True),
        ModelType("qwen2", "tokenizer chat template", _own_template, True),
        ModelType("qwen3", "tokenizer chat template", _own_template, True),
    ]
}
FASTCHAT_TYPES = [name for name, t in MODEL_TYPES.items() if not t.template_has_special_tokens]
#: The default (``model_type=None``): the tokenizer's own chat template, no system prompt added.
DEFAULT_MODEL_TYPE = ModelType("default", "tokenizer chat template", _own_template, True)


def get_model_type(name: str | None) -> ModelType:
    """The :class:`ModelType` called ``name``; ``None`` or ``"default"`` -> the tokenizer's own chat template."""
    if name is None or name == "default":
        return DEFAULT_MODEL_TYPE
    try:
        return MODEL_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown model type {name!r}; expected one of: {', '.join(MODEL_TYPES)} "
                         "(or none, for the tokenizer's own chat template)") from None


def encode_prompt(tokenizer, text: str, template_has_special_tokens: bool) -> list[int]:
    """Token ids of ``text``; exactly one BOS at the start when the tokenizer uses one."""
    ids = tokenizer(text, add_special_tokens=not template_has_special_tokens)["input_ids"]
    bos = getattr(tokenizer, "bos_token_id", None)
    while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return list(ids)


def build_prompt(tokenizer, history: Sequence[Turn], message: str, model_type: str | ModelType | None = None) -> Prompt:
    """The prompt for answering ``message`` after the finished ``history`` turns, in ``model_type``'s format.

    Raises ``ValueError`` for an unknown model type, or for the default type when the tokenizer has no chat
    template.
    """
    kind = model_type if isinstance(model_type, ModelType) else get_model_type(model_type)
    text = kind.build_text(tokenizer, list(history), message)
    return Prompt(text=text, input_ids=encode_prompt(tokenizer, text, kind.template_has_special_tokens))
