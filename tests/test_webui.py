"""Web UI: prompt building per model type, draft highlighting, streaming answers, and the app's API.

The browser test is tests/test_webui_browser.py. Here, :class:`FakeModel` stands in where a scripted answer with
known draft acceptance is needed; the tiny real ``EaModel`` checks what users rely on: the same greedy answer with
EAGLE and plain decoding, through the UI's code, and a model still correct after a stopped generation.
"""

from __future__ import annotations

import os
import time

import pytest
import torch

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

from eagle.application import highlight, prompts  # noqa: E402
from eagle.application.streaming import ChatRunner, PromptError  # noqa: E402
from eagle.application.worker import ModelWorker  # noqa: E402
from eagle.model.engine.steps import RowStep  # noqa: E402

EAGLE, PLAIN = "eagle3", "none"  # the drafters the tests answer with
FAKE_ANSWER = "Hello! EAGLE drafts\n- make it *fast*\n- `x < y`"
FAKE_CHUNKS = [1, 3, 1, 4, 2]  # tokens per yield after the prefill's single token, cycled


class FakeBatch:
    """The running batch of :class:`FakeModel`: every row answers the model's scripted answer, in ``sizes``-sized
    steps, to its own budget; ends with the engine's finish reasons."""

    def __init__(self, model, sizes):
        self.model, self.sizes = model, sizes
        self.rows: dict[int, list] = {}  # row -> [answer left, step index]
        self.next_row = 0

    def add(self, input_ids, attention_mask=None, max_new_tokens=512):
        self.model.calls[-1]["max_new_tokens"] = max_new_tokens
        self.rows[self.next_row] = [self.model.answer_ids[:max_new_tokens], 0, max_new_tokens]
        self.next_row += 1
        return [self.next_row - 1]

    def cancel(self, row):
        self.rows.pop(row, None)

    def close(self):
        pass

    def __iter__(self):
        while self.rows:
            time.sleep(self.model.delay)
            step = {}
            for row, state in list(self.rows.items()):
                left, index, budget = state
                size = self.sizes[(index - 1) % len(self.sizes)] if index else 1
                tokens, state[0], state[1] = left[:size], left[size:], index + 1
                reason = None
                if not state[0]:
                    reason = "stop" if tokens and tokens[-1] == self.model.tokenizer.eos_token_id else "length"
                    del self.rows[row]
                step[row] = RowStep(torch.tensor(tokens), len(tokens) - 1 if index else 0, reason)
            yield step


class FakeModel:
    """Scripted stand-in for ``EaModel``: answers ``answer`` (then EOS) whatever the prompt, EAGLE
    (``continuous_batch(drafter="eagle3")``) in ``chunks``-sized steps (all but the last token of each step "accepted
    drafts"), plain decoding one token per step, sleeping ``delay`` seconds per step. Records the keyword arguments
    of each batch (and the budget of its last row)."""

    def __init__(self, tokenizer, answer: str = FAKE_ANSWER, chunks=FAKE_CHUNKS, delay: float = 0.0,
                 max_position_embeddings: int = 512):
        self.tokenizer = tokenizer
        self.answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        self.chunks = chunks
        self.delay = delay
        self.device = torch.device("cpu")
        self.config = type("Config", (), {"max_position_embeddings": max_position_embeddings})()
        self.calls: list[dict] = []

    def continuous_batch(self, drafter=EAGLE, generator=None, **kwargs):
        self.calls.append(dict(kwargs))
        return FakeBatch(self, self.chunks if drafter != PLAIN else [1])

    def runnable_drafters(self):
        return [EAGLE, PLAIN]

    def check_drafter(self, drafter=None, use_eagle=None):
        if drafter not in (None, *self.runnable_drafters()):
            raise ValueError(f"Unknown drafter {drafter!r}; this model can run: eagle3, none.")
        return drafter or EAGLE


def runner_of(model, **kwargs) -> ChatRunner:
    """A runner on a serving worker of its own that owns ``model``."""
    return ChatRunner(ModelWorker(model, max_length=kwargs.get("max_length", 2048)), **kwargs)


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


# ------------------------------------------------------------------------------------------------------- prompts
HISTORY = [("Hi", "Hello!")]


