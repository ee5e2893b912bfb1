"""The observers of a layer's forwards (``hybrid/observers.py``) on real vLLM MoE layers: the
routing recorder and the metrics hear the forwards, with nothing inline for either."""

from __future__ import annotations

import torch
from kt_testing.hybrid_layers import E, forward, hybrid_layer


def test_the_recorder_hears_forwards_only_while_enabled(vllm_layer_context, fresh_process_state) -> None:
    layer, _ = hybrid_layer(KT_NUM_GPU_EXPERTS="3")
    recorder = fresh_process_state.recorder
    forward(layer, 4)
    assert recorder.counts == {}
    recorder.enabled = True
    _, _, ids, _ = forward(layer, 6, seed=1)
    idx = layer.quant_method.layer_idx
    assert recorder.counts[idx].tolist() == torch.bincount(ids.flatten().long(), minlength=E).tolist()
    assert recorder.cpu_evaluations[idx] == int((ids >= 3).sum())  # experts 3..7 are on the CPU


def test_metrics_time_the_cpu_path_of_layers_with_cpu_experts(vllm_layer_context, fresh_process_state) -> None:
    """KT_METRICS_INTERVAL: one process collector, fed by the layer's CPU-path forwards."""
    layer, _ = hybrid_layer(KT_NUM_GPU_EXPERTS="3", KT_METRICS_INTERVAL="3600")
    metrics = fresh_process_state.metrics(3600.0)
    assert metrics is not None and metrics.layers == [layer.quant_method.layer_idx]
    for _ in range(2):
        forward(layer, 4)
    totals = metrics.totals()
    assert [(k, t.forwards) for k, t in totals.items()] == [((layer.quant_method.layer_idx, 4), 2)]
    all_gpu, _ = hybrid_layer(KT_NUM_GPU_EXPERTS=str(E), KT_METRICS_INTERVAL="3600")
    assert all_gpu.quant_method.layer_idx not in metrics.layers  # no CPU experts: nothing to time
