"""``python -m eagle.application.server``: an OpenAI-compatible HTTP server for an EAGLE model.

Serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus)
on FastAPI + uvicorn, on 127.0.0.1:8000 by default; with no model flags it serves the embedded default pair. Run
``python -m eagle.application.server --help``. In Python: :func:`create_app` around a loaded ``EaModel``,
:class:`DeadlineServer` (uvicorn's server with a shutdown deadline) and :class:`BackgroundServer` to serve an app
from a thread (tests, benchmarks).

Shutdown (SIGTERM, SIGINT): the server stops accepting connections and lets running requests finish for up to
``--shutdown-timeout`` seconds; then every request still waiting or running ends with a 503 error (a stream with an
error event), the connections close a moment later, and the process exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import uvicorn

from .. import cli
from ..model.drafting.registry import reference_drafter
from .prompts import MODEL_TYPES
from .request_guard import ANY_HOST, WILDCARD_HOSTS, allowed_hosts
from .worker import ModelWorker
from .server_app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_ECHO_TOKENS, ServerSettings, build_app

logger = logging.getLogger(__name__)

API_KEY_ENV = "EAGLE_API_KEY"
DEFAULT_MAX_QUEUE = 64
# Measured on 2026-12-01 (embedded pair, 2-core CPU, continuous batching; BENCHMARKS.md): with the head's batch
# trees EAGLE served 1.12x, 1.16x, 1.02x and 1.09x plain decoding's tokens/s at 1, 4, 8 and 16 clients, so the
# server runs EAGLE at every batch size by default (without batch trees it lost from 4 rows on: 0.84x, 0.48x).
DEFAULT_EAGLE_MAX_BATCH_SIZE = 0
#: Seconds running requests may go on after a shutdown starts (``--shutdown-timeout``).
DEFAULT_SHUTDOWN_TIMEOUT = 5.0
#: Seconds after that deadline for the error events and 503s to reach the clients before connections are closed.
SHUTDOWN_WRITE_MARGIN_S = 1.0


def create_app(model, served_model_name: str = "eagle", api_key: str | None = None, model_type: str | None = None,
               use_eagle: bool | None = None, max_length: int = 2048, default_max_tokens: int = 512,
               max_queue: int = DEFAULT_MAX_QUEUE, max_batch_size: int = 8,
               eagle_max_batch_size: int = DEFAULT_EAGLE_MAX_BATCH_SIZE, bind_host: str = "127.0.0.1",
               extra_allowed_hosts: Sequence[str] = (), max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               api_docs: bool = False, max_echo_tokens: int = DEFAULT_MAX_ECHO_TOKENS, drafter: str | None = None):
    """The FastAPI app serving ``model`` (an ``EaModel``). ``max_length``: prompt plus answer in tokens (capped by
    the model's position limit); ``drafter``: the drafter spec of requests that do not name one (None: the model's
    default, ``model.drafter``; ``use_eagle=False``, the reference's alias, is ``"none"``: plain decoding);
    ``max_batch_size``: rows of the running batch that waiting requests join between steps;
    ``eagle_max_batch_size`` > 0: when more requests run or wait, batches of requests that name no drafter run plain
    decoding; ``bind_host`` and
    ``extra_allowed_hosts``: the ``Host`` names answered (:func:`~eagle.application.request_guard.allowed_hosts`);
    ``max_body_bytes``: larger request bodies get 413; ``api_docs``: serve ``/openapi.json``, ``/docs`` and
    ``/redoc`` (behind ``api_key``); ``max_echo_tokens``: the longest prompt ``echo`` with ``logprobs`` scores.
    The model worker starts when the app starts (uvicorn's lifespan) and stops with
    it."""
    worker = ModelWorker(model, max_queue=max_queue, max_batch_size=max_batch_size, max_length=max_length,
                         use_eagle=use_eagle, drafter=drafter, eagle_max_batch_size=eagle_max_batch_size,
                         is_llama3=MODEL_TYPES[model_type].is_llama3 if model_type else False)
    settings = ServerSettings(served_model_name=served_model_name, api_key=api_key, model_type=model_type,
                              default_max_tokens=default_max_tokens,
                              allowed_hosts=allowed_hosts(bind_host, extra_allowed_hosts),
                              max_body_bytes=max_body_bytes, api_docs=api_docs, max_echo_tokens=max_echo_tokens)
    return build_app(model, worker, settings)


class DeadlineServer(uvicorn.Server):
    """uvicorn's server, with a deadline for its graceful shutdown: ``shutdown_timeout`` seconds after the shutdown
    starts (a signal, or ``should_exit``), the requests the app's worker still has end with a 503 (streams: an
    error event); :data:`SHUTDOWN_WRITE_MARGIN_S` later uvicorn closes the connections left. (uvicorn's own
    ``timeout_graceful_shutdown`` only cancels the request tasks: the model would go on generating, and the
    clients would get a closed connection without a word.)"""

    def __init__(self, app, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, **config):
        super().__init__(uvicorn.Config(app, lifespan="on", timeout_graceful_shutdown=shutdown_timeout
                                        + SHUTDOWN_WRITE_MARGIN_S, **config))
        self.app, self.shutdown_timeout = app, shutdown_timeout

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.get_running_loop().call_later(self.shutdown_timeout, self.end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    def end_requests(self) -> None:
        """The deadline: end every request still waiting or running with a 503."""
        worker = self.app.state.worker
        if worker.running() or worker.queue_depth():
            logger.warning("shutdown deadline (%g s) passed: ending %d running and %d waiting requests",
                           self.shutdown_timeout, worker.running(), worker.queue_depth())
        worker.close(timeout=0, message=f"The server is shutting down: the request did not finish within the "
                        f"shutdown deadline ({self.shutdown_timeout:g} s) and was ended before its answer was "
                        "complete. Retry it on a running server.")


class BackgroundServer:
    """Serve ``app`` with uvicorn (:class:`DeadlineServer`) from a daemon thread on ``host``:``port`` (0 = a free
    port); a context manager. ``url`` is the base URL once started."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT):
        self.server = DeadlineServer(app, shutdown_timeout=shutdown_timeout, host=host, port=port,
                                     log_level=log_level)
        self.thread = threading.Thread(target=self.server.run, name="eagle-http", daemon=True)
        self.host = host
        self.url = ""

    def start(self, timeout: float = 60.0) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start (is the port free?)")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# ---------------------------------------------------------------------------------------------------- model flags
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model flags of every command (:func:`eagle.cli.add_model_arguments`) and ``--model-type``."""
    cli.add_model_arguments(parser)
    parser.add_argument("--model-type", choices=list(MODEL_TYPES), default=None,
                        help="chat prompt format (default: the tokenizer's own chat template)")


def load_model(args: argparse.Namespace):
    """The ``EaModel`` the model flags describe (:func:`eagle.cli.load_model_from_args`: the embedded default pair
    for what is not given)."""
    return cli.load_model_from_args(args)


def default_served_name(base_model_path: str | None) -> str:
    """The name clients use for the model: the file or directory name of a local model, else the Hub id."""
    if base_model_path is None:
        from ..defaults import DEFAULT_GGUF_NAME

        return DEFAULT_GGUF_NAME.split(".")[0]
    if os.path.exists(base_model_path):
        name = os.path.basename(os.path.normpath(base_model_path))
        return name[:-len(".gguf")] if name.endswith(".gguf") else name
    return base_model_path


# ---------------------------------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m eagle.application.server",
        description="Serve a model with EAGLE speculative decoding over the OpenAI API (/v1/chat/completions, "
        "/v1/completions, /v1/models), plus /health and Prometheus /metrics. Without model flags it serves the "
        "embedded default pair. Greedy answers are token for token those of plain decoding.")
    add_model_arguments(parser)
    parser.add_argument("--no-eagle", action="store_true",
                        help="serve with plain decoding (no drafts): the same as --drafter none")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default 127.0.0.1; 0.0.0.0 exposes the server to your network)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1 requests (default: ${API_KEY_ENV}, "
                        "else no key)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients pass (default: the base model's file or directory name, or "
                        "its Hub id)")
    parser.add_argument("--max-batch-size", type=int, default=8,
                        help="requests generated together: waiting requests join the running batch between two "
                        "steps, up to this many rows (default 8)")
    parser.add_argument("--eagle-max-batch-size", type=int, default=DEFAULT_EAGLE_MAX_BATCH_SIZE,
                        help="when more requests than this run or wait, batches run plain decoding (the same "
                        "greedy answers; batched plain decoding outruns EAGLE's batches on a small CPU); 0 = EAGLE "
                        f"at every batch size (default {DEFAULT_EAGLE_MAX_BATCH_SIZE}, as measured on a 2-core CPU)")
    parser.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                        help=f"requests that may wait for the model; more get 429 (default {DEFAULT_MAX_QUEUE})")
    parser.add_argument("--max-length", type=int, default=2048,
                        help="context per request, prompt plus answer, in tokens (capped by the model's limit)")
    parser.add_argument("--max-new-tokens", type=int, default=512,
                        help="answer budget of a request that sets no max_tokens (default 512)")
    parser.add_argument("--no-warmup", action="store_true", help="skip the short warm-up generation")
    add_safety_arguments(parser)
    args = parser.parse_args(argv)
    for flag in ("max_batch_size", "max_queue", "max_new_tokens", "max_body_bytes", "max_echo_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.max_length < 2:
        parser.error(f"--max-length must be at least 2, got {args.max_length}")
    if args.shutdown_timeout < 0:
        parser.error(f"--shutdown-timeout must be at least 0 seconds, got {args.shutdown_timeout}")
    try:  # --no-eagle is the reference's use_eagle=False
        args.drafter = reference_drafter(args.drafter, use_eagle=False if args.no_eagle else None)
    except ValueError:
        parser.error(f"--no-eagle is --drafter none; it contradicts --drafter {args.drafter}")
    return args


def add_safety_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags for what the server accepts from clients, and for its shutdown."""
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="also answer requests whose Host header names NAME (repeatable; '*' = any name). By "
                        "default only localhost, 127.0.0.1, [::1] and the --host address are answered, and with a "
                        "wildcard --host (0.0.0.0, ::) any IP address too: other names get 421, which keeps web "
                        "pages that rebind their DNS name to this machine out")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body accepted; larger ones get 413 (default {DEFAULT_MAX_BODY_BYTES}"
                        ", 4 MiB)")
    parser.add_argument("--max-echo-tokens", type=int, default=DEFAULT_MAX_ECHO_TOKENS,
                        help="longest prompt whose token logprobs a completion with echo and logprobs computes "
                        f"(one forward pass keeping every position's logits); longer ones get 400 (default "
                        f"{DEFAULT_MAX_ECHO_TOKENS})")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT, metavar="SECONDS",
                        help="on SIGTERM / SIGINT, how long running requests may go on before they end with a 503 "
                        f"(streams: an error event) and the server exits (default {DEFAULT_SHUTDOWN_TIMEOUT:g})")
    parser.add_argument("--api-docs", action="store_true",
                        help="serve /openapi.json, /docs and /redoc (behind --api-key when one is set); off by "
                        "default")


