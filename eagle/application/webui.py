"""Gradio chat that answers with a drafter of the user's choice (EAGLE's, prompt lookup, ``none`` for plain decoding:
those the loaded model can run) and shows its speed, against plain decoding's when comparing.

Run ``python -m eagle.application.webui --help``. Nothing is loaded at import time: :func:`build_demo` takes a
loaded model and returns the ``gr.Blocks`` app; :func:`main` parses flags, loads the model and serves it (on
127.0.0.1, with no public share link unless ``--share``).

The model belongs to the serving worker (:class:`~eagle.application.worker.ModelWorker`, the HTTP server's too);
every event that runs it shares one queue slot (``concurrency_id="eagle-model"``, limit 1), so that the speed each
answer shows is its own, not that of a batch shared with another tab.

What Send, Regenerate, Stop and Clear do is :class:`eagle.application.chat.ChatController`'s (plain data, tested
without Gradio; Stop and Clear flag the session rather than cancel the event, see there). This module lays out the
page (``_layout``), turns the controller's data into Gradio updates (``_Events``) and wires the events (``_wire``).
The model flags are :mod:`eagle.cli`'s.
"""

import argparse
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

from .. import cli
from ..cli import add_model_arguments
from .chat import (  # noqa: F401  (the UI's texts, importable here as before)
    EMPTY_ANSWER, NONE_LABEL, NOT_COMPARING, PLAIN_PANEL_LABEL, STOPPED_EMPTY, UPDATE_INTERVAL_S, AnswerSettings,
    AnswerUpdate, ChatController, ChatTurn, NothingToRegenerate, chat_messages, drafter_label,
)
from .prompts import MODEL_TYPES
from .streaming import ChatRunner, PromptError
from .worker import ModelWorker

logger = logging.getLogger(__name__)

MODEL_QUEUE = "eagle-model"


def _describe(model, runner: ChatRunner, model_name: str | None) -> str:
    head = {True: "EAGLE-3 head", False: "EAGLE-1/2 head"}.get(getattr(model, "use_eagle3", None), "EAGLE head")
    name = model_name or getattr(model, "base_model_name_or_path", None) or type(model).__name__
    described = f"**Model:** {os.path.basename(os.path.normpath(str(name)))}"
    head = "no EAGLE head" if getattr(model, "ea_layer", head) is None else f"an {head}"
    return described + f" with {head}; prompt format: {runner.model_type.name}; context: {runner.max_length} tokens."


@dataclass
class _Page:
    """The components of the page that events read or write."""

    history: object
    chatbot: object
    plain_chat: object
    message: object
    send: object
    stop: object
    regenerate: object
    clear: object
    drafter: object
    compare: object
    highlight: object
    temperature: object
    top_p: object
    top_k: object
    max_new_tokens: object
    speed: object
    per_step: object
    accepted: object
    speedup: object

    @property
    def answer_inputs(self) -> list:
        return [self.history, self.drafter, self.compare, self.highlight, self.temperature, self.top_p, self.top_k,
                self.max_new_tokens]

    @property
    def answer_outputs(self) -> list:
        return [self.history, self.chatbot, self.speed, self.per_step, self.accepted, self.speedup, self.plain_chat]


