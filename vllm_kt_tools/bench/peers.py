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
  ``_layer_<i>/_numa_<n>/*.kt``, the same as kt-hybrid's cache folder) and dummy GPU weights,
  at named points (``sglang_points``: KTransformers' documented one, then kt-hybrid's own
  settings); its log must show kt-kernel's MoE wrapper at work (``check_sglang_run``).

Only the command lines and engine arguments are built and unit-tested here: none of these
peers can run on a CPU-only machine (UVA and prefetch offload need CUDA; sglang-kt needs a GPU
and its own package set, benchmarks/sglang-bundle.sh). Their figures come from a GPU sitting.
"""

from __future__ import annotations

import math
import os
import re
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

# kt-kernel methods whose wrapper (kt_kernel/utils/amx.py AMXMoEWrapper) has no
# submit_write_weight_scale_to_buffer: sglang-kt's layerwise GPU prefill
# (kt_ep_wrapper.SharedFullContext.load -> _prepare_weight_bf16/_fp8/_int4) calls it on the
# first forward of at least --kt-gpu-prefill-token-threshold tokens and fails there. Its docs
# say so too: the threshold is for the native methods (FP8, RAWINT4, BF16) only.
AMX_METHODS = ("AMXINT4", "AMXINT8")


@dataclass(frozen=True)
class SglangKt:
    """One sglang-kt server configuration (sglang-kt 0.7.2's ``server_args.py`` names the
    flags; docs/benchmarks.md says where each point's values come from)."""

    model: str
    weight_path: str  # the prepared AMX experts: kt-hybrid's cache folder for the same method
    method: str = "AMXINT4"
    cpuinfer: int = 14
    threadpool_count: int = 1  # kt-hybrid's (one per NUMA node: 1 on the lent hosts); names the folder too
    num_gpu_experts: int = 33
    max_deferred_experts_per_token: int = 0
    gpu_prefill_token_threshold: int = 0  # its layerwise GPU prefill; 0: off
    chunked_prefill_size: int | None = None  # None: sglang's default
    mem_fraction_static: float | None = None  # None: sglang's default
    enable_mixed_chunk: bool = False
    dynamic_expert_update: bool = False  # acts only inside the layerwise prefill
    # FA3 is sglang's own default on sm90 and ships compiled (sgl_kernel's flash_ops); flashinfer's
    # attention and sampling kernels compile with nvcc on first use, which the offline host may lack
    attention_backend: str = "fa3"
    sampling_backend: str = "pytorch"
    point: str = ""  # the sweep point's name
    port: int = 30000
    context_length: int = 16384 + 64
    max_running_requests: int = 64

    def __post_init__(self) -> None:
        if self.gpu_prefill_token_threshold > 0 and self.method in AMX_METHODS:
            raise ValueError(
                f"sglang-kt's --kt-gpu-prefill-token-threshold {self.gpu_prefill_token_threshold} with --kt-method "
                f"{self.method}: its layerwise prefill asks kt-kernel's wrapper to write the experts in GPU layout, "
                "which the AMX wrapper cannot (AMXMoEWrapper has no submit_write_weight_scale_to_buffer); the server "
                "would fail at its first prefill of that many tokens. Use 0 (off), or a native method (BF16, FP8)"
            )
        if self.dynamic_expert_update and self.gpu_prefill_token_threshold <= 0:
            raise ValueError(
                "sglang-kt's --kt-enable-dynamic-expert-update acts only inside its layerwise prefill "
                "(--kt-gpu-prefill-token-threshold > 0): with the threshold at 0 it would do nothing"
            )

    @property
    def name(self) -> str:
        """Tells the points of a sweep apart (logs, JSON)."""
        if self.point:
            return f"{SGLANG_PEER}-{self.point}"
        return f"{SGLANG_PEER}-t{self.gpu_prefill_token_threshold}-d{self.max_deferred_experts_per_token}"

    def command(self, python: str | None = None) -> list[str]:
        python = python or sglang_python()
        command = [
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
            "--attention-backend",
            self.attention_backend,
            "--sampling-backend",
            self.sampling_backend,
            # its default grammar backend, llguidance, cannot build from the bench model's WordPiece
            # tokenizer and kills the scheduler at start (2026-12-06); the bench asks for no grammar
            "--grammar-backend",
            "none",
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
        if self.chunked_prefill_size is not None:
            command += ["--chunked-prefill-size", str(self.chunked_prefill_size)]
        if self.mem_fraction_static is not None:
            command += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.enable_mixed_chunk:
            command.append("--enable-mixed-chunk")
        if self.dynamic_expert_update:
            command.append("--kt-enable-dynamic-expert-update")
        return command


def sglang_python() -> str:
    """sglang-kt's interpreter (its own package set: torch 2.9.1); a clear error where unset."""
    python = os.environ.get(SGLANG_PYTHON_VARIABLE)
    if not python:
        raise SystemExit(
            f"{SGLANG_PYTHON_VARIABLE} is unset: sglang-kt runs under its own Python (benchmarks/sglang-bundle.sh)"
        )
    return python


def documented_cpuinfer(logical_threads: int | None = None) -> int:
    """``kt run``'s --kt-cpuinfer: 0.8 x the host's logical threads (kt_kernel/cli/commands/run.py)."""
    return max(1, int((logical_threads or os.cpu_count() or 1) * 0.8))


VLLM_SERVE_CHUNK = 8192  # vllm serve's max_num_batched_tokens on an H100/H200 (vLLM 0.32's default)


def sglang_points(
    base: SglangKt, logical_threads: int | None = None, chunk: int = VLLM_SERVE_CHUNK
) -> dict[str, SglangKt]:
    """The named points of sglang-kt (``--sglang-sweep documented,mirror``), from ``base``
    (kt-hybrid's model, method, threads and GPU experts per layer):

    - ``documented``: KTransformers' Qwen3-30B-A3B point on an AMX CPU (kt-kernel's README,
      "Option B: AMX backend": --mem-fraction-static 0.92 --chunked-prefill-size 4096
      --enable-mixed-chunk --kt-max-deferred-experts-per-token 2) with ``kt run``'s thread count
      (0.8 x logical threads). Its --kt-gpu-prefill-token-threshold 4096 and
      --kt-enable-dynamic-expert-update are the native-BF16 option's and cannot run with AMX
      experts (``AMX_METHODS``): off;
    - ``mirror``: kt-hybrid's own settings: its thread count, no deferral, its server's chunk
      (``chunk``: the sitting's --max-num-batched-tokens, else ``vllm serve``'s 8,192 on an
      H100/H200) and vLLM's memory share (0.9).
    """
    from dataclasses import replace

    return {
        "documented": replace(
            base,
            point="documented",
            cpuinfer=documented_cpuinfer(logical_threads),
            max_deferred_experts_per_token=2,
            gpu_prefill_token_threshold=0,
            chunked_prefill_size=4096,
            mem_fraction_static=0.92,
            enable_mixed_chunk=True,
        ),
        "mirror": replace(
            base,
            point="mirror",
            max_deferred_experts_per_token=0,
            gpu_prefill_token_threshold=0,
            chunked_prefill_size=chunk,
            mem_fraction_static=0.9,
            enable_mixed_chunk=True,
        ),
    }


# The sitting's order: KTransformers' documented point first, then kt-hybrid's settings.
SGLANG_POINT_NAMES: tuple[str, ...] = ("documented", "mirror")
SGLANG_SWEEP_POINTS: tuple[str, ...] = SGLANG_POINT_NAMES


def sglang_sweep(
    base: SglangKt,
    points: tuple[str | tuple[int, int], ...] = SGLANG_SWEEP_POINTS,
    logical_threads: int | None = None,
    chunk: int = VLLM_SERVE_CHUNK,
) -> list[SglangKt]:
    """The points to run, in the order given (a sitting short of time lists the one it
    needs most first): names of ``sglang_points``, or (threshold, deferral) pairs on the
    documented point."""
    from dataclasses import replace

    named = sglang_points(base, logical_threads, chunk)
    configs = []
    for point in points:
        if isinstance(point, str):
            configs.append(named[point])
        else:
            threshold, deferred = point
            configs.append(
                replace(
                    named["documented"],
                    point=f"t{threshold}-d{deferred}",
                    gpu_prefill_token_threshold=threshold,
                    max_deferred_experts_per_token=deferred,
                )
            )
    return configs


KT_ACTIVE_LINE = "[KT] Created shared staging buffer"  # kt_ep_wrapper's create_weights, rank 0
SGLANG_WEIGHTS_RE = re.compile(r"Load weight end\..*?mem usage=([\d.]+) GB")


def sglang_log_facts(log_text: str) -> dict[str, Any]:
    """What sglang-kt's log says about a run: whether kt-kernel's MoE wrapper built its
    layers (without it sglang would serve every expert on the GPU and look fast) and the GPU
    weight memory it reports."""
    facts: dict[str, Any] = {"kt_wrapper_active": KT_ACTIVE_LINE in log_text}
    weights = SGLANG_WEIGHTS_RE.findall(log_text)
    if weights:
        facts["gpu_weight_gb"] = float(weights[0])
    return facts


def check_sglang_run(result: dict[str, Any], log_path: Path) -> dict[str, Any]:
    """A sglang-kt run's facts from its log (``peers.sglang_log_facts``); a server that served
    without kt-kernel's MoE wrapper (all experts on the GPU) is marked failed, whatever it measured."""
    try:
        facts = sglang_log_facts(log_path.read_text(errors="replace"))
    except OSError:
        return result
    result.update(facts)
    measured = any(result.get(key) for key in ("decode_bs1_tok_s", "output_throughput"))
    if measured and not facts["kt_wrapper_active"] and "error" not in result:
        result["error"] = f"served without kt-kernel's MoE wrapper: no {KT_ACTIVE_LINE!r} in {log_path.name}"
    return result


def prepared_amx_folder(cache_dir: str, model: str, method: str, shape: tuple[int, int, int], pools: int = 1) -> Path:
    """The folder ``vllm-kt bench --prepare-only`` fills for ``method`` on a dummy-weight shape
    with ``pools`` thread pools (the plugin's own cache layout, which kt-kernel's loader reads)."""
    from vllm_kt_plugin.cpu_backends.kt_kernel.weight_cache import cache_folder

    return cache_folder(cache_dir, model=model, model_dir=None, method=method, pools=pools, shape=shape)
