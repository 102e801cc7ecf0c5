"""The OpenAI-compatible server (eagle.application.server), through the official ``openai`` client and raw HTTP.

Every server here listens on 127.0.0.1 on a free port, in a thread of the test process. Greedy answers are
compared with ``EaModel.eagenerate`` on the same prompt. :class:`ControlledModel` wraps the tiny model so a test
can hold the worker between steps (to fill the queue, or to disconnect mid-answer) or make it fail, without
relying on timing. Every wait has a time limit.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time

import httpx
import pytest
import torch

openai = pytest.importorskip("openai")

from chat_helpers import NAME, chat_ids, client, serve  # noqa: E402,F401 (also test_server_faults' imports)
from eagle.application.prompts import encode_prompt  # noqa: E402
from eagle.application.server import BackgroundServer, create_app, parse_args  # noqa: E402
from eagle.application.text_stream import TextStream  # noqa: E402

pytestmark = pytest.mark.e2e  # the HTTP server in a subprocess and the embedded pair

PROMPTS = ["Hi there", "What is 2+2?", "Tell me a story.", "abc", "Name a colour.", "Why?", "Count to five.",
           "Write a haiku."]
WAIT_S = 60  # upper bound of any single wait in these tests


class ControlledModel:
    """The wrapped ``EaModel`` with hooks in its running batches (``continuous_batch``): while ``gate`` is cleared
    the worker waits before each step; a prompt
    containing ``fail_token`` makes the engine raise at its next step. Counts the steps run and records, for each
    running batch, how many requests were added at each step boundary (``batches``)."""

    def __init__(self, model):
        self._model = model
        self.gate = threading.Event()
        self.gate.set()
        self.fail_token: int | None = None
        self.steps_run = 0
        self.batches: list[list[int]] = []  # per running batch: requests added before its first step, then joins
        self.rows_per_step: list[int] = []  # rows each step of a running batch computed for

    def __getattr__(self, name):
        return getattr(self._model, name)

    def continuous_batch(self, **kwargs):
        return ControlledBatch(self, self._model.continuous_batch(**kwargs))


class ControlledBatch:
    """A running batch under :class:`ControlledModel`'s hooks."""

    def __init__(self, owner: ControlledModel, inner):
        self.owner, self.inner = owner, inner
        self.added: list[int] = []
        owner.batches.append(self.added)
        self.steps, self.last_add, self.failing = 0, None, False

    def add(self, input_ids, **kwargs):
        if self.owner.fail_token is not None and self.owner.fail_token in input_ids.tolist():
            self.failing = True
        if self.last_add == self.steps:
            self.added[-1] += 1
        else:
            self.added.append(1)
        self.last_add = self.steps
        return self.inner.add(input_ids, **kwargs)

    def cancel(self, row):
        self.inner.cancel(row)

    def __iter__(self):
        for step in self.inner:
            assert self.owner.gate.wait(WAIT_S), "the test never opened the gate"
            if self.failing:
                raise RuntimeError("simulated engine failure")
            self.owner.steps_run += 1
            self.owner.rows_per_step.append(sum(part.finish_reason != "cancelled" for part in step.values()))
            self.steps += 1
            yield step

    def close(self):
        self.inner.close()


@pytest.fixture(scope="module")
def served(tiny_model):
    """A server on the tiny model with default settings, shared by the tests that only read answers."""
    with serve(tiny_model, max_batch_size=8) as server:
        yield server


def reference(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[str, int]:
    """(text, new tokens) of greedy ``eagenerate``."""
    out = model.eagenerate(torch.tensor([prompt_ids]), temperature=0.0, max_new_tokens=max_new_tokens)
    new = out[0, len(prompt_ids):].tolist()
    return model.tokenizer.decode(new, skip_special_tokens=True), len(new)


def ask(server, message: str, max_tokens: int = 24, **extra):
    return client(server).chat.completions.create(model=NAME, messages=[{"role": "user", "content": message}],
                                                  max_tokens=max_tokens, temperature=0, **extra)


def metric(server, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=WAIT_S).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} missing from /metrics")


def wait_until(condition, what: str, limit: float = WAIT_S) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def long_prompt(model, tokens: int = 60) -> str:
    """A message whose greedy answer runs ``tokens`` tokens without a stop token."""
    for message in PROMPTS + [f"Prompt number {i}" for i in range(40)]:
        ids = chat_ids(model, message)
        new = model.eagenerate(torch.tensor([ids]), max_new_tokens=tokens)[0, len(ids):].tolist()
        if len(new) == tokens and not set(new) & model.stop_token_ids():
            return message
    pytest.skip("no prompt with a long answer for this tiny model")


