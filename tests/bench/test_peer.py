"""bench/peer.py without llama.cpp: every measurement is None with a reason that says what to do."""

from __future__ import annotations

import sys

import pytest

from bench import peer


@pytest.fixture
def no_llama_cpp(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import raises ImportError


def test_unavailable_reason_names_the_extra(no_llama_cpp):
    reason = peer.llama_cpp_unavailable_reason()
    assert reason is not None and "llama-cpp-python" in reason and "peer" in reason


@pytest.mark.parametrize("fn, metric, unit", [(peer.measure_load, "load_gbps", "GB/s"),
                                              (peer.measure_prefill, "prefill_tok_s", "tok/s"),
                                              (peer.measure_decode, "decode_tok_s", "tok/s")])
def test_measurements_return_none_with_reason(no_llama_cpp, tmp_path, fn, metric, unit):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    r = fn(model, threads=2)
    assert (r.metric, r.value, r.unit) == (metric, None, unit)
    assert "not installed" in r.reason
    assert r.settings["model"] == str(model)


def test_missing_model_file_is_the_reason_when_llama_cpp_exists(tmp_path):
    if peer.llama_cpp_unavailable_reason() is not None:
        pytest.skip("llama-cpp-python is not installed here")
    r = peer.measure_decode(tmp_path / "absent.gguf")
    assert r.value is None and "does not exist" in r.reason


def test_cpu_window_reports_other_cores():
    with peer._CpuWindow(threads=2) as win:
        sum(i * i for i in range(200_000))
    rep = win.report
    assert rep["threads"] == 2 and rep["cpu_count"] >= 1
    assert rep["self_cores"] is not None and rep["self_cores"] >= 0
    if rep["other_cores"] is not None:
        assert rep["other_cores"] >= 0 and isinstance(rep["busy"], bool)
