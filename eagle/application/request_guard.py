"""The checks every HTTP request passes before the app sees it: its ``Host``, its ``Content-Type`` and its size.

:class:`RequestGuard` is ASGI middleware; each refusal is an OpenAI error object:

* ``421`` (code ``host_not_allowed``) when the ``Host`` header names a host this server does not answer for: a
  web page that rebinds its own domain name to 127.0.0.1 (DNS rebinding) sends its own name, which is refused, so
  it cannot read answers or drive the model. Allowed by default: ``localhost``, ``127.0.0.1``, ``[::1]`` and the
  address the server is bound to (when it is not a wildcard); a wildcard bind (``0.0.0.0``, ``::``) also allows
  any IP address written as such (a rebinding page always sends a name, never an address); more names with
  :func:`allowed_hosts`' ``extra`` (``--allowed-host``; ``*`` allows every name). Any port is accepted. A request
  without a ``Host`` header (HTTP/1.0; browsers always send one) passes.
* ``415`` (code ``unsupported_media_type``) for a ``POST`` whose ``Content-Type`` is not ``application/json``:
  a cross-site form (``text/plain``, ``application/x-www-form-urlencoded``, ``multipart/form-data``) is sent by
  browsers without asking the server first, so it must not be parsed; a JSON body from another site needs a CORS
  preflight, which this server never grants.
* ``413`` (code ``request_too_large``) for a body over ``max_body_bytes``: refused as soon as ``Content-Length``
  says so (uvicorn reads and discards the rest of the upload, so the client still reads the answer), or when the
  bytes received pass the limit; a body within it reaches the app already read.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from .openai_schema import APIError

logger = logging.getLogger(__name__)

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
ANY_HOST = "*"
#: ``Host`` entries meaning "any IP address literal" (a wildcard bind).
ANY_ADDRESS = "<any address>"


def normalize_host(name: str) -> str:
    """``name`` as :func:`host_of` writes a ``Host`` header's host: lower case, no trailing dot, an IPv6 address
    in brackets."""
    name = name.strip().lower().rstrip(".")
    if ":" in name and not name.startswith("["):
        name = f"[{name}]"  # a bare IPv6 address, as --host takes it
    return name


def allowed_hosts(bind_host: str = "127.0.0.1", extra: Iterable[str] = ()) -> frozenset[str]:
    """The ``Host`` names a server bound to ``bind_host`` answers for (see the module docstring)."""
    names = set(LOOPBACK_NAMES) | {normalize_host(name) for name in extra if name.strip() != ANY_HOST}
    if any(name.strip() == ANY_HOST for name in extra):
        names.add(ANY_HOST)
    if bind_host in WILDCARD_HOSTS:
        names.add(ANY_ADDRESS)
    else:
        names.add(normalize_host(bind_host))
    return frozenset(names)


def host_of(header: str) -> str | None:
    """The host of a ``Host`` header value (port removed, normalized), or None when it is malformed."""
    header = header.strip().lower()
    if header.startswith("["):
        end = header.find("]")
        host, rest = header[: end + 1], header[end + 1:]
        if end < 0 or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
        return host
    host, _, port = header.partition(":")
    if not host or (port and not port.isdigit()) or "@" in host or "/" in host:
        return None
    return host.rstrip(".")


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host[1:-1] if host.startswith("[") else host)
    except ValueError:
        return False
    return host.startswith("[") or ":" not in host


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    """Whether a request whose ``Host`` header is ``header`` (None: absent) may be answered."""
    if header is None or ANY_HOST in allowed:
        return True
    host = host_of(header)
    if host is None:
        return False
    return host in allowed or (ANY_ADDRESS in allowed and _is_address(host))


def is_json(content_type: str | None) -> bool:
    """Whether a ``Content-Type`` value is ``application/json`` (any parameters, any case)."""
    return bool(content_type) and content_type.split(";", 1)[0].strip().lower() == "application/json"


class RequestGuard:
    """ASGI middleware: the ``Host``, ``Content-Type`` and body-size checks of the module docstring."""

    def __init__(self, app, allowed: frozenset[str], max_body_bytes: int):
        self.app, self.allowed, self.max_body_bytes = app, allowed, max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = Headers(scope=scope)
        refusal = self._refusal(scope, headers)
        if refusal is None and scope["method"] == "POST":
            body, refusal = await self._read_body(headers, receive)
            if refusal is None:
                receive = _replay(body, receive)
        if refusal is not None:
            response = JSONResponse(refusal.body(), status_code=refusal.status, headers=refusal.headers)
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)

    def _refusal(self, scope, headers: Headers) -> APIError | None:
        host = headers.get("host")
        if not host_allowed(host, self.allowed):
            logger.warning("refused a request for host %r (not one this server answers for)", host)
            names = ", ".join(sorted(n for n in self.allowed if n != ANY_ADDRESS))
            return APIError(421, f"This server does not answer for the host {host!r}; it answers for {names}"
                            f"{' and IP addresses' if ANY_ADDRESS in self.allowed else ''}. Start it with "
                            "--allowed-host NAME to accept another name.", code="host_not_allowed")
        if scope["method"] == "POST" and not is_json(headers.get("content-type")):
            return APIError(415, "Request bodies must be JSON sent with the header 'Content-Type: application/json'"
                            f"; this one came as {headers.get('content-type')!r}.", code="unsupported_media_type")
        return None

    async def _read_body(self, headers: Headers, receive) -> tuple[bytes, APIError | None]:
        """The whole body, or a 413 as soon as it is known to pass the limit."""
        declared = headers.get("content-length")
        if declared is not None and declared.strip().isdigit() and int(declared) > self.max_body_bytes:
            return b"", self._too_large(int(declared))
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: the app sees an empty body, then that
                return b"", None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return b"", self._too_large(None)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None

    def _too_large(self, declared: int | None) -> APIError:
        size = f"{declared} bytes" if declared is not None else "more than that"
        return APIError(413, f"The request body is too large: this server accepts at most {self.max_body_bytes} "
                        f"bytes (--max-body-bytes), and this one is {size}.", code="request_too_large")


def _replay(body: bytes, receive):
    """A ``receive`` that gives the app the body already read, then what the client sends next (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
