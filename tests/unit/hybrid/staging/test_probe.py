"""The split's start-up probe (``hybrid/staging/probe.py``) on a real vLLM MoE layer."""

from __future__ import annotations

import pytest
import torch
from kt_testing.hybrid_layers import E, kt_config

from vllm_kt_plugin.hybrid.staging.build import staging_path
from vllm_kt_plugin.hybrid.staging.costs import plan
from vllm_kt_plugin.hybrid.staging.probe import probe
from vllm_kt_plugin.hybrid.staging.split import SplitPath
from vllm_kt_tools.support.moe_layers import (
    build_moe,
    load,
    random_experts,
)


class _StageClock:
    """A clock for the probe that advances only by the costs of a known model: each CPU
    submit, each staged-expert forward and the routing read-back charge fixed + per expert
    routed + per pick, each expert row copied into a staging buffer (its public counter)
    charges COPY. The real layer still computes; its own time is not counted."""

    COPY = 7e-5  # seconds per expert row copied in
    CPU = (2e-4, 3e-5, 5e-7)  # fixed, per expert, per pick
    GPU = (4e-4, 1e-5, 1e-7)
    OVERHEAD = 6e-5

    def __init__(self, staging: object) -> None:
        self.staging = staging
        self.now = 1000.0
        self.seen = staging.rows_copied  # type: ignore[attr-defined]

    def charge(self, costs: tuple[float, float, float], ids: torch.Tensor) -> None:
        fixed, per_expert, per_pick = costs
        self.now += fixed + per_expert * int(ids.unique().numel()) + per_pick * ids.numel()

    def perf_counter(self) -> float:
        copied = self.staging.rows_copied  # type: ignore[attr-defined]
        self.now += self.COPY * max(copied - self.seen, 0)
        self.seen = copied
        return self.now


def test_split_probe_measures_what_it_times(vllm_layer_context, fresh_process_state, monkeypatch) -> None:
    """The start-up probe on a real layer (here the CPU build's: CPU backend = torch, "GPU" =
    vLLM's CPU kernel). Timed for real it yields finite, non-negative costs the model can
    plan with, and leaves the staging counters as they were (it is no forward). Timed by a
    ``_StageClock`` — the same layer's stages costing what a known model says — it returns
    that model: the copy per expert row really copied, the CPU backend's and the staged
    experts' fixed, per-expert and per-pick costs apart, the routing read-back. A probe that
    copies nothing, mixes the sides up or miscounts experts or picks gets other numbers."""
    import time

    runner = build_moe(kt_config(kt_backend="torch", kt_num_gpu_experts="2", kt_staging_min_tokens="4"))
    load(runner, random_experts(E, seed=43))
    method = runner.routed_experts.quant_method
    prefill = staging_path(method.paths)  # the whole-layer stream (a number, no share): its copy and buffers
    assert prefill is not None and not isinstance(prefill, SplitPath)
    host, staging = prefill.host, prefill.buffers

    path = SplitPath(prefill.staging, method.cpu)  # the cost model (no share), sharing its sibling's staging
    assert path.share is None
    counters = staging.rows_copied, staging.uses
    probed = probe(path, torch.bfloat16)
    costs = probed.for_host(host)
    assert costs.copy_s_per_expert > 0 and costs.cpu_s_per_pick >= 0 and costs.overhead_s > 0
    assert probed.expert_nbytes == host.expert_nbytes == host.staged_nbytes // (E - 2)
    assert plan(costs, [3] * (E - 2)).picked == E - 2
    assert (staging.rows_copied, staging.uses) == counters  # the probe is not a forward

    clock = _StageClock(staging)
    cpu, apply, counts = method.cpu.submit, host.apply, path.counts

    def submit(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> None:
        clock.charge(clock.CPU, ids)
        cpu(x, ids, weights)

    def staged(views: dict, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *rest: object) -> torch.Tensor:
        clock.charge(clock.GPU, ids)
        return apply(views, x, weights, ids, *rest)

    def read_back(ids: torch.Tensor) -> list[int]:
        clock.now += clock.OVERHEAD
        return counts(ids)

    monkeypatch.setattr(method.cpu, "submit", submit)
    monkeypatch.setattr(host, "apply", staged)
    monkeypatch.setattr(path, "counts", read_back)
    monkeypatch.setattr(time, "perf_counter", clock.perf_counter)
    costs = probe(path, torch.bfloat16).for_host(host)

    measured = (costs.cpu_s_fixed, costs.cpu_s_per_expert, costs.cpu_s_per_pick)
    assert measured == pytest.approx(clock.CPU, rel=1e-6)
    measured = (costs.gpu_s_fixed, costs.gpu_s_per_expert, costs.gpu_s_per_pick)
    assert measured == pytest.approx(clock.GPU, rel=1e-6)
    assert costs.copy_s_per_expert == pytest.approx(clock.COPY, rel=1e-6)
    assert costs.overhead_s == pytest.approx(clock.OVERHEAD, rel=1e-6)
    assert costs.write_s_per_expert == 0  # the torch backend keeps a host copy: nothing written
