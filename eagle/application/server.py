"""``python -m eagle.application.server``: an OpenAI-compatible HTTP server for an EAGLE model.

Serves ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models``, ``/health`` and ``/metrics`` (Prometheus)
on FastAPI + uvicorn, on 127.0.0.1:8000 by default; with no model flags it serves the embedded default pair. Run
``python -m eagle.application.server --help``. In Python: :func:`create_app` around a loaded ``EaModel``, and
:class:`BackgroundServer` to serve an app from a thread (tests, benchmarks).
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time

from .. import cli
from .prompts import MODEL_TYPES
from .scheduler import Scheduler
from .server_app import ServerSettings, build_app

logger = logging.getLogger(__name__)

API_KEY_ENV = "EAGLE_API_KEY"
DEFAULT_MAX_QUEUE = 64
# Measured on 2026-12-01 (embedded pair, 2-core CPU, continuous batching; BENCHMARKS.md): with the head's batch
# trees EAGLE served 1.12x, 1.16x, 1.02x and 1.09x plain decoding's tokens/s at 1, 4, 8 and 16 clients, so the
# server runs EAGLE at every batch size by default (without batch trees it lost from 4 rows on: 0.84x, 0.48x).
DEFAULT_EAGLE_MAX_BATCH_SIZE = 0


def create_app(model, served_model_name: str = "eagle", api_key: str | None = None, model_type: str | None = None,
               use_eagle: bool = True, max_length: int = 2048, default_max_tokens: int = 512,
               max_queue: int = DEFAULT_MAX_QUEUE, max_batch_size: int = 8,
               eagle_max_batch_size: int = DEFAULT_EAGLE_MAX_BATCH_SIZE):
    """The FastAPI app serving ``model`` (an ``EaModel``). ``max_length``: prompt plus answer in tokens (capped by
    the model's position limit); ``use_eagle=False`` serves plain decoding (for comparison);
    ``max_batch_size``: rows of the running batch that waiting requests join between steps;
    ``eagle_max_batch_size`` > 0: when more requests run or wait, batches run plain decoding. The model worker
    starts when the app starts (uvicorn's lifespan) and stops with it."""
    from .streaming import _position_limit

    max_length = min(max_length, _position_limit(model) or max_length)
    scheduler = Scheduler(model, max_queue=max_queue, max_batch_size=max_batch_size, max_length=max_length,
                          use_eagle=use_eagle, eagle_max_batch_size=eagle_max_batch_size,
                          is_llama3=MODEL_TYPES[model_type].is_llama3 if model_type else False)
    settings = ServerSettings(served_model_name=served_model_name, api_key=api_key, model_type=model_type,
                              default_max_tokens=default_max_tokens)
    return build_app(model, scheduler, settings)


class BackgroundServer:
    """Serve ``app`` with uvicorn from a daemon thread on ``host``:``port`` (0 = a free port); a context manager.
    ``url`` is the base URL once started."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                                    lifespan="on", timeout_graceful_shutdown=5))
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
                        help="serve with plain decoding (no drafts), to compare with EAGLE")
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
    args = parser.parse_args(argv)
    for flag in ("max_batch_size", "max_queue", "max_new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    if args.max_length < 2:
        parser.error(f"--max-length must be at least 2, got {args.max_length}")
    return args


def warm_up(model, use_eagle: bool) -> None:
    """One short generation, so that the first client does not wait for lazy initialisation."""
    ids = model.tokenizer("Hello", return_tensors="pt")["input_ids"]
    for _ in model.generate_steps(ids, max_new_tokens=8, use_eagle=use_eagle):
        pass


def main(argv: list[str] | None = None) -> None:
    """Parse flags, load the model and serve until interrupted."""
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    name = args.served_model_name or default_served_name(args.base_model_path)  # before the paths are filled in
    model = load_model(args)  # exits with the reason when the model cannot be loaded
    if not args.no_warmup:
        warm_up(model, use_eagle=not args.no_eagle)
    app = create_app(model, served_model_name=name, api_key=args.api_key, model_type=args.model_type,
                     use_eagle=not args.no_eagle, max_length=args.max_length, default_max_tokens=args.max_new_tokens,
                     max_queue=args.max_queue, max_batch_size=args.max_batch_size,
                     eagle_max_batch_size=args.eagle_max_batch_size)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s: anyone who can reach this address can use the model%s", args.host,
                       "" if args.api_key else " (no --api-key set)")
    logger.info("serving '%s' (%s decoding) on http://%s:%d/v1", name, "plain" if args.no_eagle else "EAGLE",
                args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
