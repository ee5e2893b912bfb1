"""The peers kt-hybrid is measured against (issue 27), each sized for the same GPU weight
memory as kt-hybrid (``--gpu-weight-gb``, 17 GiB of the 30B-A3B shape):

- ``vllm-offload``: ``--cpu-offload-gb N``, N the weights beyond the budget (UVA, any weights);
- ``vllm-offload-experts``: the same N, but only expert weights (``--cpu-offload-params experts``,
  vLLM 0.32 ``config/offload.py``: name segments, so ``experts`` matches ``mlp.experts.w13_weight``);
- ``vllm-prefetch``: vLLM's prefetch offloader, experts only: of every ``group`` layers the last
  ``num_in_group`` keep their experts on the CPU, and ``prefetch_step`` layers ahead are copied
  into static GPU buffers (one slot per step: ``offloader/prefetch.py``'s StaticBufferPool).
  For each swept (group, step) the fewest offloaded layers that fit the budget are chosen;
- ``sglang-kt``: KTransformers' SGLang fork (sglang-kt 0.7.2), launched as its own server under
  its own Python (``SGLANG_PYTHON``: it pins torch 2.9.1, which cannot share vLLM 0.32's
  environment). It reads the AMX experts the bench prepared (kt-kernel's loader format,
  ``_layer_<i>/_numa_<n>/*.kt``, the same as kt-hybrid's cache folder) and dummy GPU weights.

Only the command lines and engine arguments are built and unit-tested here: none of these
peers can run on a CPU-only machine (UVA and prefetch offload need CUDA; sglang-kt needs a GPU
and its own package set, benchmarks/sglang-bundle.sh). Their figures come from a GPU sitting.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kt_plugin.settings.catalogue import GIB

VLLM_PEERS = ("vllm-offload", "vllm-offload-experts", "vllm-prefetch")
SGLANG_PEER = "sglang-kt"
# The parameter name segment vLLM's offloaders match for routed experts (FusedMoE's w13/w2).
EXPERTS_SEGMENT = "experts"
# (group size, prefetch step) points of the short sweep; each picks its own num_in_group.
# Resident layers come in multiples of layers/group: on the 48-layer shape at 17 GiB, group 8
# keeps 6 layers' experts on the GPU, 16 keeps 9, 48 keeps 11 (10 with a second prefetch slot).
DEFAULT_PREFETCH_SWEEP = ((8, 1), (16, 1), (48, 1), (48, 2))
SGLANG_PYTHON_VARIABLE = "SGLANG_PYTHON"


def offload_gb(total_bytes: int, gpu_weight_gb: float) -> float:
    """GiB of weights beyond the budget, rounded up (vLLM takes whole GiB here)."""
    return float(max(0, math.ceil(total_bytes / GIB - gpu_weight_gb)))


def uva_engine_args(total_bytes: int, experts_bytes: int, gpu_weight_gb: float, experts_only: bool) -> dict[str, Any]:
    """vLLM engine arguments of ``vllm-offload`` / ``vllm-offload-experts``."""
    gb = offload_gb(total_bytes, gpu_weight_gb)
    if experts_only and gb * GIB > experts_bytes:
        raise ValueError(f"{gb} GiB to offload exceed the {experts_bytes / GIB:.1f} GiB of experts")
    args: dict[str, Any] = {"cpu_offload_gb": gb}
    if experts_only:
        args["cpu_offload_params"] = [EXPERTS_SEGMENT]
    return args


def offloaded_layers(layers: int, group: int, num_in_group: int) -> int:
    """Layers whose experts the prefetch offloader keeps on the CPU: the last
    ``num_in_group`` of every ``group`` (layer i when i % group >= group - num_in_group)."""
    return sum(1 for i in range(layers) if i % group >= group - num_in_group)


@dataclass(frozen=True)
class PrefetchPoint:
    group: int
    num_in_group: int
    prefetch_step: int
    gpu_weight_bytes: int

    @property
    def name(self) -> str:
        return f"g{self.group}-n{self.num_in_group}-p{self.prefetch_step}"

    def engine_args(self) -> dict[str, Any]:
        return {
            "offload_group_size": self.group,
            "offload_num_in_group": self.num_in_group,
            "offload_prefetch_step": self.prefetch_step,
            "offload_params": [EXPERTS_SEGMENT],
        }


def prefetch_point(
    layers: int, layer_experts_bytes: int, non_expert_bytes: int, gpu_weight_gb: float, group: int, step: int
) -> PrefetchPoint | None:
    """The fewest offloaded layers per ``group`` whose GPU weights (non-expert weights, the
    resident layers' experts and ``step`` prefetch slots of one layer's experts) fit in
    ``gpu_weight_gb``; None where even offloading every layer of each group does not."""
    for num_in_group in range(1, group + 1):
        resident = layers - offloaded_layers(layers, group, num_in_group)
        gpu = non_expert_bytes + (resident + step) * layer_experts_bytes
        if gpu <= gpu_weight_gb * GIB:
            return PrefetchPoint(group, num_in_group, step, gpu)
    return None


def prefetch_sweep(
    layers: int,
    layer_experts_bytes: int,
    non_expert_bytes: int,
    gpu_weight_gb: float,
    points: tuple[tuple[int, int], ...] = DEFAULT_PREFETCH_SWEEP,
) -> list[PrefetchPoint]:
    """The sweep's points that fit the budget (vLLM requires step >= 1 and num_in_group <= group)."""
    found = (prefetch_point(layers, layer_experts_bytes, non_expert_bytes, gpu_weight_gb, g, s) for g, s in points)
    return [p for p in found if p is not None]