def main(argv: list[str] | None = None) -> None:
    """Parse flags, load the model and serve until interrupted (SIGTERM / SIGINT: exit status 0 after the
    shutdown, see the module docstring)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or default_served_name(args.base_model_path)  # before the paths are filled in
    model = load_model(args)  # exits with the reason when the model cannot be loaded
    app = create_app(model, served_model_name=name, api_key=args.api_key, model_type=args.model_type,
                     max_length=args.max_length, default_max_tokens=args.max_new_tokens,
                     max_queue=args.max_queue, max_batch_size=args.max_batch_size,
                     eagle_max_batch_size=args.eagle_max_batch_size, bind_host=args.host,
                     extra_allowed_hosts=args.allowed_host, max_body_bytes=args.max_body_bytes,
                     api_docs=args.api_docs, max_echo_tokens=args.max_echo_tokens)
    if not args.no_warmup:  # through the worker, on the thread that will serve (the app's lifespan keeps it)
        app.state.worker.start()
        app.state.worker.warm_up()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s: anyone who can reach this address can use the model%s", args.host,
                       "" if args.api_key else " (no --api-key set)")
    if args.host in WILDCARD_HOSTS and ANY_HOST not in args.allowed_host:
        logger.info("clients that reach this server by a name other than localhost need --allowed-host NAME "
                    "(by IP address they need nothing)")
    logger.info("serving '%s' (drafter %s; a request's \"drafter\" may name any of %s) on http://%s:%d/v1", name,
                app.state.worker.drafter, ", ".join(app.state.worker.runnable_drafters()), args.host, args.port)
    server = DeadlineServer(app, shutdown_timeout=args.shutdown_timeout, host=args.host, port=args.port,
                            log_level="info")
    serve_until_signalled(server)
    if not server.started:
        sys.exit(1)  # uvicorn said why (say, the port is taken)
    if not getattr(app.state, "worker_stopped", True):
        exit_now()


def exit_now(status: int = 0) -> None:
    """Exit at once, every answer sent: the model worker is still inside a step (a long prefill), which cannot be
    interrupted, and finalizing the interpreter around it aborts the process (native thread pools are torn down
    under the running step)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def serve_until_signalled(server: uvicorn.Server) -> None:
    """``server.run()``; the SIGTERM or SIGINT that stopped it ends the process normally afterwards. (uvicorn
    raises the signal again once it has shut down, which would kill the process with it, or raise
    KeyboardInterrupt: here it reaches a handler that only logs it.)"""

    def after_shutdown(signum, frame) -> None:
        logger.info("stopped by %s", signal.Signals(signum).name)

    handled = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.signal(sig, after_shutdown) for sig in handled}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    main()
