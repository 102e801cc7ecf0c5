"""The prompt templates of the answer scripts: kept importable here; they live in :mod:`eagle.templates`."""

from eagle.templates import (  # noqa: F401
    LLAMA_SYSTEM_PROMPT, STYLES, TEMPLATES, VICUNA_SYSTEM_PROMPT, Conversation, PromptTemplate, decode_answer,
    encode_prompt, get_template, prompt_text, render_text, stop_token_ids, truncate_at_stop,
)
