"""``vllm-kt bench``: kt-hybrid against plain vLLM and ``--cpu-offload-gb`` in one sitting.

For one model shape it runs, each in a process of its own (so each gets the whole GPU):
plain vLLM with every weight on the GPU (when they fit), plain vLLM with
``--cpu-offload-gb`` leaving ``--gpu-weight-gb`` on the GPU, and kt-hybrid keeping as many
experts per layer on the GPU as fit in the same memory, once per kt-kernel method. Each
run reports decode tok/s at batch 1 and 16, prefill tok/s (8 prompts x 1024 tokens) and
the GPU memory vLLM reports for the weights. A layer benchmark then times one kt-hybrid
MoE layer against bare kt-kernel (same wrapper, same tokens) and the GPU experts alone:
``plugin_overhead`` = hybrid / bare kt-kernel - 1, ``overlap_efficiency`` = hybrid /
max(bare kt-kernel, GPU experts). Without checkpoint weights (a built-in shape) every
system runs with ``load_format=dummy``; kt-hybrid's AMX experts are then random weights
quantized online (and cached, see KT_CACHE_DIR).

Nothing here asserts a speed: the numbers go to JSON (and a PNG chart) for people to read.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm_kt_plugin.model_memory import ModelMemory

GIB = 1024**3
RESULT_PREFIX = "BENCH_RESULT "

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
        from vllm_kt_plugin.gpu_budget import fit_gpu_experts

        budget = fit_gpu_experts(
            device_total_bytes=int(gpu_weight_bytes),
            gpu_memory_utilization=1.0,
            memory=self.memory,
            kv_cache_reserve_gb=0.0,
        )
        return budget.num_gpu_experts

    def gpu_weight_bytes(self, gpu_experts: int) -> int:
        return int(self.memory.gpu_bytes(gpu_experts))


def model_sizes(cfg: dict[str, Any]) -> ModelSizes:
    from vllm_kt_plugin.model_memory import estimate_model_memory

    return ModelSizes(
        memory=estimate_model_memory(cfg),
        top_k=cfg["num_experts_per_tok"],
        hidden=cfg["hidden_size"],
        expert_inter=cfg.get("moe_intermediate_size") or cfg["intermediate_size"],
    )


@dataclass
class RunSpec:
    """One engine configuration to benchmark."""

    system: str  # vllm-gpu | vllm-offload | kt-hybrid
    method: str  # bf16 for plain vLLM; the kt-kernel method for kt-hybrid
    model: str
    load_format: str
    gpu_weight_gb: float
    cpu_offload_gb: float = 0.0
    env: dict[str, str] = field(default_factory=dict)
    enforce_eager: bool = False
    decode_tokens: int = 64
    max_model_len: int = 2048
    gpu_memory_utilization: float = 0.9

    @property
    def name(self) -> str:
        eager = "-eager" if self.enforce_eager else ""
        return f"{self.system}-{self.method}{eager}".lower()


# --- one engine, in its own process --------------------------------------------------


def _prompts(count: int, length: int, vocab: int, seed: int) -> list[dict[str, list[int]]]:
    import random

    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]} for _ in range(count)]


def run_engine(spec: RunSpec) -> dict[str, Any]:
    """Start one vLLM engine and measure it (runs in the child process)."""
    os.environ.update(spec.env)
    from vllm import LLM, SamplingParams

    extra: dict[str, Any] = {}
    if spec.system == "kt-hybrid":
        extra["quantization"] = "kt-hybrid"
    if spec.cpu_offload_gb:
        extra["cpu_offload_gb"] = spec.cpu_offload_gb
    started = time.perf_counter()
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

    def timed(prompts: list[dict[str, list[int]]], max_tokens: int) -> tuple[float, list[list[int]]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

    def decode_rate(batch: int, seed: int) -> tuple[float, list[list[int]]]:
        # Two long runs, N and 2N new tokens: their difference is N decode steps with no
        # prefill or first-call cost in it (a 1-token baseline was seen to be slower than
        # a 65-token run at batch 16).
        prompts = _prompts(batch, 32, vocab, seed)
        timed(prompts, 4)  # warm-up
        short, tokens = timed(prompts, spec.decode_tokens)
        long, _ = timed(prompts, 2 * spec.decode_tokens)
        return batch * spec.decode_tokens / (long - short), tokens

    decode_bs1, tokens_bs1 = decode_rate(1, seed=1)
    decode_bs16, _ = decode_rate(16, seed=2)
    timed(_prompts(8, prefill_len, vocab, seed=3), 1)  # warm-up
    prefill_s, _ = timed(_prompts(8, prefill_len, vocab, seed=4), 1)
    return {
        "startup_s": round(startup_s, 1),
        "decode_bs1_tok_s": round(decode_bs1, 2),
        "decode_bs16_tok_s": round(decode_bs16, 2),
        "prefill_tok_s": round(8 * prefill_len / prefill_s, 1),
        "prefill_prompt_tokens": prefill_len,
        "greedy_tokens_bs1": tokens_bs1[0],
    }


def _max_positions(model: str) -> int:
    cfg = json.loads((Path(model) / "config.json").read_text())
    return int(cfg.get("max_position_embeddings") or 2048)


MODEL_LOAD_RE = re.compile(r"Model loading took ([0-9.]+) GiB")


def run_in_child(spec: RunSpec, log_dir: Path, timeout_s: int) -> dict[str, Any]:
    """``run_engine`` in a fresh process; its log goes to ``log_dir/<name>.log``."""
    log_path = log_dir / f"{spec.name}.log"
    print(f"[bench] {spec.name}: starting (log: {log_path})", flush=True)
    started = time.perf_counter()
    env = {**os.environ, **spec.env, "PYTHONUNBUFFERED": "1"}
    # vLLM logs to stdout: the child's stdout and stderr both go to the log, which also
    # carries the result line.
    code = _run_logged(["_engine", json.dumps(asdict(spec))], env, log_path, timeout_s)
    log_text = log_path.read_text(errors="replace")
    result: dict[str, Any] = {"system": spec.system, "method": spec.method, "enforce_eager": spec.enforce_eager}
    result.update(_result_line(log_text) or {})
    loaded = MODEL_LOAD_RE.findall(log_text)
    result["gpu_weight_gb"] = float(loaded[0]) if loaded else None
    result["configured_gpu_weight_gb"] = spec.gpu_weight_gb
    if spec.cpu_offload_gb:
        result["cpu_offload_gb"] = spec.cpu_offload_gb
    if spec.env:
        result["env"] = spec.env
    if "decode_bs1_tok_s" not in result:
        result["error"] = f"exit {code}: " + " | ".join(log_text.strip().splitlines()[-5:])[-1500:]
    print(f"[bench] {spec.name}: done in {time.perf_counter() - started:.0f} s: {_summary(result)}", flush=True)
    return result


def _run_logged(args: list[str], env: dict[str, str], log_path: Path, timeout_s: int) -> int:
    """``python -m vllm_kt_plugin.benchmark ARGS`` with all its output in ``log_path``. It runs
    in a process group of its own, so a timeout also ends vLLM's engine-core process (a
    grandchild that would otherwise keep the GPU memory)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vllm_kt_plugin.benchmark", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            log.write(f"\n[bench] killed after {timeout_s} s\n")
            return -9


