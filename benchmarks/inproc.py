"""What the one-process service benchmarks share: a NATS server of their own, and the model they run."""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from halfmoon.deploy.local import free_port, nats_server_binary, wait_for_port


@contextlib.contextmanager
def nats_server() -> Iterator[str]:
    """A nats-server with JetStream (the cache-manager's leadership bucket) on a free loopback port for the
    block; its URL."""
    port = free_port()
    with tempfile.TemporaryDirectory() as store:
        server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(port, 20, server)
            yield f"nats://127.0.0.1:{port}"
        finally:
            server.terminate()
            server.wait(10)


def model_or_default(model: str | None, tmp: str) -> str:
    """``model``, or a random-initialised 16-layer model (hidden 512, 8 KV heads) written under ``tmp``."""
    if model is not None:
        return model
    from halfmoon.cli.model_tools import make_tiny_model

    return str(make_tiny_model(Path(tmp) / "model", hidden_size=512, layers=16, heads=8, kv_heads=8))