# ------------------------------------------------------------------------------------------------------ answers
def test_models_lists_the_served_name(served):
    assert [m.id for m in client(served).models.list().data] == [NAME]
    assert httpx.get(served.url + "/health").json()["status"] == "ok"


def test_chat_greedy_equals_eagenerate(served, tiny_model):
    answer = ask(served, PROMPTS[0], max_tokens=30)
    text, new_tokens = reference(tiny_model, chat_ids(tiny_model, PROMPTS[0]), 30)
    assert answer.choices[0].message.content == text
    assert answer.choices[0].message.role == "assistant"
    assert answer.usage.prompt_tokens == len(chat_ids(tiny_model, PROMPTS[0]))
    assert answer.usage.completion_tokens == new_tokens
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + new_tokens
    assert answer.choices[0].finish_reason == ("length" if new_tokens == 30 else "stop")
    eagle = answer.model_extra["eagle"]
    assert eagle["drafter"] == tiny_model.drafter and eagle["steps"] >= 1
    assert eagle["tokens_per_step"] == pytest.approx(new_tokens / eagle["steps"], abs=1e-3)


def test_streamed_answer_equals_the_whole_one(served):
    whole = ask(served, PROMPTS[1], max_tokens=40)
    stream = ask(served, PROMPTS[1], max_tokens=40, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # raw server-sent events end with [DONE]
    body = {"model": NAME, "messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": 5, "stream": True}
    raw = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=WAIT_S)
    assert raw.headers["content-type"].startswith("text/event-stream")
    events = [line for line in raw.text.splitlines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_completions_equals_eagenerate(served, tiny_model):
    answer = client(served).completions.create(model=NAME, prompt="Once upon", max_tokens=20, temperature=0)
    ids = encode_prompt(tiny_model.tokenizer, "Once upon", False)
    text, new_tokens = reference(tiny_model, ids, 20)
    assert answer.choices[0].text == text
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (len(ids), new_tokens)
    streamed = client(served).completions.create(model=NAME, prompt="Once upon", max_tokens=20, temperature=0,
                                                  stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text


def test_stop_string_cuts_the_text_and_ends_generation(served, tiny_model):
    message = long_prompt(tiny_model, 40)
    full, _ = reference(tiny_model, chat_ids(tiny_model, message), 40)
    stop = full[10:13]
    cut = full.index(stop)
    for stream in (False, True):
        answer = ask(served, message, max_tokens=40, stop=[stop], stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
        else:
            text = answer.choices[0].message.content
            assert answer.choices[0].finish_reason == "stop"
            assert answer.usage.completion_tokens < 40
        assert text == full[:cut]


def test_text_stream_holds_back_a_possible_stop_string(tiny_model):
    stream = TextStream(tiny_model.tokenizer, stop=["xyz"])
    encode = lambda s: tiny_model.tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert stream.add(encode("abx")) == "ab"  # "x" may begin "xyz"
    assert stream.add(encode("q")) == "xq"
    assert stream.add(encode("xy")) == ""
    assert stream.add(encode("z tail")) == "" and stream.stopped and stream.text == "abxq"


def test_seeded_sampling_repeats(served):
    answers = [client(served).chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                                      max_tokens=20, temperature=1.0, seed=7,
                                                      extra_body={"top_k": 20})
               .choices[0].message.content for _ in range(2)]
    assert answers[0] == answers[1]


# ------------------------------------------------------------------------------------------------- concurrency
def test_eight_simultaneous_clients_get_their_answers_alone(served, tiny_model):
    alone = {p: reference(tiny_model, chat_ids(tiny_model, p), 24)[0] for p in PROMPTS}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = {p: pool.submit(ask, served, p, 24) for p in PROMPTS}
        answers = {p: f.result(timeout=4 * WAIT_S).choices[0].message.content for p, f in futures.items()}
    assert answers == alone


def test_load_64_requests_from_16_threads(served, tiny_model):
    expected = {p: reference(tiny_model, chat_ids(tiny_model, p), 12)[0] for p in PROMPTS}
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(64)]
    ok_before = metric(served, 'eagle_requests_total{outcome="ok"}')

    def one(message):
        if jobs.index(message) % 2:  # half of them streamed
            return "".join(c.choices[0].delta.content or "" for c in ask(served, message, 12, stream=True)
                           if c.choices)
        return ask(served, message, 12).choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, jobs, timeout=300))
    assert len(results) == 64
    assert results == [expected[m] for m in jobs]
    assert metric(served, 'eagle_requests_total{outcome="ok"}') - ok_before == 64
    assert metric(served, "eagle_queue_depth") == 0


