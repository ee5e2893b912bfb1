"""The decode timeline (hybrid/decode_timeline.py) on real vLLM MoE layers: a delay injected on
purpose into one stage of a decode step lands in that stage's column and no other."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kt_testing.hardware import requires_kernel
from safetensors.torch import save_file

from vllm_kt_plugin.hybrid.decode_timeline import DecodeTimeline, step_rows
from vllm_kt_plugin.hybrid.quant_config import KTHybridConfig
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_tools.support.moe_layers import HIDDEN, build_moe, fresh_layer_index, load, random_experts

E, K = 8, 2
# Far above a tiny layer's stages on the host clock: each takes a few ms, tens on 2 cores that
# four other test processes share.
DELAY_S = 0.2


def test_step_rows_reads_each_interval_from_its_points() -> None:
    ms = 1_000_000
    step = [[0 + ms, 2 * ms, 5 * ms, 9 * ms], [12 * ms, 13 * ms, 14 * ms, 20 * ms]]
    nxt = [[30 * ms, 31 * ms, 32 * ms, 33 * ms], [34 * ms, 35 * ms, 36 * ms, 37 * ms]]
    first, last = step_rows([(1, step), (1, nxt)], [3, 7])
    assert first["step_ms"] == 29.0 and first["span_ms"] == 19.0 and last["step_ms"] is None
    layer3, layer7 = first["layers"]
    assert layer3 == {"layer": 3, "submit_ms": 1.0, "gpu_ms": 3.0, "wait_ms": 4.0, "cpu_ms": 7.0, "rest_ms": 3.0}
    assert layer7["rest_ms"] is None and layer7["cpu_ms"] == 7.0
    broken = [[0, 2 * ms, 5 * ms, 9 * ms], step[1]]  # a layer's point never written
    assert step_rows([(1, broken), (1, nxt)], [3, 7]) == step_rows([(1, nxt)], [3, 7])


def delayed(fn: Callable[..., Any], seconds: float) -> Callable[..., Any]:
    @functools.wraps(fn)
    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return fn(*args, **kwargs)

    return slow


COLUMNS = ("submit_ms", "gpu_ms", "wait_ms", "rest_ms")


@requires_kernel("BF16")
@pytest.mark.parametrize("stage", ["none", "submit", "gpu", "cpu", "between", "outside"])
def test_an_injected_delay_lands_in_its_column(
    vllm_layer_context, fresh_process_state, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stage: str
) -> None:
    """Two consecutive layers with real kt-kernel BF16 experts (its submit hands the work to its
    threads, its sync waits for them, as on a GPU), four decode steps of one token, a delay in
    one stage of the first layer: the submit, the GPU experts, the CPU experts, between the
    layers (the rest of the model), after the last layer (outside the MoE layers)."""
    fresh_process_state.decode_timeline = DecodeTimeline(armed=True)
    first_idx = fresh_layer_index()
    layers = {first_idx: random_experts(E, seed=1), fresh_layer_index(): random_experts(E, seed=2)}
    tensors = {
        f"model.layers.{idx}.mlp.experts.{e}.{n}.weight": t.contiguous()
        for idx, experts in layers.items()
        for e, ws in experts.items()
        for n, t in ws.items()
    }
    save_file(tensors, tmp_path / "model.safetensors")
    env = {"KT_WEIGHT_PATH": str(tmp_path), "KT_NUM_GPU_EXPERTS": "4", "KT_CPUINFER": "1", "KT_METHOD": "BF16"}
    config = KTHybridConfig(settings=load_settings(env, cores=4))
    runners = [build_moe(config, num_experts=E, top_k=K, layer_idx=idx) for idx in layers]
    for runner, experts in zip(runners, layers.values(), strict=True):
        load(runner, experts)
    first = runners[0].routed_experts.quant_method
    if stage == "submit":
        monkeypatch.setattr(first.cpu, "submit", delayed(first.cpu.submit, DELAY_S))
    elif stage == "gpu":
        monkeypatch.setattr(first.gpu, "apply", delayed(first.gpu.apply, DELAY_S))
    elif stage == "cpu":
        monkeypatch.setattr(first.cpu, "sync", delayed(first.cpu.sync, DELAY_S))
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids = torch.tensor([[1, 6]], dtype=torch.int32)  # one GPU expert (0-3), one CPU expert (4-7)
    weights = torch.tensor([[0.5, 0.5]])
    for _ in range(4):
        for runner in runners:
            layer = runner.routed_experts
            layer.quant_method.apply(layer, x, weights, ids, None, None)
            if stage == "between" and runner is runners[0]:
                time.sleep(DELAY_S)
        if stage == "outside":
            time.sleep(DELAY_S)
    steps = [s for s in fresh_process_state.decode_timeline.collect() if s["step_ms"] is not None]
    assert len(steps) == 3 and all(s["tokens"] == 1 for s in steps)
    layer = {c: min(s["layers"][0][c] for s in steps) for c in COLUMNS}  # the least disturbed step
    outside = min(s["step_ms"] - s["span_ms"] for s in steps)
    print(stage, layer, f"outside {outside:.3f}")
    expected = {"submit": "submit_ms", "gpu": "gpu_ms", "cpu": "wait_ms", "between": "rest_ms"}.get(stage)
    for column in COLUMNS:
        if column == expected:
            assert layer[column] >= DELAY_S * 1e3, (column, layer)
        else:
            assert layer[column] < DELAY_S * 1e3 / 2, (column, layer)
    if stage == "cpu":
        assert min(s["layers"][0]["cpu_ms"] for s in steps) >= DELAY_S * 1e3
    assert (outside >= DELAY_S * 1e3) == (stage == "outside"), outside


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_device_ring_records_every_replay_of_a_captured_graph() -> None:
    """The stamps are kernels a CUDA graph captures: each replay writes its own step, in order,
    with its batch size, and a read returns the steps since the last one."""
    from vllm_kt_plugin.hybrid.decode_timeline import POINTS
    from vllm_kt_plugin.hybrid.device_clock import DeviceRing

    ring = DeviceRing(torch.device("cuda"), [5, 9], len(POINTS), ring_steps=4)
    x = torch.randn(256, 256, device="cuda")

    def step() -> None:
        for layer in (5, 9):
            for point in range(len(POINTS)):
                ring.stamp(layer, point, 16)
                x.copy_(x @ x.T / 256)  # some GPU work between the points

    step()  # compiles the kernels outside the capture
    assert len(ring.read()) == 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(6):
        graph.replay()
    steps = ring.read()
    assert len(steps) == 4  # the last ring_steps of the 6 replays
    rows = step_rows(steps, [5, 9])
    assert len(rows) == 4 and all(r["tokens"] == 16 for r in rows)
    assert all(r["step_ms"] is not None and r["step_ms"] > 0 for r in rows[:-1])
    assert ring.read() == []