def test_vicuna_prompt_is_fastchat_vicuna_v1_1(tokenizer):
    prompt = prompts.build_prompt(tokenizer, HISTORY, "How are you?", "vicuna")
    assert prompt.text == (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: Hi ASSISTANT: Hello!</s>USER: How are you? "
        "ASSISTANT:")
    assert tokenizer.decode(prompt.input_ids) == prompt.text


def test_llama2_chat_prompt_has_system_prompt_spaced_answers_and_trailing_space(tokenizer):
    text = prompts.build_prompt(tokenizer, HISTORY, "How are you?", "llama-2-chat").text
    assert text.startswith("[INST] <<SYS>>\nYou are a helpful, respectful and honest assistant.")
    assert text.endswith("<</SYS>>\n\nHi [/INST]  Hello! </s><s>[INST] How are you? [/INST] ")


def test_mixtral_prompt_has_no_system_prompt_and_plain_eos_separator(tokenizer):
    text = prompts.build_prompt(tokenizer, HISTORY, "How are you?", "mixtral").text
    assert text == "[INST] Hi [/INST]  Hello!</s>[INST] How are you? [/INST] "


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", None, "default"])
def test_chat_template_types_use_the_tokenizers_template(tokenizer, model_type):
    prompt = prompts.build_prompt(tokenizer, HISTORY, "How are you?", model_type)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
         {"role": "user", "content": "How are you?"}], tokenize=False, add_generation_prompt=True)
    assert prompt.text == expected
    assert prompt.input_ids == tokenizer(expected, add_special_tokens=False)["input_ids"]


def test_llama3_prompt_has_system_prompt_and_a_single_bos(tokenizer):
    # A Llama-3 style template writes the BOS itself; the reference then added a second one when encoding.
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    tokenizer._tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])  # encoding adds a BOS, like Llama-3's
    assert tokenizer("x")["input_ids"][0] == tokenizer.bos_token_id
    prompt = prompts.build_prompt(tokenizer, [], "Hey", "llama-3-instruct")
    assert prompt.text.startswith("<s><|im_start|>system\nYou are a helpful, respectful and honest assistant.")
    assert prompt.input_ids[0] == tokenizer.bos_token_id and prompt.input_ids[1] != tokenizer.bos_token_id
    assert prompts.get_model_type("llama-3-instruct").is_llama3


def test_fastchat_prompt_gets_one_bos_from_a_tokenizer_that_adds_it(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer._tokenizer.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tokenizer.bos_token_id)])
    ids = prompts.build_prompt(tokenizer, [], "Hey", "vicuna").input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id


def test_unknown_model_type_lists_the_choices():
    with pytest.raises(ValueError, match="unknown model type 'llama2'.*vicuna, llama-2-chat, mixtral"):
        prompts.get_model_type("llama2")


def test_default_type_without_chat_template_says_what_to_pass(tokenizer):
    tokenizer = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template.*vicuna"):
        prompts.build_prompt(tokenizer, [], "Hey", None)
    assert "USER: Hey" in prompts.build_prompt(tokenizer, [], "Hey", "vicuna").text


# ---------------------------------------------------------------------------------------------------- highlighting
def test_draft_flags_mark_all_but_the_last_token_of_each_verification_step():
    assert highlight.draft_flags([1, 3, 1, 2]) == [False, True, True, False, False, True, False]


