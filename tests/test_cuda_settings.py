"""The engine's CUDA attention setting, checked on the CPU build (CI has no GPU): cuDNN SDPA is turned
off unless ``PIPESPEC_CUDNN_SDP=1`` keeps it (it builds a plan per key length: ~39 ms per decode-step
attention call on an H200, docs/engine.md)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pipespec.engine.stage.settings import CUDNN_SDP_ENV, configure_cuda_attention


@pytest.fixture
def restore_flag() -> Iterator[None]:
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.usefixtures("restore_flag")
def test_cudnn_attention_is_turned_off_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CUDNN_SDP_ENV, raising=False)
    torch.backends.cuda.enable_cudnn_sdp(True)
    configure_cuda_attention()
    assert not torch.backends.cuda.cudnn_sdp_enabled()


@pytest.mark.usefixtures("restore_flag")
@pytest.mark.parametrize(("value", "kept"), [("1", True), ("true", True), ("yes", True), ("0", False), ("off", False),
                                             ("", False)])
def test_the_environment_switches_cudnn_attention(monkeypatch: pytest.MonkeyPatch, value: str, kept: bool) -> None:
    monkeypatch.setenv(CUDNN_SDP_ENV, value)
    torch.backends.cuda.enable_cudnn_sdp(True)
    configure_cuda_attention()
    assert torch.backends.cuda.cudnn_sdp_enabled() is kept


@pytest.mark.usefixtures("restore_flag")
def test_a_typo_is_a_usage_error_not_a_silent_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipespec.errors import UsageError

    monkeypatch.setenv(CUDNN_SDP_ENV, "ture")
    with pytest.raises(UsageError, match=f"{CUDNN_SDP_ENV}='ture': use 1"):
        configure_cuda_attention()
