"""Which experts KT_DYNAMIC_GPU_EXPERTS swaps and what it counts (pure logic; the swaps run end to
end in tests/engine: test_engine_e2e.py and test_routing_profiler.py)."""

from __future__ import annotations

import torch

from vllm_kt_plugin.hybrid.dynamic_experts import swaps


def mask(*gpu: int, n: int = 6) -> torch.Tensor:
    m = torch.zeros(n, dtype=torch.bool)
    m[list(gpu)] = True
    return m


def test_hottest_cpu_experts_replace_the_coldest_gpu_experts() -> None:
    counts = torch.tensor([1.0, 9.0, 0.0, 7.0, 3.0, 2.0])
    assert swaps(counts, mask(0, 2)) == [(1, 2), (3, 0)]


def test_only_while_the_cpu_expert_was_picked_more() -> None:
    counts = torch.tensor([5.0, 9.0, 4.0, 5.0, 0.0, 0.0])
    assert swaps(counts, mask(0, 2)) == [(1, 2)]  # 5 (expert 3) vs 5 (expert 0): a tie stays put


def test_nothing_moves_when_the_gpu_already_holds_the_hottest() -> None:
    counts = torch.tensor([9.0, 8.0, 1.0, 0.0, 0.0, 0.0])
    assert swaps(counts, mask(0, 1)) == []
    assert swaps(counts, mask()) == [] and swaps(counts, mask(0, 1, 2, 3, 4, 5)) == []


def test_padded_tokens_count_for_nothing() -> None:
    """vLLM marks padded tokens' picks -1 (every CUDA-graph batch is padded): the device
    counts and the routing recorder skip them instead of failing on the index."""
    from types import SimpleNamespace

    from vllm_kt_plugin.hybrid.dynamic_experts import DynamicExperts
    from vllm_kt_plugin.hybrid.routing_recorder import RoutingRecorder

    ids = torch.tensor([[1, 3], [3, 5], [-1, -1]], dtype=torch.int32)
    layer = SimpleNamespace(counts=torch.zeros(6))
    DynamicExperts.observe(layer, ids)  # type: ignore[arg-type]
    assert layer.counts.tolist() == [0, 1, 0, 2, 0, 1]
    recorder = RoutingRecorder()
    recorder.record(0, ids, mask(0, 1))
    assert recorder.counts[0].tolist() == [0, 1, 0, 2, 0, 1] and recorder.cpu_evaluations[0] == 3


def test_swap_log_reports_the_mean_cost_at_powers_of_ten(caplog) -> None:
    """One line per layer swap: at INFO the 1st, 10th and 100th, the rest at DEBUG, with the
    running mean cost per layer swap (the figure the H200 benchmark reads)."""
    import logging

    from vllm_kt_plugin.hybrid.swap_log import SwapLog
    from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

    log = SwapLog()
    with caplog.at_level(logging.DEBUG, logger=LOGGER_NAME):
        for i in range(100):
            log.add(f"model.layers.{i % 4}.mlp.experts", [(5, 1), (6, 2)] if i == 0 else [(7, 3)], 0.002 * (i + 1))
    info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(info) == 3 and len(caplog.records) == 100
    first = "experts [5, 6] moved to the GPU, [1, 2] to the CPU in 2.0 ms; 1 layer swaps so far moved 2 experts, 2.0 ms"
    assert first in info[0]
    assert info[1].endswith("10 layer swaps so far moved 11 experts, 11.0 ms per layer swap on average")
    assert info[2].endswith("100 layer swaps so far moved 101 experts, 101.0 ms per layer swap on average")