def test_draft_segments_join_to_the_decoded_answer(tokenizer):
    ids = tokenizer("Hello world", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    flags = highlight.draft_flags([1, 3, 1, 4, 3])
    segments = highlight.draft_segments(tokenizer, ids, flags)
    assert segments == [("H", False), ("el", True), ("lo", False), (" wo", True), ("r", False), ("ld", True)]
    assert "".join(text for text, _ in segments) == tokenizer.decode(ids, skip_special_tokens=True)


def _byte_level_tokenizer():
    """A byte-level tokenizer without merges: "é" is two tokens, so a prefix can end inside the character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(pre_tokenizers.ByteLevel.alphabet() + ["<eos>"])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    return tokenizer


def test_draft_segments_cut_multi_byte_characters_cleanly():
    byte_tokenizer = _byte_level_tokenizer()
    ids = byte_tokenizer("aéb", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4
    segments = highlight.draft_segments(byte_tokenizer, ids, [False, False, True, True])
    assert "".join(text for text, _ in segments) == "aéb"
    assert all("\ufffd" not in text for text, _ in segments)


def test_streamed_text_never_shows_half_a_character():
    runner = runner_of(FakeModel(_byte_level_tokenizer(), answer="né é", chunks=[1]))
    for decoding in (EAGLE, PLAIN):
        snapshots = [(p.text, runner.render(p, highlight=True)) for p in runner.stream(runner.prompt([], "x"),
                                                                                      decoding)]
        assert all("\ufffd" not in text + shown for text, shown in snapshots)
        assert snapshots[-1][0] == "né é" and "n" in [text for text, _ in snapshots]


def test_render_highlighted_marks_drafts_but_not_markdown_structure_or_code():
    segments = [("Intro ", False), ("drafted", True), (" text\n", False), ("- item", True), (" one\n", False),
                ("`a <b>`", True), (" and <i>\n```\n", False), ("code line\n", True), ("```", False)]
    html = highlight.render_highlighted(segments)
    assert '<mark class="eagle-draft"' in html and ">drafted</mark>" in html
    assert "\n- <mark" in html                          # the bullet stays outside the mark
    assert "`a <b>`" in html                            # inline code untouched, not escaped
    assert "and &lt;i&gt;" in html                      # model text is shown, not interpreted as HTML
    assert "```\ncode line\n```" in html                # nothing inside a code block
    assert html.count("<mark") == 2


def test_render_highlighted_keeps_emphasis_delimiters_outside_marks():
    html = highlight.render_highlighted([("make it ", False), ("*fas", True), ("t* [a", False), ("b](u) _c_", True),
                                         (" see ", False), ("http://x.y/z", True)])
    assert html == ('make it *<mark class="eagle-draft" style="{0}">fas</mark>t* [a<mark class="eagle-draft" '
                    'style="{0}">b</mark>](u) _<mark class="eagle-draft" style="{0}">c</mark>_ see http://x.y/z'
                    ).format(highlight.DRAFT_STYLE)


def test_render_without_drafts_only_escapes():
    assert highlight.render_highlighted([("a < b\n\n**c**", False)]) == "a &lt; b\n\n**c**"


# -------------------------------------------------------------------------------------------------- ChatRunner
def test_runner_streams_the_scripted_answer_with_speed_figures(tokenizer):
    runner = runner_of(FakeModel(tokenizer))
    snapshots = [(p.text, p.new_tokens) for p in runner.stream(runner.prompt([], "Hi"), EAGLE)]
    final = runner.stream(runner.prompt([], "Hi"), EAGLE)
    *_, last = final
    assert last.finished and last.text == FAKE_ANSWER
    assert snapshots[0] == ("H", 1) and len(snapshots) > 3
    assert last.step_sizes[:5] == [1, 1, 3, 1, 4]
    assert last.tokens_per_step == pytest.approx(last.new_tokens / last.steps) and last.tokens_per_step > 2
    assert last.mean_accepted == pytest.approx(sum(s - 1 for s in last.step_sizes[1:]) / (last.steps - 1))
    assert last.tokens_per_second > 0
    shown = runner.render(last, highlight=True)
    assert "<mark" in shown and "&lt;" not in shown.split("`")[1]  # marks, and inline code left as written
    plain = list(runner.stream(runner.prompt([], "Hi"), PLAIN))[-1]
    assert plain.text == FAKE_ANSWER and plain.tokens_per_step == 1 and plain.mean_accepted == 0
    assert "<mark" not in runner.render(plain, highlight=True)


def test_runner_passes_settings_and_the_context_limit_to_the_model(tokenizer):
    model = FakeModel(tokenizer, max_position_embeddings=300)
    runner = runner_of(model, model_type="qwen3", max_length=2048)
    assert runner.max_length == 300
    list(runner.stream(runner.prompt([], "Hi"), EAGLE, temperature=0.7, top_p=0.8, top_k=5, max_new_tokens=7))
    assert model.calls[-1] == dict(temperature=0.7, top_p=0.8, top_k=5, max_new_tokens=7, max_length=300,
                                   is_llama3=False)


def test_empty_or_too_long_messages_are_refused_with_a_reason(tokenizer):
    runner = runner_of(FakeModel(tokenizer, max_position_embeddings=64))
    with pytest.raises(PromptError, match="empty"):
        runner.prompt([], "   \n")
    with pytest.raises(PromptError, match=r"is \d+ tokens long, but this model's context holds 64 tokens"):
        runner.prompt([], "x" * 100)
    with pytest.raises(ValueError, match="unknown model type"):
        runner_of(FakeModel(tokenizer), model_type="gpt")


def test_an_abandoned_generation_neither_blocks_another_nor_runs_on_once_closed(tokenizer):
    """Two answers on one model share its serving worker (no lock per model): an answer whose stream was left
    half way does not hold up a second one (they are batched), and closing a stream cancels its job."""
    model = FakeModel(tokenizer, delay=0.01)
    worker = ModelWorker(model, max_batch_size=4)
    runner = ChatRunner(worker)
    prompt = runner.prompt([], "Hi")
    first = runner.stream(prompt, EAGLE)
    next(first)  # left half way, not closed
    second = list(ChatRunner(worker).stream(prompt, EAGLE))[-1]  # another runner, the same worker
    assert second.finished and second.text == FAKE_ANSWER
    closed = runner.stream(prompt, PLAIN)
    next(closed)
    closed.close()  # what Gradio does when the user presses Stop
    deadline = time.monotonic() + 10
    while (worker.running() or worker.queue_depth()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert 'eagle_requests_total{outcome="cancelled"} 1' in worker.render_metrics()
    assert list(runner.stream(prompt, PLAIN))[-1].text == FAKE_ANSWER  # and the model serves on
    worker.close()


def test_a_runner_needs_the_worker_that_owns_the_model(tokenizer):
    with pytest.raises(TypeError, match="serving worker"):
        ChatRunner(FakeModel(tokenizer))


def test_real_model_same_greedy_answer_eagle_and_plain_and_usable_after_stop(tiny_model):
    runner = runner_of(tiny_model)
    prompt = runner.prompt([("Hi", "Hello")], "Tell me a story")
    expected = tiny_model.naivegenerate(torch.tensor([prompt.input_ids]), max_new_tokens=24)[0, len(prompt.input_ids):]
    *_, eagle = runner.stream(prompt, EAGLE, temperature=0.0, max_new_tokens=24)
    assert eagle.token_ids == expected.tolist() and eagle.finished
    stopped = runner.stream(prompt, PLAIN, max_new_tokens=24)
    for _ in range(3):
        next(stopped)
    stopped.close()  # what the server does when the user presses Stop
    *_, plain = runner.stream(prompt, PLAIN, temperature=0.0, max_new_tokens=24)
    assert plain.token_ids == expected.tolist()
    assert sum(eagle.step_sizes) == eagle.new_tokens and eagle.steps <= plain.steps
    assert eagle.text == tiny_model.tokenizer.decode(expected, skip_special_tokens=True)


# --------------------------------------------------------------------------------- the chat's buttons, no Gradio
def _controller(tokenizer, **fake):
    from eagle.application.chat import ChatController

    model = FakeModel(tokenizer, **fake)
    return ChatController(runner_of(model)), model


def test_send_adds_a_pending_turn_and_a_refused_message_changes_nothing(tokenizer):
    from eagle.application.chat import ChatTurn

    controller, model = _controller(tokenizer, max_position_embeddings=64)
    history = [ChatTurn("Hi", "Hello!", "Hello!")]
    for refused in ("   ", "x" * 100):
        with pytest.raises(PromptError):
            controller.submit(refused, history, "s")
    assert history == [ChatTurn("Hi", "Hello!", "Hello!")] and not model.calls
    assert controller.submit("More", history, "s") == [*history, ChatTurn("More")]


def test_an_answer_streams_into_the_last_turn_and_feeds_the_next_prompt(tokenizer):
    from eagle.application.chat import NOT_COMPARING, AnswerSettings, ChatTurn, chat_messages, finished_turns

    controller, model = _controller(tokenizer)
    history = controller.submit("Hi", [], "s")
    updates = list(controller.answer(history, AnswerSettings(), "s"))
    last = updates[-1]
    assert history == [ChatTurn("Hi")]  # the session's state is replaced by the updates, not changed in place
    assert last.history[-1].answer == FAKE_ANSWER and "<mark" in last.history[-1].shown
    assert last.messages == chat_messages(last.history) and last.messages[-1]["role"] == "assistant"
    speed, per_step, accepted = last.speed
    assert speed.endswith("tokens/s") and float(per_step) > 2 and float(accepted) > 1
    assert last.comparison == NOT_COMPARING and last.plain_messages is None and not last.cleared
    assert finished_turns(last.history) == [("Hi", FAKE_ANSWER)]
    nothing_pending = list(controller.answer(last.history, AnswerSettings(), "s"))
    assert nothing_pending == [] and len(model.calls) == 1


def test_compare_answers_with_both_and_reports_the_speed_up(tokenizer):
    from eagle.application.chat import AnswerSettings

    controller, model = _controller(tokenizer, delay=0.002)
    history = controller.submit("Hi", [], "s")
    last = list(controller.answer(history, AnswerSettings(highlight=False, compare=True), "s"))[-1]
    assert last.history[-1].answer == FAKE_ANSWER and "<mark" not in last.history[-1].shown
    assert last.plain_messages[0] == {"role": "user", "content": "Hi"} and last.plain_label.endswith("tokens/s")
    assert last.comparison.split("x")[0].replace(".", "").isdigit() and "vs plain" in last.comparison
    assert len(model.calls) == 2


def test_stop_keeps_the_partial_answer_and_skips_the_second_answer_of_a_comparison(tokenizer):
    from eagle.application.chat import UPDATE_INTERVAL_S, AnswerSettings

    controller, model = _controller(tokenizer, delay=UPDATE_INTERVAL_S)  # an update after every step
    controller.stop("s")  # pressed while idle: does not stop the next answer
    history = controller.submit("Hi", [], "s")
    updates = controller.answer(history, AnswerSettings(compare=True), "s")
    first = next(updates)
    controller.stop("other tab")  # another session's Stop is not ours
    assert next(updates).history[-1].answer != first.history[-1].answer  # still answering
    controller.stop("s")
    stopped = list(updates)
    assert len(stopped) == 1 and stopped[0].history[-1].answer  # one last update, the partial answer kept
    assert FAKE_ANSWER.startswith(stopped[0].history[-1].answer) and stopped[0].history[-1].answer != FAKE_ANSWER
    assert len(model.calls) == 1  # plain decoding of the comparison never started
    controller.forget("other tab")
    controller.stop("s")
    updates = controller.answer(controller.regenerate(stopped[0].history, "s"), AnswerSettings(), "s")
    controller.stop("s")  # before the first step: the answer ends after it, with its one token
    (only,) = list(updates)
    assert only.history[-1].answer == tokenizer.decode(model.answer_ids[:1]) and only.history[-1].shown


def test_clear_ends_the_answer_with_an_empty_chat(tokenizer):
    from eagle.application.chat import AnswerSettings, AnswerUpdate

    controller, _ = _controller(tokenizer)
    updates = controller.answer(controller.submit("Hi", [], "s"), AnswerSettings(), "s")
    next(updates)
    assert controller.clear("s") == AnswerUpdate.empty_chat()
    assert list(updates) == [AnswerUpdate.empty_chat()]  # the last update clears again, after any in flight
    assert AnswerUpdate.empty_chat().history == [] and AnswerUpdate.empty_chat().cleared


def test_regenerate_reopens_the_last_turn(tokenizer):
    from eagle.application.chat import ChatTurn, NothingToRegenerate

    controller, _ = _controller(tokenizer)
    with pytest.raises(NothingToRegenerate, match="send a message first"):
        controller.regenerate([], "s")
    history = [ChatTurn("Hi", "Hello!", "Hello!"), ChatTurn("Again", "Sure", "**Sure**")]
    assert controller.regenerate(history, "s") == [history[0], ChatTurn("Again")]


def test_the_api_streams_plain_dicts_and_refuses_bad_input(tokenizer):
    from eagle.application.chat import AnswerSettings

    controller, _ = _controller(tokenizer)
    *_, last = controller.api_stream("Hi", [["Earlier", "Answer"]], PLAIN, AnswerSettings(max_new_tokens=5))
    assert last["finished"] and last["new_tokens"] == 5 and last["steps"] == 5 and last["mean_accepted"] == 0
    with pytest.raises(ValueError, match="Unknown drafter 'fast'"):
        list(controller.api_stream("Hi", None, "fast", AnswerSettings()))


# ------------------------------------------------------------------------------------------------------ the app
def test_importing_the_webui_loads_nothing():
    import subprocess
    import sys

    code = ("import sys, eagle.application.webui as w; "
            "assert 'gradio' not in sys.modules and 'eagle.model.ea_model' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(os.path.dirname(__file__)))


def test_cli_flags_follow_the_reference_and_are_safe_by_default():
    from eagle.application.webui import parse_args

    args = parse_args(["--base-model", "b", "--eagle-model", "h"])
    assert (args.base_model_path, args.ea_model_path) == ("b", "h")
    assert args.host == "127.0.0.1" and not args.share and args.model_type is None
    assert args.use_eagle3 and args.total_token is None and args.lookup_tokens is None and args.max_new_token == 512
    args = parse_args(["--ea-model-path", "h", "--base-model-path", "b", "--no-eagle3", "--model-type", "qwen3"])
    assert not args.use_eagle3 and args.model_type == "qwen3"
    with pytest.raises(SystemExit):
        parse_args(["--model-type", "llama3"])


def test_without_paths_the_web_ui_leaves_the_tree_to_the_embedded_head(monkeypatch, tmp_path):
    """No tree flags: from_pretrained gets none and takes the tree the head carries for the device it runs on."""
    from eagle import defaults
    from eagle.application.webui import load_model, parse_args
    from eagle.model.ea_model import EaModel

    calls = []
    monkeypatch.setattr(EaModel, "from_pretrained", classmethod(lambda cls, **kwargs: calls.append(kwargs)))
    load_model(parse_args([]))
    assert calls[-1]["ea_model_path"] == defaults.default_ea_model_path()
    assert not {"total_token", "depth", "top_k", "lookup_tokens"} & set(calls[-1])
    load_model(parse_args(["--lookup-tokens", "0", "--total-token", "12"]))
    assert calls[-1]["lookup_tokens"] == 0 and calls[-1]["total_token"] == 12
    load_model(parse_args(["--base-model-path", str(tmp_path), "--ea-model-path", str(tmp_path)]))
    assert "total_token" not in calls[-1] and "lookup_tokens" not in calls[-1]  # from_pretrained's own defaults
    with pytest.raises(SystemExit):
        parse_args(["--lookup-tokens", "-1"])


def test_quantisation_flags_fail_clearly_without_cuda(monkeypatch):
    from eagle.application.webui import parse_args, quantization_kwargs

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="--load-in-8bit needs a CUDA GPU"):
        quantization_kwargs(parse_args(["--load-in-8bit"]))
    assert quantization_kwargs(parse_args([])) == {}


def test_build_demo_wires_a_single_model_queue(tokenizer):
    from eagle.application.webui import MODEL_QUEUE, build_demo

    demo = build_demo(FakeModel(tokenizer))
    model_events = [d for d in demo.fns.values() if d.concurrency_id == MODEL_QUEUE]
    assert len(model_events) == 4  # submit, send, regenerate, API
    assert all(d.concurrency_limit == 1 for d in model_events)


def test_the_drafter_choice_offers_what_the_model_runs_and_each_gives_the_greedy_answer(tiny_model):
    from eagle.application.chat import NONE_LABEL, drafter_label

    runner = runner_of(tiny_model)
    assert runner.drafters()[0] == tiny_model.drafter
    assert sorted(runner.drafters()) == sorted(tiny_model.runnable_drafters())
    assert drafter_label("none") == NONE_LABEL and drafter_label("eagle3") == "eagle3"
    prompt = runner.prompt([], "Tell me a story")
    answers = {}
    for drafter in runner.drafters():
        *_, last = runner.stream(prompt, drafter, temperature=0.0, max_new_tokens=16)
        answers[drafter] = last.token_ids
        assert last.drafter == drafter and last.finished
        if drafter == "none":
            assert last.mean_accepted == 0 and last.draft_flags() == [False] * last.new_tokens
    assert len({tuple(ids) for ids in answers.values()}) == 1  # greedy: every drafter answers alike
    with pytest.raises(ValueError, match="Unknown drafter 'fast'.*this model can run: eagle3"):
        next(runner.stream(prompt, "fast"))