def test_waiting_requests_join_the_running_batch_and_get_their_answers_alone(tiny_model):
    model = ControlledModel(tiny_model)
    expected = [reference(tiny_model, chat_ids(tiny_model, message), 16)[0] for message in PROMPTS]
    model.gate.clear()  # the first request holds the worker while the others arrive
    with serve(model, max_batch_size=8, eagle_max_batch_size=0) as server, \
            concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, server, PROMPTS[0], 16)]
        wait_until(lambda: metric(server, "eagle_running_requests") == 1, "the first request to run")
        futures += [pool.submit(ask, server, message, 16) for message in PROMPTS[1:]]
        wait_until(lambda: metric(server, "eagle_queue_depth") == 7, "seven requests to wait")
        held = 0.3
        time.sleep(held)  # the worker is held inside the first request's prefill step
        model.gate.set()
        answers = [future.result(timeout=WAIT_S).choices[0].message.content for future in futures]
        prefill, decode = metric(server, "eagle_prefill_seconds_total"), metric(server, "eagle_decode_seconds_total")
    assert answers == expected
    assert model.batches == [[1, 7]]  # the seven that waited joined the first request's batch at its next step
    assert prefill >= held and decode > 0  # the held step is a prefill in /metrics; the later ones decode


def test_batches_above_the_eagle_limit_decode_plainly_with_the_same_answers(tiny_model):
    model = ControlledModel(tiny_model)
    expected = [reference(tiny_model, chat_ids(tiny_model, message), 12)[0] for message in PROMPTS[:4]]
    model.gate.clear()
    with serve(model, eagle_max_batch_size=2) as server, concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(ask, server, PROMPTS[0], 12)]
        wait_until(lambda: metric(server, "eagle_running_requests") == 1, "the first request to run")
        futures += [pool.submit(ask, server, message, 12) for message in PROMPTS[1:4]]
        wait_until(lambda: metric(server, "eagle_queue_depth") == 3, "three requests to wait")
        model.gate.set()
        answers = [future.result(timeout=WAIT_S) for future in futures]
    assert [a.choices[0].message.content for a in answers] == expected
    assert [a.model_extra["eagle"]["drafter"] for a in answers] == [tiny_model.drafter, "none", "none", "none"]
    assert model.batches == [[1], [3]]  # the EAGLE batch took no one, the next one ran plain


def test_rows_of_a_batch_end_at_their_own_budget_stop_string_or_disconnect(tiny_model):
    """Four requests of one running batch: each ends on its own (4 tokens; a stop string; a client that goes away;
    40 tokens) and leaves the batch, while the others go on to their answers alone."""
    model = ControlledModel(tiny_model)
    message = long_prompt(tiny_model, 40)
    full, _ = reference(tiny_model, chat_ids(tiny_model, message), 40)
    short, _ = reference(tiny_model, chat_ids(tiny_model, message), 4)
    stop = full[10:13]
    model.gate.clear()
    with serve(model, max_batch_size=8, eagle_max_batch_size=0) as server, \
            concurrent.futures.ThreadPoolExecutor(3) as pool:
        leaving = OpenStream(server, message, 40)
        wait_until(lambda: metric(server, "eagle_running_requests") == 1, "the first request to run")
        futures = [pool.submit(ask, server, message, 4), pool.submit(ask, server, message, 40, stop=[stop]),
                   pool.submit(ask, server, message, 40)]
        wait_until(lambda: metric(server, "eagle_queue_depth") == 3, "three requests to wait")
        model.gate.set()
        wait_until(lambda: model.steps_run >= 3, "the three to join")
        leaving.close()
        answers = [future.result(timeout=WAIT_S).choices[0] for future in futures]
        wait_until(lambda: metric(server, 'eagle_requests_total{outcome="cancelled"}') == 1, "the cancellation")
    assert [a.message.content for a in answers] == [short, full[: full.index(stop)], full]
    assert [a.finish_reason for a in answers] == ["length", "stop", "length"]
    assert model.batches == [[1, 3]] and max(model.rows_per_step) == 4
    assert model.rows_per_step[-1] == 1  # the last row ran alone: the others had left the batch


