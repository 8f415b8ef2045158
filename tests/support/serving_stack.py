"""The HTTP API over the real engine loop and the fake model of serving_fakes, as the API tests
use it (tests/moe_service/test_server.py, test_hardening_http.py, api/*; their fixtures
``stack``, ``client`` and ``live`` are in tests/moe_service/conftest.py): the served model's
name, the fake tokenizer, the greedy answer the fake model gives, a chat prompt's ids, the
``data:`` lines of an SSE stream, the stack itself, and uvicorn serving it on a loopback port.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

from moe_service.engine.batch import BatchLoop
from moe_service.metrics import Metrics
from moe_service.server import Service, create_app
from pipeline.serve import _uvicorn_server, bind_socket, local_address
from tests.support.serving_fakes import FakeTokenizer, expected_chain, make_engine

TOK = FakeTokenizer()
MODEL = "fake-moe"


def greedy_text(prompt_ids, n):
    return TOK.decode(expected_chain(prompt_ids, n))


class Stack:
    """Engine + loop + service + app, stopped at teardown."""

    def __init__(self, *, n_seq=4, parallel=4, queue_size=16, n_ctx=256, ready=True, **model_kw):
        self.engine = make_engine(n_seq=n_seq, n_ctx=n_ctx, **model_kw)
        self.metrics = Metrics()
        self.batch = BatchLoop(
            self.engine, parallel=parallel, queue_size=queue_size, retry_after_s=2, metrics=self.metrics
        ).start()
        self.stage = "warmup"
        self.service = Service(
            engine=self.engine,
            batch=self.batch,
            metrics=self.metrics,
            model_name=MODEL,
            stage=lambda: self.stage,
            status_poll_s=0.05,
        )
        self.service.ready = ready
        self.app = create_app(self.service)

    def close(self):
        self.batch.stop(timeout_s=5)


def chat_ids(text):
    return TOK.encode(f"<s>user: {text}\nassistant: ", parse_special=True)


def sse_events(lines):
    out = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


class ThreadedServer:
    """uvicorn on a loopback port in a thread (no signal handlers), as the serve stage runs it
    (``grace_s`` and ``uvicorn_kw``: pipeline.serve._uvicorn_server's, e.g. header_timeout_s)."""

    def __init__(self, app, grace_s: float = 2.0, **uvicorn_kw):
        self.sock = bind_socket("127.0.0.1", 0)
        self.host, self.port = local_address(self.sock)
        self.url = f"http://{self.host}:{self.port}"
        self.server = _uvicorn_server(app, grace_s, **uvicorn_kw)
        self.thread = threading.Thread(
            target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)