def _layout(gr, described: str, max_new_tokens: int, max_length: int, temperature: float, top_p: float,
            drafters: list[str]) -> _Page:
    """The page's components, in order (inside a ``gr.Blocks``); ``drafters``: the choices, the default first."""
    gr.Markdown("# EAGLE chat: speculative decoding vs plain decoding\n" + described)
    history = gr.State([])
    with gr.Row():
        speed = gr.Textbox(label="Speed", interactive=False, elem_id="eagle-speed")
        per_step = gr.Textbox(label="Tokens per target forward pass", interactive=False,
                              elem_id="eagle-tokens-per-step")
        accepted = gr.Textbox(label="Mean accepted draft tokens per step", interactive=False, elem_id="eagle-accepted")
        speedup = gr.Textbox(label="Speed-up over plain decoding", interactive=False, elem_id="eagle-speedup",
                             value=NOT_COMPARING)
    with gr.Row(equal_height=True):
        chatbot = gr.Chatbot(label="Chat", elem_id="eagle-chat", height=460, feedback_options=None,
                             buttons=["copy", "copy_all"], scale=1)
        plain_chat = gr.Chatbot(label=PLAIN_PANEL_LABEL, elem_id="eagle-plain-chat", height=460,
                                feedback_options=None, buttons=["copy", "copy_all"], visible=False, scale=1)
    with gr.Row():
        message = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, scale=8,
                             elem_id="eagle-message", autofocus=True)
        send = gr.Button("Send", variant="primary", scale=1, elem_id="eagle-send")
    with gr.Row():
        stop = gr.Button("Stop", variant="stop", elem_id="eagle-stop")
        regenerate = gr.Button("Regenerate", elem_id="eagle-regenerate")
        clear = gr.Button("Clear", elem_id="eagle-clear")
    with gr.Accordion("Settings", open=True):
        with gr.Row():
            drafter = gr.Radio([(drafter_label(spec), spec) for spec in drafters], value=drafters[0],
                               label="Drafter", elem_id="eagle-drafter")
            compare = gr.Checkbox(value=False, label=f"Compare with {NONE_LABEL}", elem_id="eagle-compare")
            highlight = gr.Checkbox(value=True, label="Highlight tokens accepted from EAGLE drafts",
                                    elem_id="eagle-highlight")
        with gr.Row():
            temperature_slider = gr.Slider(0.0, 2.0, value=temperature, step=0.01, label="Temperature (0 = greedy)")
            top_p_slider = gr.Slider(0.0, 1.0, value=top_p, step=0.01, label="Top-p (0 or 1 = off)")
            top_k_slider = gr.Slider(0, 200, value=0, step=1, label="Top-k (0 = off)")
            max_tokens_slider = gr.Slider(1, max(max_new_tokens, max_length - 1), value=max_new_tokens, step=1,
                                          label="Max new tokens")
    return _Page(history, chatbot, plain_chat, message, send, stop, regenerate, clear, drafter, compare, highlight,
                 temperature_slider, top_p_slider, top_k_slider, max_tokens_slider, speed, per_step, accepted, speedup)


class _Events:
    """The event handlers: each asks the :class:`ChatController` and turns its plain data into Gradio updates."""

    def __init__(self, gr, controller: ChatController, max_new_tokens: int):
        self.gr = gr
        self.controller = controller
        self.max_new_tokens = max_new_tokens

    def _inputs(self, enabled: bool):
        """Updates for (message box, Send, Regenerate): one answer at a time per chat."""
        return tuple(self.gr.update(interactive=enabled) for _ in range(3))

    def _answer_outputs(self, update: AnswerUpdate) -> tuple:
        """An update for ``_Page.answer_outputs``."""
        plain = (self.gr.update() if update.plain_messages is None
                 else self.gr.update(value=update.plain_messages, label=update.plain_label))
        return (update.history, update.messages, *update.speed, update.comparison, plain)

    def submit(self, message: str, history: list[ChatTurn], session: str):
        """Add the message to the chat, answer pending; a refused message stays in the box, with a warning."""
        gr = self.gr
        try:
            history = self.controller.submit(message, history, session)
        except PromptError as err:
            gr.Warning(str(err), title="Cannot send this message")
            return gr.update(), history, gr.update(), gr.update(), gr.update()
        return gr.update(value="", interactive=False), history, chat_messages(history), *self._inputs(False)[1:]

    def regenerate(self, history: list[ChatTurn], session: str):
        gr = self.gr
        try:
            history = self.controller.regenerate(history, session)
        except NothingToRegenerate as err:
            gr.Warning(str(err), title="Nothing to regenerate")
            return history, gr.update(), gr.update(), gr.update(), gr.update()
        return history, chat_messages(history), *self._inputs(False)

    def respond(self, history: list[ChatTurn], drafter: str, compare: bool, highlight: bool, temperature: float,
                top_p: float, top_k: float, max_new_tokens: float, session: str):
        """Stream the answer to the last (pending) message as updates for ``_Page.answer_outputs``."""
        settings = AnswerSettings(drafter, highlight, temperature, top_p, int(top_k), int(max_new_tokens), compare)
        try:
            for update in self.controller.answer(history, settings, session):
                yield self._answer_outputs(update)
        except PromptError as err:  # submit() already checked; kept so a bad state never reaches the model
            raise self.gr.Error(str(err), title="Cannot answer this message", print_exception=False) from None

    def unlock(self):
        return self._inputs(True)

    def clear(self, session: str):
        """Empty the chat; a running answer ends, and clears the chat once more."""
        cleared = self._answer_outputs(self.controller.clear(session))
        return self.gr.update(value="", interactive=True), *cleared, *self._inputs(True)[1:]

    def show_compare_panel(self, compare: bool):
        return self.gr.update(visible=bool(compare))

    def api_generate(self):
        """The ``/generate`` API function (its signature is the API's)."""
        controller, gr = self.controller, self.gr

        def generate(message: str, history: list[list[str]] | None = None, drafter: str | None = None,
                     temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
                     max_new_tokens: int = self.max_new_tokens) -> Iterator[dict]:
            """Answer ``message`` after ``history`` ([[user, answer], ...]) with ``drafter`` (a drafter the model
            can run: "eagle3", "none" for plain decoding...; None: the default). Streams dicts: text, new_tokens,
            steps, tokens_per_second, tokens_per_step, mean_accepted, finished, drafter."""
            settings = AnswerSettings(temperature=temperature, top_p=top_p, top_k=int(top_k),
                                      max_new_tokens=int(max_new_tokens))
            try:
                yield from controller.api_stream(message, history, drafter or None, settings)
            except ValueError as err:  # PromptError, or a bad drafter/setting
                raise gr.Error(str(err), print_exception=False) from None

        return generate