def _result_line(text: str) -> dict[str, Any] | None:
    for line in text.splitlines():
        if line.startswith(RESULT_PREFIX):
            return dict(json.loads(line[len(RESULT_PREFIX) :]))
    return None


def _summary(result: dict[str, Any]) -> str:
    if "error" in result:
        return "FAILED " + result["error"][-300:]
    return (
        f"decode bs1 {result['decode_bs1_tok_s']} tok/s, bs16 {result['decode_bs16_tok_s']} tok/s, "
        f"prefill {result['prefill_tok_s']} tok/s, weights {result['gpu_weight_gb']} GiB"
    )


# --- one MoE layer: hybrid vs bare kt-kernel vs GPU experts ---------------------------


def layer_benchmark(model_dir: str, env: dict[str, str], tokens: Sequence[int], iters: int) -> dict[str, Any]:
    """Times one kt-hybrid layer of the model's shape on CUDA (runs in the child process)."""
    import torch
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.layers.fused_moe import FusedMoEFactory
    from vllm.utils.network_utils import get_open_port

    from vllm_kt_plugin.env_config import KTEnvConfig
    from vllm_kt_plugin.quant_config import KTHybridConfig

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    sizes = model_sizes(cfg)
    vllm_config = VllmConfig(model_config=ModelConfig(model=model_dir, dtype="bfloat16", skip_tokenizer_init=True))
    vllm_config.load_config.load_format = "dummy"
    results: dict[str, Any] = {"tokens": {}}
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{get_open_port()}", 0, "nccl")
        initialize_model_parallel(1, 1)
        from vllm.v1.worker.workspace import init_workspace_manager

        init_workspace_manager(torch.device("cuda"))  # the modular MoE kernels' scratch buffers
        quant = KTHybridConfig(kt=KTEnvConfig.from_env({**os.environ, **env}))
        with torch.device("cuda"):
            runner = FusedMoEFactory(
                num_experts=sizes.num_experts,
                top_k=sizes.top_k,
                hidden_size=sizes.hidden,
                intermediate_size=sizes.expert_inter,
                params_dtype=torch.bfloat16,
                renormalize=True,
                quant_config=quant,
                prefix="model.layers.0.mlp.experts",
            )
        layer = runner.routed_experts
        method = layer.quant_method
        for param in layer.parameters():
            param.data.uniform_(-1e-3, 1e-3)
        method.process_weights_after_loading(layer)  # dummy CPU experts, quantized online
        cpu = method.cpu
        assert cpu is not None, "the layer benchmark needs CPU experts (KT_NUM_GPU_EXPERTS < experts)"

        def time_ms(fn: Any) -> float:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / iters

        gen = torch.Generator(device="cuda").manual_seed(0)
        from vllm.forward_context import set_forward_context

        with set_forward_context(None, vllm_config):
            results["tokens"] = {str(n): _time_layer(method, layer, cpu, n, sizes, gen, time_ms) for n in tokens}
    results["gpu_experts_per_layer"] = method.placement.num_gpu_experts
    return results


