"""The web UI's chat without Gradio: a conversation's turns, and what Send, Regenerate, Stop and Clear do to it.

:class:`ChatController` holds the rules and yields plain data (:class:`ChatTurn` lists, :class:`AnswerUpdate`
snapshots); :mod:`eagle.application.webui` only lays out the page and turns that data into Gradio updates, so
everything here is testable without a browser or a server.

Stop and Clear do not cancel the running answer (a Gradio cancel racing a streamed update can leave the chat
showing "Error"): they flag the browser tab, and its answer ends after the step in progress like a finished one. After
Stop the partial answer stays in the chat (and in the prompt of the next turn); after Clear the answer's last update
is an empty chat, so that an update already on its way cannot bring the old conversation back.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from ..model.drafting.registry import NONE
from .prompts import Turn
from .streaming import ChatRunner, ReplyProgress

#: How the page shows plain decoding's drafter, ``"none"``.
NONE_LABEL = "none (plain decoding)"
#: Least time between two screen updates while streaming (the last update of an answer is always sent).
UPDATE_INTERVAL_S = 0.05
EMPTY_ANSWER = "*(empty answer)*"
STOPPED_EMPTY = "*(stopped before the first token)*"
STOP, CLEAR = "stop", "clear"
PLAIN_PANEL_LABEL = f"{NONE_LABEL}, same prompt"
NOT_COMPARING = "tick 'Compare with none' to measure"


@dataclass
class ChatTurn:
    """One exchange of the conversation: the user's message, the plain answer text (None while it is pending) and
    the answer as displayed (Markdown, accepted drafts highlighted)."""

    user: str
    answer: str | None = None
    shown: str | None = None


def drafter_label(drafter: str) -> str:
    """How the page names ``drafter`` (its value stays the drafter spec)."""
    return NONE_LABEL if drafter == NONE else drafter


def finished_turns(history: list[ChatTurn]) -> list[Turn]:
    """``(user, answer)`` of the turns that have an answer: what the next prompt is built from."""
    return [(turn.user, turn.answer) for turn in history if turn.answer is not None]


def chat_messages(history: list[ChatTurn]) -> list[dict[str, str]]:
    """The conversation as chat messages (``{"role", "content"}``), answers as displayed."""
    messages = []
    for turn in history:
        messages.append({"role": "user", "content": turn.user})
        if turn.shown is not None:
            messages.append({"role": "assistant", "content": turn.shown})
    return messages


@dataclass(frozen=True)
class AnswerSettings:
    """The controls an answer is generated with. ``drafter``: a drafter spec the model can run (None: the worker's
    default); ``compare``: then answer again with ``"none"`` (plain decoding) and show both speeds."""

    drafter: str | None = None
    highlight: bool = True
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    max_new_tokens: int = 512
    compare: bool = False


@dataclass
class AnswerUpdate:
    """One screen update while answering. ``speed``: (tokens/s, tokens per target step, accepted draft tokens per
    step) of the chat's answer; ``comparison``: the speed-up line; ``plain_messages`` / ``plain_label``: the plain
    decoding panel of a comparison (None: unchanged); ``cleared``: the chat was cleared."""

    history: list[ChatTurn]
    speed: tuple[str, str, str]
    comparison: str
    plain_messages: list[dict[str, str]] | None = None
    plain_label: str | None = None
    cleared: bool = False

    @property
    def messages(self) -> list[dict[str, str]]:
        return chat_messages(self.history)

    @classmethod
    def empty_chat(cls) -> AnswerUpdate:
        return cls([], ("", "", ""), NOT_COMPARING, [], PLAIN_PANEL_LABEL, cleared=True)


def speed_figures(progress: ReplyProgress | None) -> tuple[str, str, str]:
    """(tokens/s, tokens per target step, accepted draft tokens per step) as shown in the stats boxes."""
    if progress is None or progress.new_tokens == 0:
        return "", "", ""
    accepted = f"{progress.mean_accepted:.2f}" if progress.drafter != NONE else f"0 ({NONE_LABEL})"
    return f"{progress.tokens_per_second:.2f} tokens/s", f"{progress.tokens_per_step:.2f}", accepted


def comparison_text(first: ReplyProgress | None, plain: ReplyProgress | None, comparing: bool) -> str:
    """The speed-up line: the chosen drafter's answer (``first``) against ``"none"``'s (``plain``)."""
    if first is None or plain is None or not plain.tokens_per_second:
        return "measuring..." if comparing else NOT_COMPARING
    ratio = first.tokens_per_second / plain.tokens_per_second
    return (f"{ratio:.2f}x  ({first.drafter} {first.tokens_per_second:.2f} vs plain decoding "
            f"{plain.tokens_per_second:.2f} tokens/s)")


class NothingToRegenerate(ValueError):
    """Regenerate was asked for before any message was sent."""


class ChatController:
    """What the chat's buttons do, for every browser tab of one loaded model; tabs are named by the caller
    (Gradio's session hash)."""

    def __init__(self, runner: ChatRunner):
        self.runner = runner
        self._requests: dict[str, str] = {}  # tab -> STOP or CLEAR: its answer ends at its next step
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------- the buttons
    def submit(self, message: str, history: list[ChatTurn], tab: str) -> list[ChatTurn]:
        """The conversation with ``message`` added, its answer pending; :class:`PromptError` when it cannot be
        answered (empty, too long), and then nothing changes."""
        self._take_request(tab)  # a Stop pressed while idle does not stop the next answer
        self.runner.prompt(finished_turns(history), message)
        return [*history, ChatTurn(message)]

    def regenerate(self, history: list[ChatTurn], tab: str) -> list[ChatTurn]:
        """The conversation with its last answer pending again; :class:`NothingToRegenerate` when it is empty."""
        self._take_request(tab)
        if not history:
            raise NothingToRegenerate("Nothing to regenerate yet: send a message first.")
        return [*history[:-1], ChatTurn(history[-1].user)]

    def stop(self, tab: str) -> None:
        """The tab's answer ends after its step in progress and stays in the chat."""
        with self._lock:
            self._requests[tab] = STOP

    def clear(self, tab: str) -> AnswerUpdate:
        """The tab's answer (if any) ends and clears the chat once more; returns the empty chat."""
        with self._lock:
            self._requests[tab] = CLEAR
        return AnswerUpdate.empty_chat()

    def forget(self, tab: str) -> None:
        """The tab is gone (its page was closed)."""
        self._take_request(tab)

    def _take_request(self, tab: str) -> str | None:
        with self._lock:
            return self._requests.pop(tab, None)

    # ------------------------------------------------------------------------------------------- answering
    def answer(self, history: list[ChatTurn], settings: AnswerSettings, tab: str) -> Iterator[AnswerUpdate]:
        """Stream the answer to the last (pending) turn: one :class:`AnswerUpdate` at most every
        ``UPDATE_INTERVAL_S`` and at the end. Nothing when no turn is pending (the message was refused). Ends
        early, keeping what it has, when the tab asks to stop (and, comparing, skips the second answer)."""
        if not history or history[-1].answer is not None:
            return
        prompt = self.runner.prompt(finished_turns(history[:-1]), history[-1].user)  # PromptError: bad state
        answering = _Answering([dataclasses.replace(turn) for turn in history], settings)
        for decoding, drafter in enumerate([settings.drafter, NONE][: 1 + settings.compare]):
            stream = self.runner.stream(prompt, drafter, settings.temperature, settings.top_p, int(settings.top_k),
                                        int(settings.max_new_tokens))
            try:
                for update in self._updates(answering, decoding, stream, tab):
                    yield update
                    if update.cleared or answering.stopped:
                        return
            finally:
                stream.close()

    def _updates(self, answering: _Answering, decoding: int, stream, tab: str) -> Iterator[AnswerUpdate]:
        last_update = 0.0
        for progress in stream:
            answering.results[decoding] = progress
            request = self._take_request(tab)
            if request == CLEAR:  # an update sent before Clear may reach the page after it: clear again, last
                yield AnswerUpdate.empty_chat()
                return
            answering.stopped = request == STOP
            done = progress.finished or progress.interrupted or answering.stopped
            if not done and time.perf_counter() - last_update < UPDATE_INTERVAL_S:
                continue
            last_update = time.perf_counter()
            yield answering.update(decoding, progress, self.runner, done)
            if answering.stopped:
                return

    def api_stream(self, message: str, history: list[list[str]] | None, drafter: str | None,
                   settings: AnswerSettings) -> Iterator[dict]:
        """The API's answer to ``message`` after ``history`` ([[user, answer], ...]) with ``drafter`` (None: the
        worker's default):
        dicts of text, new_tokens, steps, tokens_per_second, tokens_per_step, mean_accepted, finished, drafter.
        ``ValueError`` (a :class:`PromptError` among them) for a bad message, drafter or setting."""
        prompt = self.runner.prompt([tuple(turn) for turn in history or []], message)
        stream = self.runner.stream(prompt, drafter, settings.temperature, settings.top_p, int(settings.top_k),
                                    int(settings.max_new_tokens))
        for progress in stream:
            yield {"text": progress.text, "new_tokens": progress.new_tokens, "steps": progress.steps,
                   "tokens_per_second": progress.tokens_per_second, "tokens_per_step": progress.tokens_per_step,
                   "mean_accepted": progress.mean_accepted, "finished": progress.finished,
                   "drafter": progress.drafter}


@dataclass
class _Answering:
    """One answer in progress: the conversation being updated, the progress of each decoding (0: the chosen
    drafter's, 1: the comparison's plain decoding), the plain panel."""

    history: list[ChatTurn]
    settings: AnswerSettings
    results: dict[int, ReplyProgress] = dataclasses.field(default_factory=dict)
    plain_messages: list[dict[str, str]] | None = None
    plain_label: str | None = None
    stopped: bool = False

    def update(self, decoding: int, progress: ReplyProgress, runner: ChatRunner, done: bool) -> AnswerUpdate:
        shown = runner.render(progress, self.settings.highlight) or (
            (STOPPED_EMPTY if self.stopped else EMPTY_ANSWER) if done else "")
        if decoding == 0:  # a stopped answer stays in the chat, and in the prompt of the next turn
            self.history[-1].answer, self.history[-1].shown = progress.text, shown
        else:
            self.plain_messages = [{"role": "user", "content": self.history[-1].user},
                                   {"role": "assistant", "content": shown}]
            self.plain_label = f"{NONE_LABEL}: {progress.tokens_per_second:.2f} tokens/s"
        comparison = comparison_text(self.results.get(0), self.results.get(1), self.settings.compare)
        snapshot = [*self.history[:-1], dataclasses.replace(self.history[-1])]  # later steps change the last turn
        return AnswerUpdate(snapshot, speed_figures(self.results[0]), comparison, self.plain_messages,
                            self.plain_label)
