"""Which runs a ``vllm-kt bench`` sitting makes (``plan_runs``): one ``RunSpec`` per engine
configuration. Each system runs in a process of its own (``engine_child``), so each gets
the whole GPU: plain vLLM with every weight on the GPU, vLLM's offloaders leaving
``--gpu-weight-gb`` on the GPU (``peers``), and kt-hybrid keeping as many experts per layer
on the GPU as fit in the same memory, once per kt-kernel method."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_kt_plugin.settings.catalogue import GATHERING_SCHEDULER, GIB
from vllm_kt_tools.bench import routing
from vllm_kt_tools.bench.decode_timeline import ARMED_ENV
from vllm_kt_tools.bench.peers import offload_gb, prefetch_sweep, uva_engine_args
from vllm_kt_tools.bench.shapes import CHECKPOINTS, ModelSizes

# The long prompt of prefill_long_tok_s: where users wait (retrieval, agents, code).
LONG_PROMPT_TOKENS = 16384


@dataclass
class RunSpec:
    """One engine configuration to benchmark."""

    system: str  # vllm-gpu | vllm-offload | vllm-offload-experts | vllm-prefetch | kt-hybrid
    method: str  # bf16 for plain vLLM; the kt-kernel method for kt-hybrid
    model: str
    load_format: str
    gpu_weight_gb: float
    cpu_offload_gb: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    enforce_eager: bool = False
    decode_tokens: int = 64
    decode_repeats: int = 5  # pairs of decode runs per batch size: the figure is their median
    max_num_batched_tokens: int | None = None  # vLLM's (None: its default for the entry point and GPU)
    max_model_len: int = LONG_PROMPT_TOKENS + 64
    gpu_memory_utilization: float = 0.9
    variant: str = ""  # tells apart runs of one system and method (e.g. "prefill-off")
    # vLLM engine arguments of a peer (bench/peers.py), e.g. the prefetch offloader's
    engine_args: dict[str, Any] = field(default_factory=dict)
    temperature: float = routing.TEMPERATURE  # the workload's (bench/routing.py says why not greedy)

    @property
    def name(self) -> str:
        eager = "-eager" if self.enforce_eager else ""
        variant = f"-{self.variant}" if self.variant else ""
        return f"{self.system}-{self.method}{eager}{variant}".lower()


PREFILL_OFF = ("prefill-off", {"KT_STAGING_MIN_TOKENS": "0"})  # --prefill-off-check
GATHER = "gather"  # --gather-check: kt-hybrid's scheduler (--scheduler-cls), at a window or the default


def gather_runs(first: dict[str, Any], windows: tuple[float | None, ...]) -> list[RunSpec]:
    """The first kt-hybrid run again behind kt-hybrid's scheduler, once per window
    (KT_STAGING_GATHER_MS; None: the plugin's default), named ``gather`` or ``gather-30ms``."""
    runs = []
    for window in windows:
        env = dict(first["env"]) if window is None else {**first["env"], "KT_STAGING_GATHER_MS": f"{window:g}"}
        engine_args = {**first["engine_args"], "scheduler_cls": GATHERING_SCHEDULER}
        name = GATHER if window is None else f"{GATHER}-{window:g}ms"
        runs.append(RunSpec(**{**first, "env": env, "engine_args": engine_args, "variant": name}))
    return runs


def system_order(args: argparse.Namespace) -> list[str]:
    """--systems, as listed (the order the runs go in)."""
    return [system.strip() for system in args.systems.split(",")]


def peer_runs(
    args: argparse.Namespace, sizes: ModelSizes, plain: str, common: dict[str, Any], systems: set[str]
) -> list[RunSpec]:
    """vLLM's offloaders at the same GPU weight budget (bench/peers.py sizes them); the
    prefetch offloader once per point of its sweep (variant = the point's name)."""
    runs: list[RunSpec] = []
    budget = args.gpu_weight_gb
    if "vllm-offload" in systems:
        gb = offload_gb(sizes.total_bytes, budget)
        runs.append(RunSpec("vllm-offload", plain, gpu_weight_gb=budget, cpu_offload_gb=gb, **common))
    if "vllm-offload-experts" in systems:
        uva = uva_engine_args(sizes.total_bytes, sizes.experts_bytes, budget, experts_only=True)
        runs.append(RunSpec("vllm-offload-experts", plain, gpu_weight_gb=budget, engine_args=uva, **common))
    if "vllm-prefetch" in systems:
        layer_experts = sizes.num_experts * sizes.expert_bytes
        points = prefetch_sweep(sizes.layers, layer_experts, sizes.non_expert_bytes, budget, args.prefetch_sweep)
        if not points:
            raise SystemExit(f"--prefetch-sweep: no point fits {budget} GiB of GPU weights")
        for point in points:
            gb = round(point.gpu_weight_bytes / GIB, 2)
            prefetch = point.engine_args()
            runs.append(
                RunSpec("vllm-prefetch", plain, gpu_weight_gb=gb, engine_args=prefetch, variant=point.name, **common)
            )
    return runs


def plan_runs(
    args: argparse.Namespace, model: str, load_format: str, sizes: ModelSizes, expert_files: str | None = None
) -> list[RunSpec]:
    """The sitting's runs. A quantized ``--checkpoint`` runs kt-hybrid with the kt-kernel
    method that reads it, from ``expert_files`` (its routed experts written on this host)."""
    total_gb = sizes.total_bytes / GIB
    n_gpu = sizes.gpu_experts_for(args.gpu_weight_gb * GIB)
    common = {
        "model": model,
        "load_format": load_format,
        "decode_tokens": args.decode_tokens,
        "decode_repeats": args.decode_repeats,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
    }
    plain, own_method = CHECKPOINTS[args.checkpoint]
    runs: list[RunSpec] = []
    order = system_order(args)
    systems = set(order)
    if "vllm-gpu" in systems:
        runs.append(RunSpec("vllm-gpu", plain, gpu_weight_gb=round(total_gb, 1), **common))
    runs += peer_runs(args, sizes, plain, common, systems)
    if "kt-hybrid" in systems:
        methods = [m.strip().upper() for m in args.methods.split(",") if m.strip()]
        if own_method is not None:
            methods = [own_method]
        elif load_format != "dummy" and "BF16" not in methods:
            methods.append("BF16")
        weight_path = {"KT_WEIGHT_PATH": expert_files} if own_method is not None and expert_files else {}
        for method in methods:
            env = {"KT_METHOD": method, "KT_NUM_GPU_EXPERTS": str(n_gpu), **weight_path, **dict(args.kt_env)}
            if getattr(args, "decode_timeline", False):  # armed at start: its stamps go into the CUDA graphs
                env.update(ARMED_ENV)
            if args.cpuinfer:
                env["KT_CPUINFER"] = str(args.cpuinfer)
            gb = round(sizes.gpu_weight_bytes(n_gpu) / GIB, 2)
            runs.append(RunSpec("kt-hybrid", method, gpu_weight_gb=gb, env=env, **common))
        first = asdict(runs[-len(methods)]) if methods else None
        if args.eager_check and first:
            runs.append(RunSpec(**{**first, "enforce_eager": True}))
        variants = list(args.variant)
        if args.prefill_off_check:
            variants.insert(0, PREFILL_OFF)
        for name, settings in variants if first else ():
            runs.append(RunSpec(**{**first, "env": {**first["env"], **settings}, "variant": name}))
        if first and getattr(args, "gather_check", None):
            runs += gather_runs(first, args.gather_check)
        names = [run.variant for run in runs if run.system == "kt-hybrid" and run.variant]
        if len(set(names)) < len(names):
            raise SystemExit(f"--variant: each name once (their logs and JSON entries go by it), got {names}")
    return sorted(runs, key=lambda run: order.index(run.system))  # as listed: a cut sitting keeps the first
