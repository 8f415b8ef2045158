"""Codex CLI against `moe-service serve` on the demo model, through the Responses API: the
`model_providers` entry of docs/api.md, `codex exec --json "say hi"`.

Runs only where the Codex CLI is installed (`npm install -g @openai/codex`, or its path in
MOE_TEST_CODEX); skipped otherwise. Codex's first request is ~40 KB (developer messages, ten
tools, a namespace and a web_search tool, store false, no output limit, streamed); the test
replaces Codex's base instructions with a short file (model_instructions_file: ~2.5k prompt
tokens instead of ~6.5k) and serves a context of 3,072 tokens, so that the run takes minutes on
a shared CPU: the demo model (SmolLM2-135M, nonsense answers) sampled at temperature 1 may
write past that room (it wrote 1,835 tokens in one run), and Codex sends no limit, so the turn
ends either completed or with Codex reporting the server's ``response.incomplete``
(max_output_tokens). Both mean the protocol worked end to end; what is checked is that Codex
parsed the stream to its end and that the server served the request without an error.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from tests.e2e.test_serve_e2e import (  # noqa: F401 - the shared session fixtures
    MODEL_ID,
    demo_model,
    e2e_cache,
    served,
)

CONTEXT_TOKENS = 3072

CODEX = os.environ.get("MOE_TEST_CODEX") or shutil.which("codex")
pytestmark = pytest.mark.skipif(
    not CODEX,
    reason="the Codex CLI is not installed (npm install -g @openai/codex, or set MOE_TEST_CODEX to its path)",
)


def codex_config(url: str, instructions: str) -> str:
    """The docs/api.md entry, plus test-only settings (no retries, a short prompt)."""
    return f"""model = "{MODEL_ID}"
model_provider = "moe"
model_context_window = {CONTEXT_TOKENS}
model_instructions_file = "{instructions}"

[model_providers.moe]
name = "moe-service"
base_url = "{url}/v1"
wire_api = "responses"
stream_idle_timeout_ms = 1800000
request_max_retries = 0
stream_max_retries = 0
"""


@pytest.fixture
def codex_service(demo_model, e2e_cache):  # noqa: F811 - the imported session fixtures
    """A server of its own: the demo model with a 3,072-token context, no API keys."""
    yield from served(
        demo_model, e2e_cache, extra_env={"MOE_SERVICE__MODEL__CONTEXT_TOKENS": str(CONTEXT_TOKENS)}
    )


def test_codex_exec_runs_a_turn_through_the_responses_api(codex_service, tmp_path):
    home = tmp_path / "codex-home"
    work = tmp_path / "work"
    home.mkdir()
    work.mkdir()
    instructions = tmp_path / "instructions.md"
    instructions.write_text("You are a coding agent. Answer briefly.\n")
    (home / "config.toml").write_text(codex_config(codex_service.url, str(instructions)))
    env = {**os.environ, "CODEX_HOME": str(home)}
    done = subprocess.run(
        [CODEX, "exec", "--json", "--skip-git-repo-check", "say hi"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
        stdin=subprocess.DEVNULL,
    )
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    kinds = [e.get("type") for e in events]
    why = (done.returncode, done.stdout[-3000:], done.stderr[-3000:])
    assert "turn.started" in kinds, why
    # what reached the server: one Responses request, streamed, served to its end without an error
    lines = [json.loads(line) for line in codex_service.log_text().splitlines() if line.startswith("{")]
    served = [e for e in lines if e.get("event") == "request_done" and e.get("endpoint") == "/v1/responses"]
    assert served and served[-1]["stream"] and served[-1]["error"] is None, why
    assert not [e for e in lines if e.get("event") in ("request_invalid", "request_failed")], why
    skipped = [e for e in lines if e.get("event") == "responses_tools_skipped"]
    assert skipped and "web_search" in skipped[-1]["types"]  # Codex's hosted tool: skipped, not refused
    if served[-1]["finish_reason"] == "stop":  # the model ended its answer: Codex completes the turn
        assert "turn.completed" in kinds and done.returncode == 0, why
        usage = next(e for e in events if e["type"] == "turn.completed")["usage"]
        assert usage["input_tokens"] == served[-1]["prompt_tokens"] and usage["output_tokens"] > 0
        assert any(e.get("item", {}).get("type") == "agent_message" for e in events), why
    else:  # the context's room ran out: the server's response.incomplete, as Codex reports it
        assert served[-1]["finish_reason"] == "length"
        assert "turn.failed" in kinds and "incomplete" in done.stdout.lower(), why