def _session_handlers(gr, events: _Events, controller: ChatController) -> dict:
    """The handlers that need the browser session: Gradio passes it to a parameter annotated ``gr.Request``."""

    def submit(message: str, history: list[ChatTurn], request: gr.Request):
        return events.submit(message, history, request.session_hash)

    def regenerate(history: list[ChatTurn], request: gr.Request):
        return events.regenerate(history, request.session_hash)

    def respond(history: list[ChatTurn], drafter: str, compare: bool, highlight: bool, temperature: float,
                top_p: float, top_k: float, max_new_tokens: float, request: gr.Request):
        yield from events.respond(history, drafter, compare, highlight, temperature, top_p, top_k, max_new_tokens,
                                  request.session_hash)

    def stop(request: gr.Request):
        controller.stop(request.session_hash)  # the answer ends at its next step, then .then(unlock)

    def clear(request: gr.Request):
        return events.clear(request.session_hash)

    def forget(request: gr.Request):
        controller.forget(request.session_hash)

    return dict(submit=submit, regenerate=regenerate, respond=respond, stop=stop, clear=clear, forget=forget)


def _wire(gr, page: _Page, events: _Events, demo) -> None:
    """Connect the page's events to the handlers; every event that runs the model shares one queue slot."""
    model_events = dict(concurrency_limit=1, concurrency_id=MODEL_QUEUE)
    light = dict(queue=False, api_visibility="private")
    # Queued (so that a warning shows as a toast) but never waiting for the model.
    checks = dict(concurrency_limit=None, api_visibility="private", show_progress="hidden")
    inputs = [page.message, page.send, page.regenerate]
    on = _session_handlers(gr, events, events.controller)
    answering = []
    for trigger in (page.message.submit, page.send.click):
        answering.append(
            trigger(on["submit"], [page.message, page.history],
                    [page.message, page.history, page.chatbot, page.send, page.regenerate], **checks)
            .success(on["respond"], page.answer_inputs, page.answer_outputs, api_visibility="private",
                     **model_events))
    answering.append(
        page.regenerate.click(on["regenerate"], [page.history], [page.history, page.chatbot, *inputs], **checks)
        .success(on["respond"], page.answer_inputs, page.answer_outputs, api_visibility="private", **model_events))
    for event in answering:
        event.then(events.unlock, None, inputs, **light)
    page.stop.click(on["stop"], None, None, **light)
    cleared = [page.message, *page.answer_outputs, page.send, page.regenerate]
    page.clear.click(on["clear"], None, cleared, **light)
    page.chatbot.clear(on["clear"], None, cleared, **light)  # the chat's own trash button
    demo.unload(on["forget"])
    page.compare.change(events.show_compare_panel, [page.compare], [page.plain_chat], **light)
    gr.api(events.api_generate(), api_name="generate", **model_events)


