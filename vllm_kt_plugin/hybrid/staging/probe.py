"""The split's start-up probe: the cost model's constants (``costs.SplitCosts``) measured
on this host as it runs now.

On the first forward that takes the split (every layer has reserved its buffers by then)
it times a whole layer's host-to-GPU copy, the CPU backend and the staged experts at a few
(experts, tokens) points, and the routing read-back: well under a second. Measured rather
than stored, because kt-kernel's speed depends on threads, load and memory channels, and
a weight cache can move between hosts. Other layers scale it by their expert bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
from vllm.logger import init_logger

from vllm_kt_plugin.hybrid.staging.costs import SPLIT_OVER_MODEL, SplitCosts, fit_costs
from vllm_kt_plugin.settings.catalogue import LOGGER_NAME

if TYPE_CHECKING:
    from vllm_kt_plugin.cpu_backends.base import CPUExperts
    from vllm_kt_plugin.hybrid.staging.buffers import StagingBuffers
    from vllm_kt_plugin.hybrid.staging.host_experts import HostExperts

logger = init_logger(LOGGER_NAME)


@dataclass
class ProbedCosts:
    """The probe's measurement, per byte of an expert, so that layers of another shape scale."""

    costs: SplitCosts
    expert_nbytes: int

    def for_host(self, host: HostExperts) -> SplitCosts:
        scale = host.expert_nbytes / self.expert_nbytes
        c = self.costs
        return SplitCosts(
            copy_s_per_expert=c.copy_s_per_expert * scale,
            cpu_s_per_expert=c.cpu_s_per_expert * scale,
            cpu_s_per_pick=c.cpu_s_per_pick * scale,
            gpu_s_per_expert=c.gpu_s_per_expert * scale,
            gpu_s_per_pick=c.gpu_s_per_pick * scale,
            cpu_s_fixed=c.cpu_s_fixed,
            gpu_s_fixed=c.gpu_s_fixed,
            overhead_s=c.overhead_s,
            write_s_per_expert=c.write_s_per_expert * scale if not host.copies else 0.0,
            split_over_model=SPLIT_OVER_MODEL["block-fp8" if host.binds_scales else "bf16"],
        )


