"""The engine side of ``vllm-kt bench``: the model shapes, what each run measures in its
own process (``run_engine``), and which runs a sitting makes (``plan_runs``).

Each system runs in a process of its own (``vllm_kt_tools.support.child``), so each gets the whole
GPU: plain vLLM with every weight on the GPU, plain vLLM with ``--cpu-offload-gb``
leaving ``--gpu-weight-gb`` on the GPU, and kt-hybrid keeping as many experts per layer
on the GPU as fit in the same memory, once per kt-kernel method. Each run reports decode
tok/s at batch 1 and 16, prefill tok/s (8 prompts x 1024 tokens, and one prompt of
16,384 tokens) and the GPU memory vLLM reports for the weights; all with the same engine
settings.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from vllm_kt_plugin.planning.gpu_budget import fit_gpu_experts
from vllm_kt_plugin.settings.catalogue import GIB
from vllm_kt_plugin.settings.model_memory import ModelMemory, estimate_model_memory
from vllm_kt_tools.bench import routing
from vllm_kt_tools.bench.peers import (
    engine_kwargs,
    offload_gb,
    prefetch_sweep,
    uva_engine_args,
)
from vllm_kt_tools.bench.report import large_forwards, layer_metrics
from vllm_kt_tools.support.child import run_child
from vllm_kt_tools.support.engine_lock import engine_lock, stop_engine
from vllm_kt_tools.support.tiny_models import write_numbered_tokenizer

# Each decode figure is the median of this many measurements (AMXINT4 at batch 1 has
# varied by a third between sittings).
DECODE_REPEATS = 3

# The long prompt of prefill_long_tok_s: where users wait (retrieval, agents, code).
LONG_PROMPT_TOKENS = 16384

# Built-in model shapes (Hugging Face config.json values), benchmarked with dummy weights.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    },
}


@dataclass(frozen=True)
class ModelSizes:
    """The shape the benchmark plans with; byte counts and fitting come from model_memory
    and gpu_budget, as for KT_NUM_GPU_EXPERTS=auto."""

    memory: ModelMemory
    top_k: int
    hidden: int
    expert_inter: int

    @property
    def layers(self) -> int:
        return self.memory.num_moe_layers

    @property
    def num_experts(self) -> int:
        return self.memory.num_experts

    @property
    def expert_bytes(self) -> int:
        return int(self.memory.expert_bytes)

    @property
    def non_expert_bytes(self) -> int:
        return int(self.memory.non_expert_bytes)

    @property
    def experts_bytes(self) -> int:
        return self.layers * self.num_experts * self.expert_bytes

    @property
    def total_bytes(self) -> int:
        return int(self.memory.gpu_bytes(self.num_experts))

    def gpu_experts_for(self, gpu_weight_bytes: float) -> int:
        """Experts per layer that fit beside the non-expert weights in ``gpu_weight_bytes``."""
        budget = fit_gpu_experts(
            device_total_bytes=int(gpu_weight_bytes),
            gpu_memory_utilization=1.0,
            memory=self.memory,
            kv_cache_reserve_gb=0.0,
        )
        return budget.num_gpu_experts

    def gpu_weight_bytes(self, gpu_experts: int) -> int:
        return int(self.memory.gpu_bytes(gpu_experts))


def model_sizes(hf_config: dict[str, Any]) -> ModelSizes:
    return ModelSizes(
        memory=estimate_model_memory(hf_config),
        top_k=hf_config["num_experts_per_tok"],
        hidden=hf_config["hidden_size"],
        expert_inter=hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"],
    )


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


# --- one engine, in its own process --------------------------------------------------


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]} for _ in range(count)]


def _decode_prompts(batch: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    """One 32-token prompt for every sequence of a decode batch: what routes the batch's
    tokens apart is then the sampling alone, which the recorded routing checks (greedy
    decoding would route all of them alike)."""
    return _prompts(1, 32, vocab, seed) * batch


def run_engine(**fields: Any) -> dict[str, Any]:
    """Start one vLLM engine and measure it (runs in the child process)."""
    spec = RunSpec(**fields)
    os.environ.update(spec.env)
    from vllm import LLM, SamplingParams  # deferred: only the child process starts an engine

    routing.install()  # here and, through support.child's preload, in the spawned engine processes

    extra: dict[str, Any] = engine_kwargs(spec.engine_args)
    if spec.system == "kt-hybrid":
        extra["quantization"] = "kt-hybrid"
    if spec.cpu_offload_gb:
        extra["cpu_offload_gb"] = spec.cpu_offload_gb
    with engine_lock():  # other engines of this GPU start and stop in turn (VLLM_KT_ENGINE_LOCK)
        started = time.perf_counter()  # not counting the wait for the lock
        llm = LLM(
            model=spec.model,
            load_format=spec.load_format,
            skip_tokenizer_init=True,
            max_model_len=min(spec.max_model_len, _max_positions(spec.model)),
            max_num_seqs=16,
            enable_prefix_caching=False,
            gpu_memory_utilization=spec.gpu_memory_utilization,
            enforce_eager=spec.enforce_eager,
            seed=0,
            **extra,
        )
        startup_s = time.perf_counter() - started
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prefill_len = min(1024, llm.llm_engine.model_config.max_model_len - 2)
    routed_at_start = routing.engine_counts(llm)  # not the engine's own warm-up and graph capture

    def timed(prompts: list[dict[str, list[int]]], max_tokens: int) -> tuple[float, list[list[int]]]:
        # sampled, not greedy: independent tokens route like a real model's (bench/routing.py)
        params = SamplingParams(temperature=spec.temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    def timed_decode_rate(batch: int, seed: int) -> tuple[float | None, list[list[int]]]:
        prompts = _decode_prompts(batch, vocab, seed)
        short, tokens = timed(prompts, spec.decode_tokens)
        long, _ = timed(prompts, 2 * spec.decode_tokens)
        return decode_rate(batch, spec.decode_tokens, short, long), tokens

    def decode_rates(batch: int, seed: int) -> tuple[list[float], int, list[list[int]]]:
        """Up to DECODE_REPEATS rates (fewer where as many pairs were discarded), and the
        pairs discarded."""
        timed(_decode_prompts(batch, vocab, seed), 4)  # warm-up
        rates: list[float] = []
        discarded = 0
        while len(rates) < DECODE_REPEATS and discarded < DECODE_REPEATS:
            rate, tokens = timed_decode_rate(batch, seed)
            if rate is None:
                discarded += 1
            else:
                rates.append(rate)
        return rates, discarded, tokens

    rates_bs1, discarded_bs1, tokens_bs1 = decode_rates(1, seed=1)
    rates_bs16, discarded_bs16, _ = decode_rates(16, seed=2)
    timed(_prompts(8, prefill_len, vocab, seed=3), 1)  # warm-up
    prefill_s, _ = timed(_prompts(8, prefill_len, vocab, seed=4), 1)
    long_len = min(LONG_PROMPT_TOKENS, llm.llm_engine.model_config.max_model_len - 2)
    timed(_prompts(1, long_len, vocab, seed=5), 1)  # warm-up
    long_s, _ = timed(_prompts(1, long_len, vocab, seed=6), 1)
    sizes = model_sizes(json.loads((Path(spec.model) / "config.json").read_text()))
    routed = routing.engine_routing(llm, sizes.num_experts, sizes.top_k, since=routed_at_start)
    stop_engine(llm)
    return {
        "startup_s": round(startup_s, 1),
        **decode_summary("decode_bs1", rates_bs1, discarded_bs1),
        **decode_summary("decode_bs16", rates_bs16, discarded_bs16),
        "prefill_tok_s": round(8 * prefill_len / prefill_s, 1),
        "prefill_prompt_tokens": prefill_len,
        "prefill_long_tok_s": round(long_len / long_s, 1),
        "prefill_long_prompt_tokens": long_len,
        "tokens_bs1": tokens_bs1[0],
        "sampling": {"temperature": spec.temperature, "engine_seed": 0},
        "routing": routed,
    }


def decode_rate(batch: int, new_tokens: int, short_s: float, long_s: float) -> float | None:
    """Decode tokens per second from two runs of the same prompts, ``new_tokens`` and twice as
    many new tokens: their difference is ``new_tokens`` decode steps with no prefill or
    first-call cost in it (a 1-token baseline was seen to be slower than a 65-token run at
    batch 16). None where the short run took as long or longer: a stall in it outweighed
    the steps (seen on a 6-layer model, 32 tokens, batch 16)."""
    return batch * new_tokens / (long_s - short_s) if long_s > short_s else None


def decode_summary(name: str, rates: list[float], discarded: int = 0) -> dict[str, Any]:
    """The median of a decode measurement's repeats, and their spread: (max - min) / median,
    so a sitting's noise shows next to the figure; with the pairs of runs discarded (see
    ``decode_rate``), and None for both where every pair was."""
    median = statistics.median(rates) if rates else None
    return {
        f"{name}_tok_s": round(median, 2) if median is not None else None,
        f"{name}_spread": round((max(rates) - min(rates)) / median, 3) if median is not None else None,
        f"{name}_discarded_pairs": discarded,
        f"{name}_repeats_tok_s": [round(r, 2) for r in rates],
    }


def _max_positions(model: str) -> int:
    hf_config = json.loads((Path(model) / "config.json").read_text())
    return int(hf_config.get("max_position_embeddings") or 2048)


MODEL_LOAD_RE = re.compile(r"Model loading took ([0-9.]+) GiB")


def run_in_child(spec: RunSpec, log_dir: Path, timeout_s: int) -> dict[str, Any]:
    """``run_engine`` in a fresh process; its log goes to ``log_dir/<name>.log``."""
    log_path = log_dir / f"{spec.name}.log"
    print(f"[bench] {spec.name}: starting (log: {log_path})", flush=True)
    started = time.perf_counter()
    target = f"{__name__}:run_engine"
    env = {**os.environ, **spec.env, **routing.child_env()}
    run = run_child(target, asdict(spec), env=env, timeout_s=timeout_s, log_path=log_path)
    log_text = run.log
    result: dict[str, Any] = {"system": spec.system, "method": spec.method, "enforce_eager": spec.enforce_eager}
    if spec.variant:
        result["variant"] = spec.variant
    result.update(run.result or {})
    loaded = MODEL_LOAD_RE.findall(log_text)
    result["gpu_weight_gb"] = float(loaded[0]) if loaded else None
    result["configured_gpu_weight_gb"] = spec.gpu_weight_gb
    if spec.cpu_offload_gb:
        result["cpu_offload_gb"] = spec.cpu_offload_gb
    if spec.engine_args:
        result["engine_args"] = spec.engine_args
    if spec.env:
        result["env"] = spec.env
    metrics = layer_metrics(log_text)  # with KT_METRICS_INTERVAL set (e.g. --kt-env)
    if metrics:
        result["layer_metrics"] = metrics
    steps = large_forwards(log_text)
    if steps:
        result["large_forwards"] = steps
    if "decode_bs1_tok_s" not in result:
        result["error"] = f"exit {run.returncode}: " + " | ".join(log_text.strip().splitlines()[-5:])[-1500:]
    print(f"[bench] {spec.name}: done in {time.perf_counter() - started:.0f} s: {_summary(result)}", flush=True)
    return result


def _decode_figure(result: dict[str, Any], name: str) -> str:
    if result[f"{name}_tok_s"] is None:
        return "not measured (every pair of runs discarded)"
    discarded = result.get(f"{name}_discarded_pairs", 0)
    note = f", {discarded} pairs discarded" if discarded else ""
    return f"{result[f'{name}_tok_s']} tok/s (spread {result[f'{name}_spread']:.0%}{note})"


def _summary(result: dict[str, Any]) -> str:
    if "error" in result:
        return "FAILED " + result["error"][-300:]
    return (
        f"decode bs1 {_decode_figure(result, 'decode_bs1')}, bs16 {_decode_figure(result, 'decode_bs16')}, "
        f"prefill {result['prefill_tok_s']} tok/s, one long prompt {result['prefill_long_tok_s']} tok/s, "
        f"weights {result['gpu_weight_gb']} GiB"
    )


def _recorded(name: str) -> bool:
    """Whether a VLLM_* variable goes into the committed JSON: not ours (VLLM_KT_*), not
    set per run (VLLM_PLUGINS), no secret (VLLM_API_KEY and the like)."""
    secret = any(word in name for word in ("KEY", "TOKEN", "SECRET", "PASSWORD"))
    return not name.startswith("VLLM_KT_") and name != "VLLM_PLUGINS" and not secret


COMMIT_VARIABLE = "VLLM_KT_COMMIT"  # the sitting's commit, where the tree travels without .git


def project_commit() -> str | None:
    """The project's commit: VLLM_KT_COMMIT (the lead sets it: the GPU host gets a copy of the
    working tree, maybe without .git), else git's, with "-dirty" for uncommitted changes."""
    if os.environ.get(COMMIT_VARIABLE):
        return os.environ[COMMIT_VARIABLE]
    import subprocess

    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("-dirty" if dirty else "") if commit else None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def host_info() -> dict[str, Any]:
    """What a sitting ran on, so that figures of different hosts are never read as one:
    CPU model, usable cores, kt-kernel's loaded variant, the project's commit, versions."""
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cores": len(os.sched_getaffinity(0)),
        "commit": project_commit(),
    }
    # vLLM settings given by environment to every system (e.g. VLLM_DEEP_GEMM_WARMUP)
    vllm_env = {name: value for name, value in os.environ.items() if name.startswith("VLLM_") and _recorded(name)}
    if vllm_env:
        info["vllm_env"] = dict(sorted(vllm_env.items()))
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
        import vllm

        info["vllm"] = vllm.__version__
        from vllm_kt_plugin.cpu_backends.kt_kernel.compat import prepare_kt_kernel  # imports torch: inside the try

        kt_kernel = prepare_kt_kernel()
        info["kt_kernel"] = getattr(kt_kernel, "__version__", "unknown")
        info["kt_cpu_variant"] = kt_kernel.__cpu_variant__
        info["cpu_has_amx"] = bool(torch.cpu._is_amx_tile_supported())
    except Exception as exc:  # the benchmark still runs; the JSON says what is unknown
        info["probe_error"] = repr(exc)
    return info


