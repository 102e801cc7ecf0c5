"""Helpers shared by the test modules: a chat message's prompt ids (as ``EaModel`` users and the server encode it),
and a model served over HTTP in a thread of the test process with an OpenAI client for it."""

from __future__ import annotations

import contextlib

import torch

from eagle.application.prompts import encode_prompt
from eagle.application.server import BackgroundServer, create_app

#: The model name every test server answers to (``served_model_name``).
NAME = "eagle-test"
#: The OpenAI client's time limit of one request, in seconds.
CLIENT_TIMEOUT_S = 60


def chat_template_ids(model, message: str) -> torch.Tensor:
    """(1, S) ids of ``message`` as one user turn through the tokenizer's chat template, the assistant's turn
    opened (what a caller of ``eagenerate`` passes)."""
    return model.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)["input_ids"]


def chat_ids(model, message: str) -> list[int]:
    """The ids the server's chat endpoint generates after for ``message`` as one user turn: the chat template's
    text, then the server's own encoding of it."""
    text = model.tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                               add_generation_prompt=True)
    return encode_prompt(model.tokenizer, text, True)


@contextlib.contextmanager
def serve(model, **settings):
    """``model`` served as :data:`NAME` (``create_app``'s other ``settings`` as given) until the block ends."""
    with BackgroundServer(create_app(model, served_model_name=NAME, **settings)) as server:
        yield server


def client(server, api_key: str = "unused", timeout: float = CLIENT_TIMEOUT_S):
    """An ``openai.OpenAI`` client of ``server`` that never retries."""
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)