def build_demo(model, model_type: str | None = None, max_new_tokens: int = 512, max_length: int = 2048,
               model_name: str | None = None, temperature: float = 0.5, top_p: float = 0.9,
               worker: ModelWorker | None = None):
    """The chat app for a loaded ``model`` (an ``EaModel``, or anything with its ``tokenizer``/``device``/
    ``continuous_batch``), served through ``worker`` (the serving worker that owns the model; default: a new one,
    started at the first answer). Returns a ``gr.Blocks``; call ``.queue().launch(...)`` or use :func:`launch`.
    ``model_type`` picks the prompt format (see ``eagle.application.prompts``; ``None`` = the tokenizer's own chat
    template); ``max_new_tokens``, ``temperature`` and ``top_p`` are the initial control values. What the buttons
    do is :class:`~eagle.application.chat.ChatController`'s; this function lays out the page and wires it.
    """
    import gradio as gr

    worker = worker or ModelWorker(model, max_length=max_length)
    runner = ChatRunner(worker, model_type=model_type, max_length=max_length)
    events = _Events(gr, ChatController(runner), max_new_tokens)
    with gr.Blocks(title="EAGLE chat", analytics_enabled=False) as demo:
        page = _layout(gr, _describe(model, runner, model_name), max_new_tokens, runner.max_length, temperature,
                       top_p, runner.drafters())
        _wire(gr, page, events, demo)
    return demo


def launch(demo, host: str = "127.0.0.1", port: int | None = None, share: bool = False, **kwargs):
    """Serve ``demo`` (requests queued); returns what ``gr.Blocks.launch`` returns. Binds ``host`` (127.0.0.1 by
    default); a public share link only with ``share=True``."""
    return demo.queue(default_concurrency_limit=1).launch(server_name=host, server_port=port, share=share,
                                                          **kwargs)


# ---------------------------------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None, prog: str = "python -m eagle.application.webui") -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Chat in the browser with a model accelerated by EAGLE speculative decoding, and compare it with "
                    "plain decoding. Without model paths it serves the embedded default model and head.",
    )
    parser.add_argument("--model-type", choices=list(MODEL_TYPES), default=None,
                        help="prompt format; default: the tokenizer's own chat template")
    parser.add_argument("--max-new-token", type=int, default=512, help="initial 'max new tokens' setting")
    parser.add_argument("--max-length", type=int, default=2048,
                        help="context length for prompt plus answer, in tokens (capped by the model's limit)")
    add_model_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the UI to your network)")
    parser.add_argument("--port", type=int, default=None, help="port (default: Gradio's, 7860 or the next free)")
    parser.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generation before serving")
    args = parser.parse_args(argv)
    if args.max_new_token < 1:
        parser.error(f"--max-new-token must be at least 1, got {args.max_new_token}")
    return args


def quantization_kwargs(args: argparse.Namespace) -> dict:
    """``from_pretrained`` keyword arguments for --load-in-8bit/--load-in-4bit; a clear error where unsupported."""
    return cli.quantization_kwargs(cli.model_options(args).quantization, args.base_model_path)


def load_model(args: argparse.Namespace):
    """Load the ``EaModel`` the flags describe (the embedded default when no paths are given)."""
    return cli.load_model_from_args(args)


def main(argv: list[str] | None = None, prog: str = "python -m eagle.application.webui") -> None:
    """Parse flags (``argv``, default ``sys.argv[1:]``), load the model and serve the UI until interrupted."""
    args = parse_args(argv, prog)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own start-up requests
    model = load_model(args)  # exits with the reason when the model cannot be loaded
    worker = ModelWorker(model, max_length=args.max_length)
    demo = build_demo(model, model_type=args.model_type, max_new_tokens=args.max_new_token,
                      max_length=args.max_length, model_name=args.base_model_path, worker=worker)
    worker.start()
    if not args.no_warmup:
        worker.warm_up()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s: anyone who can reach this address can use the model", args.host)
    launch(demo, host=args.host, port=args.port, share=args.share)


if __name__ == "__main__":
    main()