# --checkpoint: the format every system's checkpoint has; the name plain vLLM's runs
# carry, and the kt-kernel method that reads its experts from files written on the host
# (None: online AMX weights quantized from vLLM's dummy ones). bf16-experts gives kt-hybrid
# BF16 CPU experts, which can move to the GPU (KT_DYNAMIC_GPU_EXPERTS).
CHECKPOINTS = {"bf16": ("bf16", None), "bf16-experts": ("bf16", "BF16"), "fp8-block": ("fp8", "FP8")}
PREFILL_OFF = ("prefill-off", {"KT_GPU_PREFILL_MIN_TOKENS": "0"})  # --prefill-off-check


def shape_config(shape: str, checkpoint: str = "bf16", layers: int = 0) -> dict[str, Any]:
    """A built-in shape's config.json, with ``layers`` decoder layers (0: all) and, for a
    quantized ``checkpoint``, its ``quantization_config``."""
    from vllm_kt_plugin.settings.model_memory import moe_layer_indices
    from vllm_kt_tools.support.quantized_checkpoints import fp8_block_config

    config = dict(SHAPES[shape])
    if layers:
        config["num_hidden_layers"] = layers
    if checkpoint == "fp8-block":
        config["quantization_config"] = fp8_block_config(moe_layer_indices(config))
    return config