def best_prefetch(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The sweep's chosen point: the highest batch-16 decode (the load's regime), batch 1 to break ties."""
    measured = [r for r in runs if r.get("decode_bs16_tok_s") is not None]
    if not measured:
        return None
    return max(measured, key=lambda r: (r["decode_bs16_tok_s"], r.get("decode_bs1_tok_s") or 0.0))


def engine_cli_flags(engine_args: dict[str, Any]) -> list[str]:
    """``vllm serve`` flags for engine arguments (lists become vLLM's nargs='+')."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        flags += [flag, *map(str, value)] if isinstance(value, list) else [flag, str(value)]
    return flags


def engine_kwargs(engine_args: dict[str, Any]) -> dict[str, Any]:
    """``vllm.LLM`` keyword arguments for engine arguments (lists, which travel as JSON, are sets there)."""
    return {key: set(value) if isinstance(value, list) else value for key, value in engine_args.items()}


# --- sglang-kt ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SglangKt:
    """One sglang-kt server configuration (sglang-kt 0.7.2's ``server_args.py`` names the flags)."""

    model: str
    weight_path: str  # the prepared AMX experts: kt-hybrid's cache folder for the same method
    method: str = "AMXINT4"
    cpuinfer: int = 14
    threadpool_count: int = 1  # kt-hybrid's (one per NUMA node: 1 on the H200 host); names the folder too
    num_gpu_experts: int = 33
    max_deferred_experts_per_token: int = 0
    gpu_prefill_token_threshold: int = 4096
    port: int = 30000
    context_length: int = 16384 + 64
    max_running_requests: int = 64

    @property
    def name(self) -> str:
        """Tells the points of a sweep apart (logs, JSON)."""
        return f"{SGLANG_PEER}-t{self.gpu_prefill_token_threshold}-d{self.max_deferred_experts_per_token}"

    def command(self, python: str | None = None) -> list[str]:
        python = python or sglang_python()
        return [
            python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model,
            "--load-format",
            "dummy",
            "--served-model-name",
            "bench",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--context-length",
            str(self.context_length),
            "--max-running-requests",
            str(self.max_running_requests),
            "--disable-radix-cache",
            "--random-seed",
            "0",
            "--kt-weight-path",
            self.weight_path,
            "--kt-method",
            self.method,
            "--kt-cpuinfer",
            str(self.cpuinfer),
            "--kt-threadpool-count",
            str(self.threadpool_count),  # as the prepared folder <METHOD>-pools<N> was written
            "--kt-num-gpu-experts",
            str(self.num_gpu_experts),
            "--kt-max-deferred-experts-per-token",
            str(self.max_deferred_experts_per_token),
            "--kt-gpu-prefill-token-threshold",
            str(self.gpu_prefill_token_threshold),
        ]


def sglang_python() -> str:
    """sglang-kt's interpreter (its own package set: torch 2.9.1); a clear error where unset."""
    python = os.environ.get(SGLANG_PYTHON_VARIABLE)
    if not python:
        raise SystemExit(
            f"{SGLANG_PYTHON_VARIABLE} is unset: sglang-kt runs under its own Python (benchmarks/sglang-bundle.sh)"
        )
    return python


# (GPU-prefill token threshold, deferred experts per token): the short sweep's default points
SGLANG_SWEEP_POINTS = ((1024, 0), (1024, 2), (4096, 0), (4096, 2))


def sglang_sweep(base: SglangKt, points: tuple[tuple[int, int], ...] = SGLANG_SWEEP_POINTS) -> list[SglangKt]:
    """The short sweep of its GPU-prefill threshold and deferral (issue 27: each peer at its
    best), in the order given (a sitting short of time lists the point it needs most first)."""
    from dataclasses import replace

    return [replace(base, gpu_prefill_token_threshold=t, max_deferred_experts_per_token=d) for t, d in points]


def prepared_amx_folder(cache_dir: str, model: str, method: str, shape: tuple[int, int, int], pools: int = 1) -> Path:
    """The folder ``vllm-kt bench --prepare-only`` fills for ``method`` on a dummy-weight shape
    with ``pools`` thread pools (the plugin's own cache layout, which kt-kernel's loader reads)."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import cache_folder

    return cache_folder(cache_dir, model=model, model_dir=None, method=method, pools=pools, shape=shape)
