"""kt-kernel 0.7.2 workarounds (cpu_backends/kt_kernel/compat.py) on the real kt-kernel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

kt_kernel = pytest.importorskip("kt_kernel")


def _select() -> tuple:
    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel

    prepare_kt_kernel()
    import kt_kernel.experts_base as experts_base

    patched = experts_base.BaseMoEWrapper.select_deferred_experts
    return patched, patched.__wrapped__


IDS = torch.tensor([[3, 5, 1], [0, 7, 3], [2, 6, 4]])
SCORES = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.6, 0.3], [0.4, 0.4, 0.2]])
LAYER = SimpleNamespace(num_experts=8, layer_idx=1, gpu_experts_mask=torch.zeros(8, dtype=torch.bool))


def test_deferral_selection_skips_padded_picks() -> None:
    """vLLM marks padded tokens' picks -1 (it pads every CUDA-graph batch): kt-kernel's own
    selection scatters with them and fails (a device-side assert on the GPU); ours leaves
    them -1 on both sides and every real pick on exactly one side."""
    patched, original = _select()
    padded_ids = torch.cat([IDS, torch.full((2, 3), -1)])
    padded_scores = torch.cat([SCORES, torch.zeros(2, 3)])
    with pytest.raises((RuntimeError, IndexError)):
        original(LAYER, padded_ids, padded_scores, 2)
    immediate, deferred = patched(LAYER, padded_ids, padded_scores, 2)
    assert (immediate[3:] == -1).all() and (deferred[3:] == -1).all()
    real = torch.where(immediate[:3] >= 0, immediate[:3], deferred[:3])
    assert torch.equal(real, IDS)
    assert ((immediate[:3] >= 0) != (deferred[:3] >= 0)).all()
    assert (deferred[:3] >= 0).any()  # something is deferred at all


def test_deferral_selection_unchanged_without_padding() -> None:
    patched, original = _select()
    for protected in (0, 1, 2, 3):
        for got, want in zip(
            patched(LAYER, IDS, SCORES, protected), original(LAYER, IDS, SCORES, protected), strict=True
        ):
            assert torch.equal(got, want)


def test_deferral_logs_once_when_a_cpu_expert_was_deferred(caplog: pytest.LogCaptureFixture) -> None:
    """The line the end-to-end tests read to know deferral ran: only a deferred pick of a
    CPU expert counts (kt-kernel skips GPU experts' picks, deferred or not), and only once."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.compat import DeferralLog

    log = DeferralLog()
    mask = torch.zeros(8, dtype=torch.bool)
    mask[[1, 5]] = True  # experts 1 and 5 on the GPU
    layer = SimpleNamespace(layer_idx=2, gpu_experts_mask=mask)
    immediate = torch.tensor([[3, -1], [0, -1]])
    with caplog.at_level("INFO"):
        log.saw(layer, immediate, torch.tensor([[-1, 5], [-1, 1]]))  # only GPU experts deferred
        assert not caplog.records
        log.saw(layer, immediate, torch.tensor([[-1, 5], [-1, 7]]))
        log.saw(layer, immediate, torch.tensor([[-1, 6], [-1, 7]]))
    (record,) = caplog.records
    assert "expert deferral ran: layer 2 deferred 1 of 3 CPU-expert picks" in record.getMessage()