def prepare_model(args: argparse.Namespace, workdir: Path) -> tuple[str, str, dict[str, Any]]:
    """(model dir, load_format, config): a built-in shape is written as a config-only dir."""
    if args.model:
        hf_config = json.loads((Path(args.model) / "config.json").read_text())
        has_weights = any(Path(args.model).glob("*.safetensors"))
        return args.model, "auto" if has_weights else "dummy", hf_config
    hf_config = shape_config(args.shape, args.checkpoint, args.layers)
    suffix = ("" if args.checkpoint == "bf16" else f"-{args.checkpoint}") + (f"-{args.layers}l" if args.layers else "")
    model_dir = workdir / f"model-{args.shape}{suffix}"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(hf_config, indent=2))
    if not (model_dir / "tokenizer.json").exists():  # `vllm serve` and `vllm bench serve` need one
        write_numbered_tokenizer(model_dir, hf_config["vocab_size"])
    return str(model_dir), "dummy", hf_config


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
        names = [name for name, _ in variants]
        if len(set(names)) < len(names):
            raise SystemExit(f"--variant: each name once (their logs and JSON entries go by it), got {names}")
        for name, settings in variants if first else ():
            runs.append(RunSpec(**{**first, "env": {**first["env"], **settings}, "variant": name}))
    return sorted(runs, key=lambda run: order.index(run.system))  # as listed: a cut sitting keeps the first
