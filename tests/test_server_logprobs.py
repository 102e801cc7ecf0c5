"""Log-probabilities through the OpenAI server (eagle/application/logprobs.py): ``logprobs`` / ``top_logprobs`` in
chat, ``logprobs`` and ``echo`` in completions (``max_tokens: 0`` included), streamed and not, through the official
``openai`` client and raw HTTP, on the embedded pair (GGUF kernels): EAGLE's answers carry the same logprobs as
plain decoding's, bit for bit, and echo's the same as the engine's prefill over the prompt."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from chat_helpers import NAME, chat_ids, client, serve  # noqa: E402
from eagle.application.prompts import encode_prompt  # noqa: E402
from eagle.cli import load_default_model  # noqa: E402

pytestmark = pytest.mark.e2e  # the embedded SmolLM2 pair behind the HTTP server

WAIT_S = 120
MESSAGE = "Write a short poem about autumn leaves."
PROMPT = "The capital of France is Paris. The capital of Italy is"


@pytest.fixture(scope="module")
def model():
    return load_default_model()


@pytest.fixture(scope="module")
def served(model):
    with serve(model) as server:
        yield server


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/" + path, json={"model": NAME, **body}, timeout=WAIT_S)


def events(response: httpx.Response) -> list[dict]:
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def chat_logprobs(server, max_tokens: int = 24, **extra) -> dict:
    body = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": max_tokens, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, **extra}
    return post(server, "chat/completions", body).json()


def test_chat_logprobs_are_the_engine_s_and_plain_decoding_s(served, model):
    answer = client(served, timeout=WAIT_S).chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": MESSAGE}], max_tokens=24, temperature=0, logprobs=True,
        top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 24
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == entry.logprob <= 0  # greedy: the likeliest token
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    assert "".join(entry.token for entry in content) == answer.choices[0].message.content
    # the engine's own numbers for that row
    ids = torch.tensor(chat_ids(model, MESSAGE))
    batch = model.continuous_batch()
    batch.add(ids, max_new_tokens=24, logprobs=3)
    expected = [value for step in batch for part in step.values() for value in part.logprobs.chosen.tolist()]
    assert [entry.logprob for entry in content] == expected
    # plain decoding's answer carries the same logprobs, bit for bit
    with serve(model, drafter="none") as plain:
        other = chat_logprobs(plain)
    assert other["eagle"]["drafter"] == "none" and answer.model_extra["eagle"]["drafter"] == model.drafter != "none"
    assert other["choices"][0]["logprobs"] == chat_logprobs(served)["choices"][0]["logprobs"]


def test_streamed_chat_logprobs_equal_the_whole_answer_s(served):
    whole = chat_logprobs(served)
    body = {"messages": [{"role": "user", "content": MESSAGE}], "max_tokens": 24, "temperature": 0,
            "logprobs": True, "top_logprobs": 3, "stream": True}
    chunks = [c for c in events(post(served, "chat/completions", body)) if c["choices"]]
    streamed = [entry for c in chunks if c["choices"][0]["logprobs"] for entry in c["choices"][0]["logprobs"]["content"]]
    assert streamed == whole["choices"][0]["logprobs"]["content"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == whole["choices"][0]["message"]["content"]


def test_chat_without_logprobs_has_none(served):
    answer = post(served, "chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert answer.status_code == 200 and answer.json()["choices"][0]["logprobs"] is None


def test_echo_with_no_new_tokens_scores_the_prompt(served, model):
    ids = encode_prompt(model.tokenizer, PROMPT, False)
    answer = client(served, timeout=WAIT_S).completions.create(model=NAME, prompt=PROMPT, max_tokens=0, echo=True,
                                                               logprobs=2, temperature=0)
    choice = answer.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert answer.usage.completion_tokens == 0 and answer.usage.prompt_tokens == len(ids)
    logprobs = choice.logprobs
    assert logprobs.tokens == [model.tokenizer.decode([i]) for i in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    expected = model.engine.prompt_logprobs(ids, 2)
    assert logprobs.token_logprobs[1:] == expected.chosen.tolist()
    assert [list(top.values())[:2] for top in logprobs.top_logprobs[1:]] == expected.top_logprobs.tolist()
    for token, chosen, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert top[token] == chosen and len(top) in (2, 3)  # top 2, and the chosen token where it is not among them
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(ids))]


def test_prompt_logprobs_are_a_plain_forward_s(kernels_float32_model):
    """In float32 activations, where the kernels compute transformers' float32 model to float rounding (in int8
    activations, the default, a rounding difference can move a block's quantization step), the prompt's logprobs
    are those of the base model's own forward pass over it."""
    ids = encode_prompt(kernels_float32_model.tokenizer, PROMPT, False)
    scored = kernels_float32_model.engine.prompt_logprobs(ids, 2)
    with torch.no_grad():
        logits = kernels_float32_model.base_model(torch.tensor([ids])).logits[0, :-1].float()
    forward = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(scored.chosen, forward, atol=1e-4, rtol=0)


