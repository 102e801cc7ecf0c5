"""Prompt templates as data: how a conversation becomes the prompt of one model family. The one template system of
the project: the answer scripts and the benchmark pick a record of :data:`TEMPLATES` (``--template``), the web UI
one of :data:`MODEL_TYPES` (``--model-type``, the reference demo's names and formats).

What differs between ``gen_ea_answer_vicuna`` and ``gen_ea_answer_llama3chat`` is only one of the
``PromptTemplate`` records below. The ``auto`` template uses the tokenizer's own chat template, so any chat model
works (the embedded default among them).

Styles:

- ``colon``: ``SYSTEM USER: q ASSISTANT: a</s>USER: q2 ASSISTANT:`` (Vicuna v1.1);
- ``llama2``: ``[INST] <<SYS>>\\nSYSTEM\\n<</SYS>>\\n\\nq [/INST] a </s><s>[INST] q2 [/INST]`` (Llama-2-chat);
- ``chatml``: ``<|im_start|>role\\ntext<|im_end|>\\n`` blocks (Qwen);
- ``turns``: ``<start_of_turn>role\\ntext<end_of_turn>\\n`` blocks (Gemma; a GGUF without a chat template);
- ``chat_template``: ``tokenizer.apply_chat_template`` (Llama-3, DeepSeek-R1-Distill, ``auto``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

LLAMA_SYSTEM_PROMPT = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being "
    "safe.  Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or "
    "illegal content. Please ensure that your responses are socially unbiased and positive in nature.\n\n"
    "If a question does not make any sense, or is not factually coherent, explain why instead of answering "
    "something not correct. If you don't know the answer to a question, please don't share false information."
)
VICUNA_SYSTEM_PROMPT = (
    "A chat between a curious user and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the user's questions."
)

STYLES = ("colon", "llama2", "chatml", "turns", "chat_template")


@dataclass(frozen=True)
class PromptTemplate:
    """How to turn a conversation into a prompt, and where an answer ends.

    - ``style``: one of ``STYLES`` (see the module docstring);
    - ``system_message``: text of the system turn ("" for none);
    - ``roles``: (user, assistant) role names for the text styles;
    - ``sep`` / ``sep2``: separators after user / assistant turns (``colon`` and ``llama2``);
    - ``stop_strings``: text after which an answer is cut (e.g. ``</s>`` written out as text);
    - ``stop_tokens``: special-token strings that end an answer, besides the tokenizer's EOS;
    - ``first_turn_only``: answer only the first turn of each question (reasoning models);
    - ``prompt_suffix``: text appended to the rendered prompt (the reference's llama-2 trailing space);
    - ``is_llama3``: passed to the generation methods as ``is_llama3`` (stop at ``<|eot_id|>``);
    - ``answer_prefix``: written before each earlier answer (the reference demo's llama-2 space);
    - ``description``: one line for a ``--help`` or a UI.
    """

    name: str
    style: str
    system_message: str = ""
    roles: tuple[str, str] = ("USER", "ASSISTANT")
    sep: str = " "
    sep2: str = "</s>"
    stop_strings: tuple[str, ...] = ()
    stop_tokens: tuple[str, ...] = ()
    first_turn_only: bool = False
    prompt_suffix: str = ""
    is_llama3: bool = False
    answer_prefix: str = ""
    description: str = ""

    def __post_init__(self):
        if self.style not in STYLES:
            raise ValueError(f"Unknown template style {self.style!r}; expected one of {', '.join(STYLES)}.")

    @property
    def template_has_special_tokens(self) -> bool:
        """The rendered text already holds BOS and the like (the tokenizer's chat template writes them)."""
        return self.style == "chat_template"


TEMPLATES: dict[str, PromptTemplate] = {
    template.name: template
    for template in (
        PromptTemplate("vicuna", "colon", VICUNA_SYSTEM_PROMPT, ("USER", "ASSISTANT"), " ", "</s>", ("</s>",)),
        PromptTemplate(
            "llama2chat", "llama2", LLAMA_SYSTEM_PROMPT, ("[INST]", "[/INST]"), " ", " </s><s>", ("</s>",),
            prompt_suffix=" ",
        ),
        PromptTemplate(
            "mix", "llama2", "", ("[INST]", "[/INST]"), " ", "</s>", ("</s>",),
        ),
        PromptTemplate(
            "qwen3", "chatml", "You are a helpful assistant.", ("user", "assistant"),
            stop_strings=("<|im_end|>", "<|endoftext|>"), stop_tokens=("<|im_end|>", "<|endoftext|>"),
        ),
        PromptTemplate(
            "llama3chat", "chat_template", LLAMA_SYSTEM_PROMPT, stop_tokens=("<|eot_id|>",), is_llama3=True,
        ),
        PromptTemplate("ds", "chat_template", "", stop_tokens=("<|eot_id|>",), first_turn_only=True),
        PromptTemplate(
            "gemma", "turns", "", ("user", "model"), stop_strings=("<end_of_turn>",),
            stop_tokens=("<end_of_turn>",),
        ),
        PromptTemplate("auto", "chat_template", ""),
    )
}


def get_template(name: str) -> PromptTemplate:
    """The template called ``name``; ``KeyError`` listing the available names otherwise."""
    try:
        return TEMPLATES[name]
    except KeyError:
        raise KeyError(f"Unknown prompt template {name!r}; available: {', '.join(sorted(TEMPLATES))}.") from None


def _renamed(template: str, name: str, description: str, **changes) -> PromptTemplate:
    return replace(TEMPLATES[template], name=name, description=description, **changes)


#: The web UI's prompt formats (the reference demo's), by ``--model-type`` name.
MODEL_TYPES: dict[str, PromptTemplate] = {
    template.name: template
    for template in (
        _renamed("vicuna", "vicuna", "FastChat vicuna_v1.1 template (USER: ... ASSISTANT:)"),
        _renamed("llama2chat", "llama-2-chat", "[INST] <<SYS>> ... [/INST] with the Llama-2 system prompt",
                 answer_prefix=" "),
        _renamed("mix", "mixtral", "[INST] ... [/INST], no system prompt", answer_prefix=" ", prompt_suffix=" "),
        _renamed("llama3chat", "llama-3-instruct", "tokenizer chat template with the Llama-2 system prompt"),
        _renamed("auto", "qwen2", "tokenizer chat template"),
        _renamed("auto", "qwen3", "tokenizer chat template"),
    )
}
#: The web UI's default (no ``--model-type``): the tokenizer's own chat template, no system prompt added.
DEFAULT_MODEL_TYPE = _renamed("auto", "default", "tokenizer chat template")

Conversation = Sequence[tuple[str, str | None]]  # (user message, assistant answer or None for the open turn)


def render_text(template: PromptTemplate, conversation: Conversation) -> str:
    """The prompt text of a ``colon``/``llama2``/``chatml`` template; the last answer must be None."""
    user_role, assistant_role = template.roles
    if template.style == "colon":
        text = template.system_message + template.sep if template.system_message else ""
        for user, answer in conversation:
            text += f"{user_role}: {user}{template.sep}"
            text += (f"{assistant_role}: {template.answer_prefix}{answer}{template.sep2}" if answer is not None
                     else f"{assistant_role}:")
    elif template.style == "llama2":
        system = f"<<SYS>>\n{template.system_message}\n<</SYS>>\n\n" if template.system_message else ""
        text = ""
        for index, (user, answer) in enumerate(conversation):
            text += f"{user_role} {system if index == 0 else ''}{user}{template.sep}"
            text += (f"{assistant_role} {template.answer_prefix}{answer}{template.sep2}" if answer is not None
                     else assistant_role)
    elif template.style == "chatml":
        text = f"<|im_start|>system\n{template.system_message}<|im_end|>\n" if template.system_message else ""
        for user, answer in conversation:
            text += f"<|im_start|>{user_role}\n{user}<|im_end|>\n<|im_start|>{assistant_role}\n"
            if answer is not None:
                text += f"{template.answer_prefix}{answer}<|im_end|>\n"
    elif template.style == "turns":  # Gemma's: a system message, if any, opens the first user turn
        text = ""
        for index, (user, answer) in enumerate(conversation):
            system = f"{template.system_message}\n\n" if index == 0 and template.system_message else ""
            text += f"<start_of_turn>{user_role}\n{system}{user}<end_of_turn>\n<start_of_turn>{assistant_role}\n"
            if answer is not None:
                text += f"{template.answer_prefix}{answer}<end_of_turn>\n"
    else:
        raise ValueError(f"Template {template.name!r} uses the tokenizer's chat template, not a text format.")
    return text + template.prompt_suffix


def prompt_text(template: PromptTemplate, tokenizer, conversation: Conversation) -> str:
    """The prompt text for ``conversation`` (whose last answer is None): :func:`render_text` for the text styles,
    ``apply_chat_template(add_generation_prompt=True)`` for ``chat_template``."""
    if not conversation or conversation[-1][1] is not None:
        raise ValueError("The conversation must end with a user message whose answer is None.")
    if template.style != "chat_template":
        return render_text(template, conversation)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"The tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, which the "
            f"{template.name!r} prompt template needs; choose a template with its own text format instead "
            f"(e.g. vicuna) or use a chat model."
        )
    messages = [{"role": "system", "content": template.system_message}] if template.system_message else []
    for user, answer in conversation:
        messages.append({"role": "user", "content": user})
        if answer is not None:
            messages.append({"role": "assistant", "content": template.answer_prefix + answer})
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + template.prompt_suffix


def encode_text(tokenizer, text: str, template_has_special_tokens: bool) -> list[int]:
    """Token ids of ``text``: the tokenizer's special tokens (BOS) added unless the text holds them already;
    exactly one BOS at the start when the tokenizer uses one."""
    ids = list(tokenizer(text, add_special_tokens=not template_has_special_tokens)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    while bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos:
        ids = ids[1:]
    return ids


def encode_prompt(template: PromptTemplate, tokenizer, conversation: Conversation) -> list[int]:
    """Token ids of the prompt for ``conversation`` (whose last answer is None).

    Text styles are tokenised with the tokenizer's special tokens (BOS); ``chat_template`` renders with
    ``apply_chat_template(add_generation_prompt=True)`` and tokenises without adding special tokens again.
    """
    return encode_text(tokenizer, prompt_text(template, tokenizer, conversation), template.template_has_special_tokens)


def stop_token_ids(template: PromptTemplate, tokenizer, model=None) -> list[int]:
    """Ids that end an answer's text: the tokenizer's EOS, ``model.generation_config``'s EOS ids, and the
    template's ``stop_tokens`` that exist in the vocabulary."""
    ids: list[int] = []

    def add(value):
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item >= 0 and item not in ids:
                ids.append(item)

    add(getattr(tokenizer, "eos_token_id", None))
    generation_config = getattr(model, "generation_config", None) if model is not None else None
    if generation_config is not None:
        add(getattr(generation_config, "eos_token_id", None))
    unk = getattr(tokenizer, "unk_token_id", None)
    for token in template.stop_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != unk:
            add(token_id)
    return ids


def truncate_at_stop(token_ids: Sequence[int], stop_ids: Sequence[int]) -> list[int]:
    """``token_ids`` up to and including the first stop id (all of them if there is none)."""
    stops = set(stop_ids)
    for position, token_id in enumerate(token_ids):
        if token_id in stops:
            return list(token_ids[: position + 1])
    return list(token_ids)


def decode_answer(template: PromptTemplate, tokenizer, new_ids: Sequence[int], stop_ids: Sequence[int]) -> str:
    """The answer text of ``new_ids``: cut at the first stop token, special tokens dropped, cut at the
    template's stop strings, stripped."""
    text = tokenizer.decode(truncate_at_stop(new_ids, stop_ids), skip_special_tokens=True)
    for stop in template.stop_strings:
        position = text.find(stop)
        if position >= 0:
            text = text[:position]
    return text.strip()