class ProbeTarget(Protocol):
    """What the probe times of a layer's split path (``split.SplitPath``): its host copy and
    buffers, its CPU backend, and its routing read-back (``counts``)."""

    @property
    def host(self) -> HostExperts | None: ...

    @property
    def buffers(self) -> StagingBuffers | None: ...

    cpu: CPUExperts
    cpu_expert_ids: torch.Tensor  # the layer's CPU experts' ids, by CPU slot
    hidden_size: int
    layer_name: str

    def counts(self, topk_ids: torch.Tensor) -> list[int]: ...


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The fastest of ``repeats`` runs after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        _synchronize(device)
        start = time.perf_counter()
        fn()
        _synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def probe_points(num_cpu_experts: int, top_k: int, limit: int) -> list[tuple[int, int]]:
    """(experts, tokens) the probe times, within ``limit`` (kt-kernel's buffer): every CPU
    expert with about one pick each, and at 1,024 and 4,096 tokens (the split's range,
    where kt-kernel's cost per pick is not what it is in small batches); a quarter of them
    with the first count's picks. Enough to tell a forward's fixed cost, an expert's and a
    pick's apart."""
    small = min(max(-(-num_cpu_experts // top_k), 1), limit)
    sizes = sorted({small, min(max(PROBE_TOKENS[0], small), limit), min(max(PROBE_TOKENS[1], small), limit)})
    return [(num_cpu_experts, n) for n in sizes] + [(max(num_cpu_experts // 4, 1), small)]


PROBE_TOKENS = (1024, 4096)


def _fit(points: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """``fit_costs``, or where the points cannot tell an expert's cost apart (a layer of
    fewer than four CPU experts) a line through the smallest and largest, no per-expert cost."""
    try:
        return fit_costs(points)
    except ValueError:
        (_, p1, t1), (_, p2, t2) = points[0], points[-2]
        slope = max((t2 - t1) / (p2 - p1), 0.0) if p2 != p1 else 0.0
        return max(t1 - slope * p1, 0.0), 0.0, slope


def probe(path: ProbeTarget, dtype: torch.dtype) -> ProbedCosts:
    """Measure the cost model's constants on ``path``'s layer with activations of ``dtype``
    (see the module docstring). It runs in the first forward above the CUDA-graph sizes,
    which is vLLM's profiling run (``max_num_batched_tokens`` dummy tokens): what its own
    CPU-backend calls leave behind (kt-kernel's deferral hands results to the next layer)
    reaches no real output."""
    host, staging, cpu = path.host, path.buffers, path.cpu
    assert host is not None and staging is not None
    device = host.cpu_slot_of.device
    top_k = cpu.spec.top_k
    m = host.num_experts
    points = probe_points(m, top_k, cpu.spec.chunked_prefill_size)

    def routing(tokens: int, experts: int = m) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        picks = torch.arange(tokens * top_k) % experts  # duplicates within a token only for timing
        ids = path.cpu_expert_ids[picks].view(tokens, top_k).to(device=device, dtype=torch.int32)
        x = (torch.randn(tokens, path.hidden_size) * 0.1).to(device=device, dtype=dtype)
        weights = torch.full((tokens, top_k), 1.0 / top_k, device=device, dtype=torch.float32)
        return x, ids, weights

    index = 1 - staging.last
    counters = staging.rows_copied, staging.uses  # the probe is no forward: restored after

    def copy_layer() -> None:
        staging.forget(index)  # copy every row again
        staging.copy_in(index, host)

    copy_s = _timed(copy_layer, device)
    write_s = 0.0
    if not host.copies:  # the write alone, to tell it from the copy
        write_s = _timed(lambda: staging.write_out(index, host, list(range(m))), device)
        copy_s = max(copy_s - write_s, 0.0)
    staging.forget(index)
    views = staging.wait(staging.start(host), host)

    cpu_points, gpu_points = [], []
    for experts, tokens in points:
        x, ids, weights = routing(tokens, experts)

        def on_cpu(x: torch.Tensor = x, ids: torch.Tensor = ids, weights: torch.Tensor = weights) -> None:
            cpu.submit(x, ids, weights)
            cpu.sync(x)

        def on_gpu(x: torch.Tensor = x, ids: torch.Tensor = ids, weights: torch.Tensor = weights) -> None:
            host.apply(views, x, weights, ids)

        cpu_points.append((experts, tokens * top_k, _timed(on_cpu, device)))
        gpu_points.append((experts, tokens * top_k, _timed(on_gpu, device)))
    staging.rows_copied, staging.uses = counters
    _, ids, _ = routing(points[-2][1])
    overhead_s = _timed(lambda: path.counts(ids), device)
    cpu_fixed, cpu_expert, cpu_pick = _fit(cpu_points)
    gpu_fixed, gpu_expert, gpu_pick = _fit(gpu_points)
    costs = SplitCosts(
        copy_s_per_expert=copy_s / m,
        cpu_s_per_expert=cpu_expert,
        cpu_s_per_pick=cpu_pick,
        gpu_s_per_expert=gpu_expert,
        gpu_s_per_pick=gpu_pick,
        cpu_s_fixed=cpu_fixed,
        gpu_s_fixed=gpu_fixed,
        overhead_s=overhead_s,
        write_s_per_expert=write_s / m,
    )
    logger.info(
        "kt-hybrid: split cost model probed on %s (%d CPU experts, %.2f MiB each; (experts, tokens) %s): %s",
        path.layer_name,
        m,
        host.expert_nbytes / 2**20,
        points,
        costs.describe(),
    )
    return ProbedCosts(costs, host.expert_nbytes)
