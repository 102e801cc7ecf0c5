"""Gradio chat that answers with EAGLE speculative decoding or plain decoding and shows the speed of each.

Run ``python -m eagle.application.webui --help``. Nothing is loaded at import time: :func:`build_demo` takes a
loaded model and returns the ``gr.Blocks`` app; :func:`main` parses flags, loads the model and serves it (on
127.0.0.1, with no public share link unless ``--share``).

Every event that runs the model shares one queue slot (``concurrency_id="eagle-model"``, limit 1): two browser
tabs or API clients wait for each other instead of interleaving on the model's KV cache.

Stop and Clear do not cancel the running event (a Gradio cancel racing a streamed update can leave the chat showing
"Error"): they flag the session, and its answer ends after the step in progress like a finished one. After Stop the
partial answer stays in the chat (and in the prompt of the next turn); after Clear the answer's last update is an
empty chat, so that an update already on its way cannot bring the old conversation back.
"""

import argparse
import logging
import os
import time
from collections.abc import Iterator

from .. import cli
from ..cli import add_model_arguments
from .prompts import MODEL_TYPES
from .streaming import EAGLE, PLAIN, ChatRunner, PromptError, ReplyProgress

logger = logging.getLogger(__name__)

MODEL_QUEUE = "eagle-model"
MODE_EAGLE, MODE_PLAIN, MODE_COMPARE = "EAGLE", "Plain decoding", "Compare both"
MODES = {MODE_EAGLE: [EAGLE], MODE_PLAIN: [PLAIN], MODE_COMPARE: [EAGLE, PLAIN]}
#: Least time between two screen updates while streaming (the last update of an answer is always sent).
UPDATE_INTERVAL_S = 0.05
EMPTY_ANSWER = "*(empty answer)*"
STOPPED_EMPTY = "*(stopped before the first token)*"
STOP, CLEAR = "stop", "clear"

# A conversation in session state: [user message, plain answer or None while pending, answer as displayed].
HistoryEntry = list


def _turns(history: list[HistoryEntry]) -> list[tuple[str, str]]:
    return [(user, answer) for user, answer, _ in history if answer is not None]


def _chat_messages(history: list[HistoryEntry]) -> list[dict[str, str]]:
    messages = []
    for user, _, shown in history:
        messages.append({"role": "user", "content": user})
        if shown is not None:
            messages.append({"role": "assistant", "content": shown})
    return messages


def _speed_figures(progress: ReplyProgress | None) -> tuple[str, str, str]:
    """(tokens/s, tokens per target step, accepted draft tokens per step) as shown in the stats boxes."""
    if progress is None or progress.new_tokens == 0:
        return "", "", ""
    accepted = f"{progress.mean_accepted:.2f}" if progress.mode == EAGLE else "0 (plain decoding)"
    return f"{progress.tokens_per_second:.2f} tokens/s", f"{progress.tokens_per_step:.2f}", accepted


def _comparison(eagle: ReplyProgress | None, plain: ReplyProgress | None, comparing: bool) -> str:
    if eagle is None or plain is None or not plain.tokens_per_second:
        return "measuring..." if comparing else f"choose '{MODE_COMPARE}' to measure"
    ratio = eagle.tokens_per_second / plain.tokens_per_second
    return (f"{ratio:.2f}x  (EAGLE {eagle.tokens_per_second:.2f} vs plain {plain.tokens_per_second:.2f} tokens/s)")


