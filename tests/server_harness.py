"""Shared by the server tests: a tiny Model, a packaged model or a skip, and a real uvicorn server in a thread on a
free loopback port. No tests here (pytest collects no module of this name); tests/conftest.py makes fixtures of it.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest


def tiny_served_model(seed: int = 0):
    """An `lmhead.Model` around tests/tiny.py's 2-layer random Llama (vocab ~300)."""
    from tiny import tiny_model

    from lmhead import Model

    hf_model, tokenizer = tiny_model("llama", seed=seed)
    return Model(hf_model, tokenizer, name="tiny-llama")


def real_model(name: str = "smollm2-135m"):
    """A packaged model from the shared cache, or skip (the models area converts it once)."""
    from lmhead import load_model
    from lmhead.models import ModelError

    try:
        return load_model(name)
    except (ModelError, ImportError, FileNotFoundError) as exc:
        pytest.skip(f"{name} is not available: {exc}")


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> in a daemon thread, with `lmhead serve`'s HTTP protocol
    (`http`: another). Use as a context manager."""

    def __init__(self, app, http: type | str | None = None) -> None:
        import uvicorn

        from lmhead.server.protocol import HeaderTimeoutProtocol

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off",
                                timeout_graceful_shutdown=5, http=http or HeaderTimeoutProtocol)  # as `lmhead serve`
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()
