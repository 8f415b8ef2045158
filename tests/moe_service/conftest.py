"""Fixtures of the HTTP API tests (test_server.py, test_hardening_http.py, api/*), over
tests/support/serving_stack.py. A test module may define its own (test_hardening_http.py's
``client`` lets a 500 through as a response)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.support.serving_stack import Stack, ThreadedServer


@pytest.fixture
def stack():
    """The engine loop over the fake model, its service and app (4 sequences)."""
    s = Stack()
    yield s
    s.close()


@pytest.fixture
def client(stack):
    """A TestClient on ``stack``'s app (lifespan started)."""
    with TestClient(stack.app) as c:
        yield c


@pytest.fixture
def live():
    """(stack, ThreadedServer): a stack stepping every 10 ms, served on a loopback port."""
    s = Stack(step_delay_s=0.01)
    srv = ThreadedServer(s.app)
    yield s, srv
    srv.stop()
    s.close()
