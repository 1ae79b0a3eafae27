"""What guards the server's door: listening only on loopback without an API key (:func:`check_bind`), and
the ASGI middleware in front of every route (:class:`RequestGuard`): the bearer-key check, the body size
limit (bodies over 16 MiB get 413, chunked ones too, without reading the rest) and the per-request
metrics."""

from __future__ import annotations

import hmac
import ipaddress
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aligntax.errors import AligntaxError
from aligntax.serve.metrics import ServeMetrics
from aligntax.serve.protocol import APIError, SafeJSONResponse

MAX_BODY_BYTES = 16 * 1024 * 1024


class InsecureBindError(AligntaxError):
    """A non-loopback host without an API key (and without ``insecure``)."""


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, api_key: str | None, insecure: bool = False) -> None:
    """Refuse to listen on a non-loopback interface without an API key unless ``insecure``."""
    if api_key or insecure or is_loopback(host):
        return
    raise InsecureBindError(
        f"Refusing to serve on {host} without an API key: anyone who can reach this address could use the "
        "model. Set --api-key (or ALIGNTAX_API_KEY), listen on 127.0.0.1, or pass --insecure to serve "
        "without a key anyway."
    )


class RequestGuard:
    """Pure ASGI middleware: API key check, body size limit, and per-request metrics."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServeMetrics) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        counted = path.startswith("/v1/chat/completions")
        start = time.perf_counter()
        status = [500]

        async def send_wrapper(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            error = self._check(scope, path)
            if error is None:
                # Read the body here, up to the limit (chunked bodies have no Content-Length to check).
                chunks, size = [], 0
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > MAX_BODY_BYTES:
                        error = self._too_large()
                        break
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
            if error is not None:
                headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else {}
                if error.status == 413:
                    headers["Connection"] = "close"  # the rest of the body is never read
                response = SafeJSONResponse(error.body(), status_code=error.status, headers=headers or None)
                return await response(scope, receive, send_wrapper)
            body = b"".join(chunks)
            replayed = False

            async def replay() -> Message:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            return await self.app(scope, replay, send_wrapper)
        finally:
            if counted:
                self.metrics.record_request(status[0], time.perf_counter() - start)

    def _check(self, scope: Scope, path: str) -> APIError | None:
        headers = dict(scope.get("headers") or [])
        if self.api_key is not None and (path.startswith("/v1") or path == "/metrics"):
            auth = headers.get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if not auth:
                return APIError(
                    401,
                    "You didn't provide an API key. Send it in the Authorization header "
                    "(Authorization: Bearer YOUR_KEY).",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                return APIError(
                    401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key"
                )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return self._too_large()
        return None

    @staticmethod
    def _too_large() -> APIError:
        return APIError(
            413,
            f"Request body too large (over {MAX_BODY_BYTES} bytes).",
            "invalid_request_error",
            None,
            "request_too_large",
        )
