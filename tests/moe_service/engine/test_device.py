"""engine.device resolution (resolve_device) on this CPU-only machine and with CUDA faked present."""

from __future__ import annotations

import pytest
import torch

from moe_service.config import load_config
from moe_service.engine import device as dev
from moe_service.errors import PreflightError


def resolved(device: str) -> tuple[str, str]:
    plan = dev.resolve_device(load_config(data={"engine": {"device": device}}).engine.device)
    return plan.device, plan.dense


def test_cpu_and_auto_on_this_machine_use_the_quantized_cpu_path():
    assert dev.cuda_absent_reason() is not None  # torch 2.13.0+cpu here
    assert not dev.cuda_available()
    assert resolved("cpu") == ("cpu", "quant")
    assert resolved("auto") == ("cpu", "quant")


def test_cuda_without_a_device_is_refused_with_the_reason():
    with pytest.raises(PreflightError, match="engine.device = cuda but torch .* set engine.device = auto or cpu") as ei:
        resolved("cuda")
    assert ei.value.exit_code == 4


def test_auto_and_cuda_pick_the_current_gpu_when_there_is_one(monkeypatch):
    monkeypatch.setattr(dev, "cuda_absent_reason", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert resolved("auto") == ("cuda:0", "torch")
    assert resolved("cuda") == ("cuda:0", "torch")
    assert resolved("cpu") == ("cpu", "quant")


def test_reasons_name_the_cause(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "sees no CUDA device" in dev.cuda_absent_reason()

    def broken():
        raise RuntimeError("driver too old")

    monkeypatch.setattr(torch.cuda, "is_available", broken)
    assert dev.cuda_absent_reason() == "the CUDA probe failed: RuntimeError: driver too old"
