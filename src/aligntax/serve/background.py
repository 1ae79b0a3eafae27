"""Run the server in a background thread on a free loopback port (for tests, benchmarks, notebooks)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn
from fastapi import FastAPI

from aligntax.serve.app import graceful_timeout


class BackgroundServer:
    """uvicorn in a daemon thread on a socket bound to a free port; ``with BackgroundServer(app) as srv``."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", log_level: str = "warning") -> None:
        self.app = app
        # proto=IPPROTO_TCP so that asyncio sets TCP_NODELAY on accepted connections (else Nagle's
        # algorithm adds ~40 ms to every response)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        # an app of create_app: its settings' shutdown_timeout bounds a graceful shutdown
        graceful = graceful_timeout(app) if hasattr(getattr(app, "state", None), "settings") else None
        config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=graceful)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 20) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