def test_echo_then_generation_streamed_and_not(served, model):
    body = {"prompt": PROMPT, "max_tokens": 8, "echo": True, "logprobs": 1, "temperature": 0}
    whole = post(served, "completions", body).json()["choices"][0]
    prompt_tokens = len(encode_prompt(model.tokenizer, PROMPT, False))
    assert whole["text"].startswith(PROMPT) and len(whole["logprobs"]["tokens"]) == prompt_tokens + 8
    generated = post(served, "completions", {**body, "echo": False}).json()["choices"][0]
    assert whole["text"] == PROMPT + generated["text"]
    assert whole["logprobs"]["token_logprobs"][prompt_tokens:] == generated["logprobs"]["token_logprobs"]
    # the generated tokens' logprobs equal echo's over the whole sequence (both the target's, exactly)
    ids = encode_prompt(model.tokenizer, PROMPT, False)
    batch = model.continuous_batch()
    batch.add(torch.tensor(ids), max_new_tokens=8)
    new = [token for step in batch for part in step.values() for token in part.tokens.tolist()]
    rescored = post(served, "completions", {"prompt": ids + new, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert rescored.json()["choices"][0]["logprobs"]["token_logprobs"] == whole["logprobs"]["token_logprobs"]
    chunks = [c["choices"][0] for c in events(post(served, "completions", {**body, "stream": True})) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    merged = {name: [v for c in chunks if c["logprobs"] for v in c["logprobs"][name]] for name in whole["logprobs"]}
    assert merged == whole["logprobs"]


def test_echo_without_logprobs_repeats_the_prompt(served):
    answer = post(served, "completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True}).json()
    assert answer["choices"][0]["text"] == PROMPT and answer["choices"][0]["logprobs"] is None


def test_legacy_logprobs_zero_still_give_each_token_s_own(served):
    answer = post(served, "completions", {"prompt": PROMPT, "max_tokens": 6, "logprobs": 0, "temperature": 0})
    logprobs = answer.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 6 == len(logprobs["top_logprobs"])
    assert [list(top) for top in logprobs["top_logprobs"]] == [[token] for token in logprobs["tokens"]]
    assert [top[token] for top, token in zip(logprobs["top_logprobs"], logprobs["tokens"])] == logprobs["token_logprobs"]


@pytest.mark.parametrize("path, body, param", [
    ("completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
    ("completions", {"prompt": "Hi", "logprobs": True}, "logprobs"),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": False, "top_logprobs": 0},
     "top_logprobs"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
])
def test_bad_logprob_fields_get_a_400_naming_the_field(served, path, body, param):
    response = post(served, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param and param in response.json()["error"]["message"]


def test_echo_past_the_bound_or_the_context_gets_a_400(model):
    with serve(model, max_echo_tokens=8, max_length=64) as server:
        long = post(server, "completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert long.status_code == 400 and long.json()["error"]["param"] == "echo"
        assert "8" in long.json()["error"]["message"]
        huge = post(server, "completions", {"prompt": "word " * 80, "max_tokens": 0, "echo": True, "logprobs": 1})
        assert huge.status_code == 400 and huge.json()["error"]["code"] == "context_length_exceeded"
        short = post(server, "completions", {"prompt": "Hello there", "max_tokens": 0, "echo": True, "logprobs": 1})
        assert short.status_code == 200