# ------------------------------------------------------------------------------------------------------- errors
def test_api_key_is_required_when_set(tiny_model, monkeypatch):
    with serve(tiny_model, api_key="sesame") as server:
        for key in ("wrong", None):
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            response = httpx.get(server.url + "/v1/models", headers=headers)
            assert response.status_code == 401
            assert response.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(server, "wrong").models.list()
        assert client(server, "sesame").models.list().data[0].id == NAME
        assert httpx.get(server.url + "/health").status_code == 200  # health stays open
    monkeypatch.setenv("EAGLE_API_KEY", "from-env")
    assert parse_args([]).api_key == "from-env"


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"model": NAME}).encode(), "messages"),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "messages.0.role"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), "temperature"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "n": 2}).encode(), "n"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}).encode(), "stop"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"1": 5}}).encode(), "logit_bias"),
    (json.dumps({"messages": [{"role": "user", "content": "x " * 400}]}).encode(), "messages"),
])
def test_malformed_or_unsupported_bodies_get_400(served, body, param):
    response = httpx.post(served.url + "/v1/chat/completions", content=body,
                          headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param and error["message"]


def test_prompt_too_long_says_so_and_unknown_model_gets_404(served):
    with pytest.raises(openai.BadRequestError) as err:
        ask(served, "x " * 400)
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError) as err:
        client(served).chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "Hi"}])
    assert err.value.code == "model_not_found"
    assert ask(served, "Hi", 4).choices[0].message.content is not None  # still serving


def test_internal_error_gives_500_and_the_server_keeps_serving(tiny_model):
    model = ControlledModel(tiny_model)
    model.fail_token = tiny_model.tokenizer.convert_tokens_to_ids("!")
    with serve(model) as server:
        with pytest.raises(openai.InternalServerError):
            ask(server, "boom!")
        stream = ask(server, "boom!", stream=True)
        with pytest.raises(openai.APIError):
            list(stream)
        assert ask(server, "fine", 8).choices[0].message.content == reference(tiny_model, chat_ids(tiny_model,
                                                                                                   "fine"), 8)[0]
        assert metric(server, 'eagle_requests_total{outcome="error"}') == 2