def build_demo(model, model_type: str | None = None, max_new_tokens: int = 512, max_length: int = 2048,
               model_name: str | None = None, temperature: float = 0.5, top_p: float = 0.9):
    """The chat app for a loaded ``model`` (an ``EaModel``, or anything with its ``tokenizer``/``device``/
    ``ea_generate``/``naive_generate``). Returns a ``gr.Blocks``; call ``.queue().launch(...)`` or use
    :func:`launch`. ``model_type`` picks the prompt format (see ``eagle.application.prompts``; ``None`` = the
    tokenizer's own chat template); ``max_new_tokens``, ``temperature`` and ``top_p`` are the initial control values.
    """
    import gradio as gr

    runner = ChatRunner(model, model_type=model_type, max_length=max_length)
    head = {True: "EAGLE-3 head", False: "EAGLE-1/2 head"}.get(getattr(model, "use_eagle3", None), "EAGLE head")
    name = model_name or getattr(model, "base_model_name_or_path", None) or type(model).__name__
    described = f"**Model:** {os.path.basename(os.path.normpath(str(name)))}"
    described += f" with an {head}; prompt format: {runner.model_type.name}; context: {runner.max_length} tokens."

    # session hash -> STOP or CLEAR: the session's answer (running, or still queued) ends at its next step.
    stop_requests: dict[str, str] = {}

    def request_stop(request: gr.Request):
        stop_requests[request.session_hash] = STOP

    def forget_session(request: gr.Request):
        stop_requests.pop(request.session_hash, None)

    def submit(message: str, history: list[HistoryEntry], request: gr.Request):
        """Add the message to the chat, answer pending; a refused message stays in the box, with a warning."""
        stop_requests.pop(request.session_hash, None)  # a Stop pressed while idle does not stop the next answer
        try:
            runner.prompt(_turns(history), message)
        except PromptError as err:
            gr.Warning(str(err), title="Cannot send this message")
            return gr.update(), history, gr.update(), gr.update(), gr.update()
        history = history + [[message, None, None]]
        return gr.update(value="", interactive=False), history, _chat_messages(history), *_inputs(False)[1:]

    def prepare_regenerate(history: list[HistoryEntry], request: gr.Request):
        stop_requests.pop(request.session_hash, None)
        if not history:
            gr.Warning("Nothing to regenerate yet: send a message first.", title="Nothing to regenerate")
            return history, gr.update(), gr.update(), gr.update(), gr.update()
        history = history[:-1] + [[history[-1][0], None, None]]
        return history, _chat_messages(history), *_inputs(False)

    def respond(history: list[HistoryEntry], mode: str, highlight: bool, temperature: float, top_p: float,
                top_k: float, max_new_tokens: float, request: gr.Request):
        """Stream the answer to the last (pending) message; yields updates for ``answer_outputs``. Ends early,
        keeping what it has, when the session asks to stop."""
        if not history or history[-1][1] is not None:
            return  # nothing pending: the message was refused
        session = request.session_hash
        user = history[-1][0]
        try:
            prompt = runner.prompt(_turns(history[:-1]), user)
        except PromptError as err:  # submit() already checked; kept so a bad state never reaches the model
            raise gr.Error(str(err), title="Cannot answer this message", print_exception=False) from None
        history = [list(entry) for entry in history]
        results: dict[str, ReplyProgress] = {}
        first = MODES[mode][0]
        plain_panel = gr.update()
        for decoding in MODES[mode]:
            last_update = 0.0
            stream = runner.stream(prompt, decoding, temperature, top_p, int(top_k), int(max_new_tokens))
            try:
                for progress in stream:
                    results[decoding] = progress
                    stop = stop_requests.pop(session, None)
                    if stop == CLEAR:  # an update sent before Clear may reach the page after it: clear again, last
                        yield cleared_answer()
                        return
                    done = progress.finished or progress.interrupted or stop == STOP
                    if not done and time.perf_counter() - last_update < UPDATE_INTERVAL_S:
                        continue
                    last_update = time.perf_counter()
                    shown = runner.render(progress, highlight) or (
                        (STOPPED_EMPTY if stop else EMPTY_ANSWER) if done else "")
                    if decoding == first:  # a stopped answer stays in the chat, and in the prompt of the next turn
                        history[-1][1:] = [progress.text, shown]
                    else:
                        plain_panel = gr.update(
                            value=[{"role": "user", "content": user}, {"role": "assistant", "content": shown}],
                            label=f"Plain decoding: {progress.tokens_per_second:.2f} tokens/s")
                    yield (history, _chat_messages(history), *_speed_figures(results[first]),
                           _comparison(results.get(EAGLE), results.get(PLAIN), mode == MODE_COMPARE), plain_panel)
                    if stop:
                        return  # Stop: the comparison's second answer is not started either
            finally:
                stream.close()

    def _inputs(enabled: bool):
        """Updates for (message box, Send, Regenerate): one answer at a time per chat."""
        return tuple(gr.update(interactive=enabled) for _ in range(3))

    def unlock():
        return _inputs(True)

    def cleared_answer():
        """``answer_outputs`` of an empty chat."""
        return ([], [], "", "", "", f"choose '{MODE_COMPARE}' to measure",
                gr.update(value=[], label="Plain decoding (same prompt)"))

    def clear(request: gr.Request):
        stop_requests[request.session_hash] = CLEAR  # a running answer ends, and clears the chat once more
        return gr.update(value="", interactive=True), *cleared_answer(), *_inputs(True)[1:]

    def show_compare_panel(mode: str):
        return gr.update(visible=mode == MODE_COMPARE)

    def api_generate(message: str, history: list[list[str]] | None = None, mode: str = EAGLE,
                     temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
                     max_new_tokens: int = max_new_tokens) -> Iterator[dict]:
        """Answer ``message`` after ``history`` ([[user, answer], ...]) with ``mode`` "eagle" or "plain".
        Streams dicts: text, new_tokens, steps, tokens_per_second, tokens_per_step, mean_accepted, finished."""
        try:
            prompt = runner.prompt([tuple(turn) for turn in history or []], message)
            stream = runner.stream(prompt, mode, temperature, top_p, int(top_k), int(max_new_tokens))
            for progress in stream:
                yield {"text": progress.text, "new_tokens": progress.new_tokens, "steps": progress.steps,
                       "tokens_per_second": progress.tokens_per_second, "tokens_per_step": progress.tokens_per_step,
                       "mean_accepted": progress.mean_accepted, "finished": progress.finished}
        except ValueError as err:  # PromptError, or a bad mode/setting
            raise gr.Error(str(err), print_exception=False) from None

    with gr.Blocks(title="EAGLE chat", analytics_enabled=False) as demo:
        gr.Markdown("# EAGLE chat: speculative decoding vs plain decoding\n" + described)
        history = gr.State([])
        with gr.Row():
            speed = gr.Textbox(label="Speed", interactive=False, elem_id="eagle-speed")
            per_step = gr.Textbox(label="Tokens per target forward pass", interactive=False,
                                  elem_id="eagle-tokens-per-step")
            accepted = gr.Textbox(label="Mean accepted draft tokens per step", interactive=False,
                                  elem_id="eagle-accepted")
            speedup = gr.Textbox(label="Speed-up over plain decoding", interactive=False, elem_id="eagle-speedup",
                                 value=f"choose '{MODE_COMPARE}' to measure")
        with gr.Row(equal_height=True):
            chatbot = gr.Chatbot(label="Chat", elem_id="eagle-chat", height=460, feedback_options=None,
                                 buttons=["copy", "copy_all"], scale=1)
            plain_chat = gr.Chatbot(label="Plain decoding (same prompt)", elem_id="eagle-plain-chat", height=460,
                                    feedback_options=None, buttons=["copy", "copy_all"], visible=False, scale=1)
        with gr.Row():
            message = gr.Textbox(placeholder="Type a message and press Enter", show_label=False, scale=8,
                                 elem_id="eagle-message", autofocus=True)
            send = gr.Button("Send", variant="primary", scale=1, elem_id="eagle-send")
        with gr.Row():
            stop = gr.Button("Stop", variant="stop", elem_id="eagle-stop")
            regenerate = gr.Button("Regenerate", elem_id="eagle-regenerate")
            clear_button = gr.Button("Clear", elem_id="eagle-clear")
        with gr.Accordion("Settings", open=True):
            with gr.Row():
                mode = gr.Radio(list(MODES), value=MODE_EAGLE, label="Decoding", elem_id="eagle-mode")
                highlight = gr.Checkbox(value=True, label="Highlight tokens accepted from EAGLE drafts",
                                        elem_id="eagle-highlight")
            with gr.Row():
                temperature_slider = gr.Slider(0.0, 2.0, value=temperature, step=0.01,
                                               label="Temperature (0 = greedy)")
                top_p_slider = gr.Slider(0.0, 1.0, value=top_p, step=0.01, label="Top-p (0 or 1 = off)")
                top_k_slider = gr.Slider(0, 200, value=0, step=1, label="Top-k (0 = off)")
                max_tokens_slider = gr.Slider(1, max(max_new_tokens, runner.max_length - 1), value=max_new_tokens,
                                              step=1, label="Max new tokens")

        answer_inputs = [history, mode, highlight, temperature_slider, top_p_slider, top_k_slider, max_tokens_slider]
        answer_outputs = [history, chatbot, speed, per_step, accepted, speedup, plain_chat]
        model_events = dict(concurrency_limit=1, concurrency_id=MODEL_QUEUE)
        light = dict(queue=False, api_visibility="private")
        # Queued (so that a warning shows as a toast) but never waiting for the model.
        checks = dict(concurrency_limit=None, api_visibility="private", show_progress="hidden")

        inputs = [message, send, regenerate]
        answering = []
        for trigger in (message.submit, send.click):
            answering.append(
                trigger(submit, [message, history], [message, history, chatbot, send, regenerate], **checks)
                .success(respond, answer_inputs, answer_outputs, api_visibility="private", **model_events))
        answering.append(
            regenerate.click(prepare_regenerate, [history], [history, chatbot, *inputs], **checks)
            .success(respond, answer_inputs, answer_outputs, api_visibility="private", **model_events))
        for event in answering:
            event.then(unlock, None, inputs, **light)
        stop.click(request_stop, None, None, **light)  # the answer ends at its next step, then .then(unlock)
        cleared = [message, history, chatbot, speed, per_step, accepted, speedup, plain_chat, send, regenerate]
        clear_button.click(clear, None, cleared, **light)
        chatbot.clear(clear, None, cleared, **light)  # the chat's own trash button
        demo.unload(forget_session)
        mode.change(show_compare_panel, [mode], [plain_chat], **light)
        gr.api(api_generate, api_name="generate", **model_events)
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


def warm_up(runner: ChatRunner) -> None:
    """One short EAGLE answer, so the first user does not wait for lazy initialisation."""
    for _ in runner.stream(runner.prompt([], "Hello"), EAGLE, max_new_tokens=8):
        pass


def main(argv: list[str] | None = None, prog: str = "python -m eagle.application.webui") -> None:
    """Parse flags (``argv``, default ``sys.argv[1:]``), load the model and serve the UI until interrupted."""
    args = parse_args(argv, prog)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own start-up requests
    model = load_model(args)  # exits with the reason when the model cannot be loaded
    demo = build_demo(model, model_type=args.model_type, max_new_tokens=args.max_new_token,
                      max_length=args.max_length, model_name=args.base_model_path)
    if not args.no_warmup:
        warm_up(ChatRunner(model, model_type=args.model_type, max_length=args.max_length))
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s: anyone who can reach this address can use the model", args.host)
    launch(demo, host=args.host, port=args.port, share=args.share)


if __name__ == "__main__":
    main()