def _time_layer(method: Any, layer: Any, cpu: Any, n: int, sizes: ModelSizes, gen: Any, time_ms: Any) -> dict:
    """hybrid / bare kt-kernel / GPU-experts-only times of one layer for ``n`` tokens."""
    import torch

    stream = torch.cuda.current_stream().cuda_stream
    x = (torch.randn(n, sizes.hidden, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    logits = torch.randn(n, sizes.num_experts, device="cuda", generator=gen)
    weights, ids = torch.softmax(logits, -1).topk(sizes.top_k, dim=-1)
    ids = ids.to(torch.int32)

    def hybrid() -> Any:
        return method.forward_hybrid(x, weights, ids, layer)

    def bare_kt_kernel() -> Any:  # the same kt-kernel wrapper, called directly
        cpu.wrapper.submit_forward(x, ids, weights, stream)
        return cpu.wrapper.sync_forward(x, stream)

    def gpu_experts() -> Any:
        return method._gpu_experts(layer, x, weights, ids)

    t = {
        "hybrid_ms": time_ms(hybrid),
        "bare_kt_kernel_ms": time_ms(bare_kt_kernel),
        "gpu_experts_ms": time_ms(gpu_experts),
    }
    result: dict[str, Any] = {k: round(v, 4) for k, v in t.items()}
    result["cpu_expert_picks"] = int((~method.placement.gpu_mask.to("cuda")[ids.long()]).sum())
    result["plugin_overhead"] = round(t["hybrid_ms"] / t["bare_kt_kernel_ms"] - 1, 4)
    result["overlap_efficiency"] = round(t["hybrid_ms"] / max(t["bare_kt_kernel_ms"], t["gpu_experts_ms"]), 4)
    return result


def layer_in_child(model_dir: str, env: dict[str, str], log_dir: Path, timeout_s: int) -> dict[str, Any]:
    log_path = log_dir / f"layer-{env.get('KT_METHOD', '').lower()}.log"
    print(f"[bench] layer benchmark ({env.get('KT_METHOD')}): starting (log: {log_path})", flush=True)
    args = {"model_dir": model_dir, "env": env, "tokens": [1, 16], "iters": 200}
    _run_logged(["_layer", json.dumps(args)], {**os.environ, **env, "PYTHONUNBUFFERED": "1"}, log_path, timeout_s)
    result = _result_line(log_path.read_text(errors="replace"))
    if result is not None:
        print(f"[bench] layer benchmark: {json.dumps(result['tokens'])}", flush=True)
        return result
    tail = " | ".join(log_path.read_text(errors="replace").strip().splitlines()[-5:])
    print(f"[bench] layer benchmark FAILED: {tail[-600:]}", flush=True)
    return {"error": tail[-1500:]}


# --- the sitting ----------------------------------------------------------------------


def host_info() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "cores": len(os.sched_getaffinity(0))}
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
        import vllm

        info["vllm"] = vllm.__version__
        from vllm_kt_plugin.kt_compat import prepare_kt_kernel

        kt_kernel = prepare_kt_kernel()
        info["kt_kernel"] = getattr(kt_kernel, "__version__", "unknown")
        info["kt_cpu_variant"] = kt_kernel.__cpu_variant__
        info["cpu_has_amx"] = bool(torch.cpu._is_amx_tile_supported())
    except Exception as exc:  # the benchmark still runs; the JSON says what is unknown
        info["probe_error"] = repr(exc)
    return info


def prepare_model(args: argparse.Namespace, workdir: Path) -> tuple[str, str, dict[str, Any]]:
    """(model dir, load_format, config): a built-in shape is written as a config-only dir."""
    if args.model:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        has_weights = any(Path(args.model).glob("*.safetensors"))
        return args.model, "auto" if has_weights else "dummy", cfg
    cfg = SHAPES[args.shape]
    model_dir = workdir / f"model-{args.shape}"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return str(model_dir), "dummy", cfg


def plan_runs(args: argparse.Namespace, model: str, load_format: str, sizes: ModelSizes) -> list[RunSpec]:
    total_gb = sizes.total_bytes / GIB
    n_gpu = sizes.gpu_experts_for(args.gpu_weight_gb * GIB)
    common = {"model": model, "load_format": load_format, "decode_tokens": args.decode_tokens}
    runs: list[RunSpec] = []
    systems = set(args.systems.split(","))
    if "vllm-gpu" in systems:
        runs.append(RunSpec("vllm-gpu", "bf16", gpu_weight_gb=round(total_gb, 1), **common))
    if "vllm-offload" in systems:
        offload = max(0.0, math.ceil(total_gb - args.gpu_weight_gb))
        runs.append(RunSpec("vllm-offload", "bf16", gpu_weight_gb=args.gpu_weight_gb, cpu_offload_gb=offload, **common))
    if "kt-hybrid" in systems:
        methods = [m.strip().upper() for m in args.methods.split(",") if m.strip()]
        if load_format != "dummy" and "BF16" not in methods:
            methods.append("BF16")
        for method in methods:
            env = {"KT_METHOD": method, "KT_NUM_GPU_EXPERTS": str(n_gpu)}
            if args.cpuinfer:
                env["KT_CPUINFER"] = str(args.cpuinfer)
            gb = round(sizes.gpu_weight_bytes(n_gpu) / GIB, 2)
            runs.append(RunSpec("kt-hybrid", method, gpu_weight_gb=gb, env=env, **common))
        if args.eager_check and methods:
            first = runs[-len(methods)]
            runs.append(RunSpec(**{**asdict(first), "enforce_eager": True, "decode_tokens": args.decode_tokens}))
    return runs


def write_chart(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no chart", flush=True)
        return False
    runs = [r for r in report["runs"] if "error" not in r and not r.get("enforce_eager")]
    labels = [f"{r['system']}\n{r['method']}\n{r['gpu_weight_gb'] or r['configured_gpu_weight_gb']} GiB" for r in runs]
    metrics = [
        ("decode_bs1_tok_s", "decode, batch 1"),
        ("decode_bs16_tok_s", "decode, batch 16"),
        ("prefill_tok_s", "prefill"),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        values = [r.get(key) or 0 for r in runs]  # a missing measurement shows as "n/a"
        bars = ax.bar(range(len(runs)), values, color=[_color(r["system"]) for r in runs])
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "n/a" for v in values], fontsize=8)
        ax.set_xticks(range(len(runs)), labels, fontsize=7)
        ax.set_title(f"{title} (tok/s)")
        ax.set_yscale("log")
    fig.suptitle(f"{report['model']} on {report['host'].get('gpu', 'GPU')}: tokens/s (log scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def _color(system: str) -> str:
    return {"vllm-gpu": "#4c72b0", "vllm-offload": "#c44e52", "kt-hybrid": "#55a868"}.get(system, "gray")


def best_hybrid(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in runs if r["system"] == "kt-hybrid" and "error" not in r and not r.get("enforce_eager")]
    return max(ok, key=lambda r: r["decode_bs1_tok_s"], default=None)


def run_sitting(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir).expanduser()
    log_dir = workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model, load_format, cfg = prepare_model(args, workdir)
    sizes = model_sizes(cfg)
    runs = plan_runs(args, model, load_format, sizes)
    print(
        f"[bench] {model}: {sizes.total_bytes / GIB:.1f} GiB of weights, {sizes.layers} MoE layers x "
        f"{sizes.num_experts} experts ({sizes.expert_bytes / 2**20:.1f} MiB each); {len(runs)} runs",
        flush=True,
    )
    report: dict[str, Any] = {
        "model": args.shape if not args.model else model,
        "command": "vllm-kt bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "load_format": load_format,
        "host": host_info(),
        "model_sizes_gib": {
            "total": round(sizes.total_bytes / GIB, 2),
            "non_expert": round(sizes.non_expert_bytes / GIB, 2),
            "experts": round(sizes.experts_bytes / GIB, 2),
        },
        "target_gpu_weight_gb": args.gpu_weight_gb,
        "runs": [],
    }
    for spec in runs:
        report["runs"].append(run_in_child(spec, log_dir, args.timeout))
        _save(report, args)
    hybrid = best_hybrid(report["runs"])
    if hybrid is not None:
        env = {**hybrid.get("env", {}), "KT_CACHE_DIR": str(workdir / "layer-cache")}
        layer = layer_in_child(model, env, log_dir, args.timeout)
        report["layer_benchmark"] = {"method": hybrid["method"], **layer}
        decode = layer.get("tokens", {}).get("1")
        if decode:
            report["plugin_overhead"] = decode["plugin_overhead"]
            report["overlap_efficiency"] = decode["overlap_efficiency"]
        report["kt_cpuinfer_threads"] = _threads_from_log(log_dir / f"kt-hybrid-{hybrid['method'].lower()}.log")
    eager = [r for r in report["runs"] if r.get("enforce_eager")]
    if eager and hybrid is not None:
        graphs = next(
            (r for r in report["runs"] if r["method"] == eager[0]["method"] and not r.get("enforce_eager")), None
        )
        if graphs and "greedy_tokens_bs1" in graphs and "greedy_tokens_bs1" in eager[0]:
            a, b = graphs["greedy_tokens_bs1"], eager[0]["greedy_tokens_bs1"]
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
            report["cuda_graphs_vs_eager"] = {"method": eager[0]["method"], "tokens": len(a), "identical_prefix": same}
    _save(report, args)
    return report


def _threads_from_log(path: Path) -> int | None:
    if not path.exists():
        return None
    found = re.findall(r"with (\d+) threads", path.read_text(errors="replace"))
    return int(found[0]) if found else None


def _save(report: dict[str, Any], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if report["runs"]:
        write_chart(report, out.with_suffix(".png"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES), help="built-in model shape")
    parser.add_argument("--model", help="a model directory instead (real weights: BF16 CPU experts also run)")
    parser.add_argument("--gpu-weight-gb", type=float, default=17.0, help="GPU weight memory for offload and kt-hybrid")
    parser.add_argument("--methods", default="AMXINT4,AMXINT8", help="kt-kernel methods for kt-hybrid")
    parser.add_argument("--systems", default="vllm-gpu,vllm-offload,kt-hybrid")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--cpuinfer", type=int, default=0, help="KT_CPUINFER (default: the plugin's)")
    parser.add_argument("--eager-check", action="store_true", help="also run the first method with --enforce-eager")
    parser.add_argument("--workdir", default=str(Path.home() / ".cache" / "vllm-kt-plugin" / "bench"))
    parser.add_argument("--out", default="benchmarks/results/bench.json", help="JSON path (PNG beside it)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per engine")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_engine"]:
        spec = RunSpec(**json.loads(argv[1]))
        print(RESULT_PREFIX + json.dumps(run_engine(spec)), flush=True)
        return 0
    if argv[:1] == ["_layer"]:
        args = json.loads(argv[1])
        print(RESULT_PREFIX + json.dumps(layer_benchmark(**args)), flush=True)
        return 0
    parser = argparse.ArgumentParser(prog="vllm-kt bench", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    report = run_sitting(parser.parse_args(argv))
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    return 0 if report["runs"] and all("error" not in r for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