def test_full_queue_gets_429_with_retry_after(tiny_model):
    model = ControlledModel(tiny_model)
    expected = [reference(tiny_model, chat_ids(tiny_model, message), 8)[0] for message in PROMPTS[:2]]
    model.gate.clear()  # the worker holds the first request at its first step
    with serve(model, max_queue=1) as server, concurrent.futures.ThreadPoolExecutor(2) as pool:
        running = pool.submit(ask, server, PROMPTS[0], 8)
        wait_until(lambda: metric(server, "eagle_running_requests") == 1, "the first request to run")
        waiting = pool.submit(ask, server, PROMPTS[1], 8)
        wait_until(lambda: metric(server, "eagle_queue_depth") == 1, "the second request to wait")
        response = httpx.post(server.url + "/v1/chat/completions", timeout=WAIT_S, json={
            "model": NAME, "messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 8})
        assert response.status_code == 429
        assert int(response.headers["Retry-After"]) >= 1
        assert response.json()["error"]["code"] == "queue_full"
        model.gate.set()
        answers = [future.result(timeout=WAIT_S).choices[0].message.content for future in (running, waiting)]
        assert answers == expected


class OpenStream:
    """A streamed greedy chat request, open after its first event; :meth:`close` drops the connection. (The line
    iterator is kept: dropping it half read would close the connection.)"""

    def __init__(self, server, message: str, max_tokens: int):
        body = {"model": NAME, "messages": [{"role": "user", "content": message}], "max_tokens": max_tokens,
                "stream": True, "temperature": 0}
        self.context = httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=WAIT_S)
        response = self.context.__enter__()
        assert response.status_code == 200
        self.lines = response.iter_lines()
        assert next(self.lines).startswith("data: ")

    def close(self) -> None:
        self.context.__exit__(None, None, None)


def test_a_client_that_disconnects_frees_its_place(tiny_model):
    model = ControlledModel(tiny_model)
    message = long_prompt(tiny_model, 60)
    model.gate.clear()
    with serve(model, max_queue=1) as server:
        running = OpenStream(server, message, 60)
        wait_until(lambda: metric(server, "eagle_running_requests") == 1, "the first request to run")
        queued = OpenStream(server, PROMPTS[1], 8)
        wait_until(lambda: metric(server, "eagle_queue_depth") == 1, "the second request to wait")
        queued.close()  # gone while waiting: out of the queue at once
        wait_until(lambda: metric(server, "eagle_queue_depth") == 0, "the queue to free the place")
        with pytest.raises(httpx.TimeoutException):  # a whole (not streamed) answer, given up while waiting
            httpx.post(server.url + "/v1/chat/completions", timeout=1.0, json={
                "model": NAME, "messages": [{"role": "user", "content": PROMPTS[2]}], "max_tokens": 8})
        wait_until(lambda: metric(server, 'eagle_requests_total{outcome="cancelled"}') == 2, "the queue to drop it")
        assert metric(server, "eagle_queue_depth") == 0
        running.close()  # gone mid-answer: stopped after the step in progress
        model.gate.set()
        wait_until(lambda: metric(server, 'eagle_requests_total{outcome="cancelled"}') == 3, "all cancellations")
        wait_until(lambda: metric(server, "eagle_running_requests") == 0, "the worker to be free")
        assert model.steps_run <= 3  # the 60-token answer was not generated to its end
        expected = reference(tiny_model, chat_ids(tiny_model, PROMPTS[2]), 8)[0]
        assert ask(server, PROMPTS[2], 8).choices[0].message.content == expected


def test_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    for flag in ("--base-model-path", "--ea-model-path", "--api-key", "--max-queue", "--max-batch-size", "--no-eagle",
                 "--served-model-name", "--lookup-tokens", "--pack-cpu-weights", "--model-type", "--port"):
        assert flag in out


def test_embedded_default_pair_serves_eagenerate_answers():
    from eagle.cli import load_default_model

    model = load_default_model()
    message = "Name three colours."
    with BackgroundServer(create_app(model, served_model_name="default")) as server:
        answer = client(server).chat.completions.create(
            model="default", messages=[{"role": "user", "content": message}], max_tokens=24, temperature=0)
    text, new_tokens = reference(model, chat_ids(model, message), 24)
    assert answer.choices[0].message.content == text and answer.usage.completion_tokens == new_tokens
    assert answer.model_extra["eagle"]["accepted_tokens"] > 0  # the trained head's drafts are accepted
    # its byte-level tokenizer bounds the tokens of a text from below: no token stands for more characters than
    # the longest one, and only the ASCII characters its vocabulary lacks stand for none; checked against real
    # tokenization of texts made of its longest tokens and of those characters
    from eagle.application.prompt_bound import character_bound

    bound, vocab = character_bound(model.tokenizer), model.tokenizer.get_vocab()
    assert bound.per_token == max(len(token) for token in vocab) and bound.dropped
    assert model.tokenizer(bound.dropped * 50, add_special_tokens=False)["input_ids"] == []
    for token in sorted(vocab, key=len)[-30:] + ["a"]:
        text = (model.tokenizer.convert_tokens_to_string([token]) + bound.dropped) * 40
        assert len(model.tokenizer(text, add_special_tokens=False)["input_ids"]) >= bound.min_tokens(text) > 0


def test_serve_benchmark_measures_both_modes_with_identical_greedy_answers(tiny_pair, tmp_path):
    from eagle.evaluation import serve_benchmark

    base_dir, head_dir = tiny_pair
    results = serve_benchmark.main(["--base-model-path", str(base_dir), "--ea-model-path", str(head_dir),
                                    "--clients", "1", "2", "--requests-per-client", "1", "--min-requests", "2",
                                    "--max-tokens", "6", "--num-prompts", "2", "--engine-alone", "--output-dir", str(tmp_path)])
    runs = {(row["clients"], row["mode"]): row for row in results["rows"]}
    assert set(runs) == {(1, "eagle"), (1, "plain"), (2, "eagle"), (2, "plain")}
    assert all(row["requests"] == 2 and row["tokens"] > 0 and row["tokens_per_s"] > 0 for row in runs.values())
    assert all(0 < row["prefill_share"] < 1 and row["engine_alone_tokens_per_s"] > 0 for row in runs.values())
    assert results["greedy_identical"] == "2 of 2"
    for name in ("serve_benchmark.json", "serve_benchmark.md", "serve_benchmark.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_serve_benchmark_engine_alone_runs_as_many_rows_as_clients_send(tmp_path):
    """`--engine-alone` loads the engine as the clients load the server: never more rows than clients (nor than
    --max-batch-size), a finished request's successor added at the next step, every request once."""
    from types import SimpleNamespace

    from eagle.evaluation.serve_benchmark import closed_loop

    class Running:  # a running batch whose oldest row ends after each step
        def __init__(self):
            self.rows, self.added, self.widest = [], 0, 0

        def add(self, ids, max_new_tokens):
            self.rows.append(self.added)
            self.added += 1
            self.widest = max(self.widest, len(self.rows))

        def __iter__(self):
            while self.rows:
                row = self.rows.pop(0)
                yield {row: SimpleNamespace(tokens=torch.ones(3), finished=True)}

    for clients, max_batch, widest in [(1, 8, 1), (4, 8, 4), (16, 8, 8)]:
        running = Running()
        assert closed_loop(running, [torch.ones(2)], clients, 20, max_batch, 3) == 60
        assert running.added == 20 and running.widest == widest


def test_model_type_formats_the_chat_and_refuses_what_it_cannot_express(tiny_model):
    from eagle import templates

    message = "Hello there"
    ids = templates.encode_prompt(templates.MODEL_TYPES["vicuna"], tiny_model.tokenizer, [(message, None)])
    expected = reference(tiny_model, ids, 16)[0]
    with serve(tiny_model, model_type="vicuna") as server:
        answer = ask(server, message, 16)
        assert answer.choices[0].message.content == expected and answer.usage.prompt_tokens == len(ids)
        with pytest.raises(openai.BadRequestError) as err:
            client(server).chat.completions.create(model=NAME, max_tokens=4, messages=[
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": message}])
        assert err.value.param == "messages"


def test_command_line_serves_the_model_given_by_flags(tiny_pair, tiny_model):
    import os
    import socket
    import subprocess
    import sys

    base_dir, head_dir = tiny_pair
    with socket.socket() as probe:  # a free port for the server to bind
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, EAGLE_API_KEY="from-env")
    command = [sys.executable, "-m", "eagle.application.server", "--base-model-path", str(base_dir),
               "--ea-model-path", str(head_dir), "--total-token", "12", "--depth", "3", "--top-k", "4",
               "--port", str(port), "--served-model-name", NAME, "--no-warmup"]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    server = type("Started", (), {"url": f"http://127.0.0.1:{port}"})()
    try:
        def up():
            assert process.poll() is None, f"the server exited: {process.stderr.read()}"
            with contextlib.suppress(httpx.TransportError):
                return httpx.get(server.url + "/health", timeout=5).status_code == 200
            return False

        wait_until(up, "the server to start", limit=180)
        assert httpx.get(server.url + "/v1/models").status_code == 401
        answer = client(server, "from-env").chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=12, temperature=0)
        assert answer.choices[0].message.content == reference(tiny_model, chat_ids(tiny_model, PROMPTS[0]), 12)[0]
    finally:
        process.terminate()
        status = process.wait(timeout=30)
    assert status == 0  # SIGTERM: a clean exit


# ------------------------------------------------------------------------------------------------------ drafters
def test_a_request_chooses_its_drafter_and_the_answer_says_which(served, tiny_model):
    answers = {drafter: ask(served, PROMPTS[2], max_tokens=24, extra_body={"drafter": drafter})
               for drafter in tiny_model.runnable_drafters()}
    texts = {answer.choices[0].message.content for answer in answers.values()}
    assert len(texts) == 1  # greedy: every drafter gives plain decoding's answer
    assert {drafter: answer.model_extra["eagle"]["drafter"] for drafter, answer in answers.items()} == {
        drafter: drafter for drafter in answers}
    assert answers["none"].model_extra["eagle"]["accepted_tokens"] == 0
    health = httpx.get(served.url + "/health").json()
    assert health["drafter"] == tiny_model.drafter and health["drafters"] == tiny_model.runnable_drafters()


@pytest.mark.parametrize("value,says", [("medusa", "Unknown drafter 'medusa'"), ("eagle1", "needs an EAGLE-1 head"),
                                        ("head", "Unknown drafter 'head'")])
def test_a_drafter_the_model_cannot_run_is_a_400_naming_the_field_and_the_allowed_values(served, tiny_model, value,
                                                                                          says):
    response = httpx.post(served.url + "/v1/chat/completions", json={
        "model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "drafter": value})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "drafter"
    assert says in error["message"] and "can run: " + ", ".join(tiny_model.runnable_drafters()) in error["message"]
