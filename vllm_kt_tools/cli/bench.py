"""``vllm-kt bench``: kt-hybrid against plain vLLM and ``--cpu-offload-gb`` in one sitting.

For one model shape it runs every system in a process of its own (``bench.engine_child``),
then times one kt-hybrid MoE layer against bare kt-kernel and the GPU experts alone
(``bench.layer_timing``), and writes JSON plus a PNG chart (``bench.report``). Without
checkpoint weights (a built-in shape) every system runs with ``load_format=dummy``;
kt-hybrid's AMX experts are then random weights quantized online (and cached, see
KT_CACHE_DIR). Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from vllm_kt_plugin.settings.catalogue import GATHERING_SCHEDULER, GIB, SETTINGS_PREFIX, cache_root
from vllm_kt_tools.bench import routing
from vllm_kt_tools.bench.decode_timeline import add_limits
from vllm_kt_tools.bench.engine_child import max_positions, run_in_child
from vllm_kt_tools.bench.engine_runs import LONG_PROMPT_TOKENS, RunSpec, plan_runs, system_order
from vllm_kt_tools.bench.host import host_info
from vllm_kt_tools.bench.kernel_sweep import sweep_in_child
from vllm_kt_tools.bench.layer_timing import layer_in_child
from vllm_kt_tools.bench.load_runs import (
    Load,
    load_run,
    serve_args,
    served_run_record,
    sglang_load_run,
    sglang_server,
)
from vllm_kt_tools.bench.peers import (
    DEFAULT_PREFETCH_SWEEP,
    SGLANG_PEER,
    SGLANG_POINT_NAMES,
    SGLANG_SWEEP_POINTS,
    VLLM_PEERS,
    VLLM_SERVE_CHUNK,
    SglangKt,
    best_prefetch,
    check_sglang_run,
    prepared_amx_folder,
    sglang_sweep,
)
from vllm_kt_tools.bench.report import best_hybrid, save, threads_from_log
from vllm_kt_tools.bench.server_engine import ServerWorkload, server_engine_run
from vllm_kt_tools.bench.shapes import CHECKPOINTS, SHAPES, ModelSizes, model_sizes, prepare_model
from vllm_kt_tools.bench.split_curve import split_curve_in_child
from vllm_kt_tools.support import process_groups
from vllm_kt_tools.support.engine_lock import engine_lock
from vllm_kt_tools.support.gpu_memory import wait_until_free
from vllm_kt_tools.support.quantized_checkpoints import write_dummy_experts
from vllm_kt_tools.support.server import VLLMServer


def run_sitting(args: argparse.Namespace) -> dict[str, Any]:
    if args.split_curve and not args.layer_only:
        raise SystemExit("--split-curve times layers alone: use it with --layer-only")
    if args.sweep_only and not args.kernel_sweep:
        raise SystemExit("--sweep-only is the kernel sweep alone: use it with --kernel-sweep")
    if args.kernel_sweep and (args.prepare_only or args.layer_only):
        raise SystemExit(
            "--kernel-sweep times kt-kernel before a sitting's engines (or servers, with --load): not with "
            "--prepare-only or --layer-only"
        )
    workdir = Path(args.workdir).expanduser()
    log_dir = workdir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model, load_format, hf_config = prepare_model(args, workdir)
    sizes = model_sizes(hf_config)
    files = expert_files(args, model, hf_config, sizes)
    runs = plan_runs(args, model, load_format, sizes, files)
    # sglang-kt takes kt-hybrid's settings (sglang_configs): its run's, planned where it is not listed
    hybrid = [spec for spec in runs if spec.system == "kt-hybrid"]
    if not hybrid and SGLANG_PEER in system_order(args):
        hybrid = plan_runs(
            argparse.Namespace(**{**vars(args), "systems": "kt-hybrid"}), model, load_format, sizes, files
        )
    print(
        f"[bench] {model}: {sizes.total_bytes / GIB:.1f} GiB of weights, {sizes.layers} MoE layers x "
        f"{sizes.num_experts} experts ({sizes.expert_bytes / 2**20:.1f} MiB each); {len(runs)} runs",
        flush=True,
    )
    if SGLANG_PEER in system_order(args) and not args.prepare_only:
        sglang_configs(args, hybrid, {})  # a point sglang-kt cannot run fails here, before any GPU time
    threads = None if args.prepare_only else kt_threads(hybrid)  # prepare-only runs beside other work
    with engine_lock():  # the bandwidth pass: not while an engine starts beside it
        host = host_info(threads)
    report: dict[str, Any] = {
        "model": args.shape if not args.model else model,
        "command": "vllm-kt bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "workload": workload_info(args),
        "load_format": load_format,
        "host": host,
        "model_sizes_gib": {
            "total": round(sizes.total_bytes / GIB, 2),
            "non_expert": round(sizes.non_expert_bytes / GIB, 2),
            "experts": round(sizes.experts_bytes / GIB, 2),
        },
        "target_gpu_weight_gb": args.gpu_weight_gb,
        "checkpoint": args.checkpoint,
        "layers": hf_config["num_hidden_layers"],
        "runs": [],
    }
    limits = decode_limits(host, hybrid, sizes)
    if limits:  # beside the engine figures: what the host's memory allows (bench/memory_bandwidth.py)
        report["decode_limit"] = limits
    if args.append:
        continue_sitting(report, Path(args.out))
    if args.prepare_only:
        return prepare_runs(runs, hf_config, report)
    if args.layer_only:
        return run_layer_only(runs, report, workdir, args)
    if args.kernel_sweep:  # every sitting's host speed beside its figures, engines or servers
        sweep_kernels(runs, report, log_dir, args)
        if args.sweep_only:
            save(report, args.out)
            return report
    if args.server_engine:  # with --load, the load too, against the same servers
        return run_server_engine(args, runs, hybrid, report, log_dir)
    if args.load:
        return run_load(args, runs, hybrid, report, log_dir)
    if SGLANG_PEER in system_order(args):  # said, not silently skipped
        report["not_measured"] = {SGLANG_PEER: "engine-mode figures are not built for sglang-kt; it runs under --load"}
        print(f"[bench] {SGLANG_PEER}: {report['not_measured'][SGLANG_PEER]}", flush=True)
    for spec in runs:
        wait_until_free(spec.name)
        report["runs"].append(run_in_child(spec, log_dir, args.timeout))
        add_limits(report["runs"][-1], report)
        save(report, args.out)
    record_prefetch_sweep(report)
    hybrid = best_hybrid(report["runs"])
    if hybrid is not None and not args.skip_layer:
        layer = time_layer(report, model, hybrid["method"], hybrid.get("env", {}), workdir, args.timeout)
        decode = layer.get("tokens", {}).get("1")
        if decode:
            report["plugin_overhead"] = decode["plugin_overhead"]
            report["overlap_efficiency"] = decode["overlap_efficiency"]
        report["kt_cpuinfer_threads"] = threads_from_log(log_dir / f"kt-hybrid-{hybrid['method'].lower()}.log")
    eager = [r for r in report["runs"] if r.get("enforce_eager")]
    if eager and hybrid is not None:
        graphs = next(
            (r for r in report["runs"] if r["method"] == eager[0]["method"] and not r.get("enforce_eager")), None
        )
        if graphs and "tokens_bs1" in graphs and "tokens_bs1" in eager[0]:  # same engine seed
            a, b = graphs["tokens_bs1"], eager[0]["tokens_bs1"]
            same = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))
            report["cuda_graphs_vs_eager"] = {"method": eager[0]["method"], "tokens": len(a), "identical_prefix": same}
    save(report, args.out)
    return report


# What must agree for runs of two invocations to share one JSON.
SITTING_KEYS = ("model", "load_format", "target_gpu_weight_gb", "checkpoint", "layers")


def continue_sitting(report: dict[str, Any], out: Path) -> None:
    """--append: ``out``'s runs come first in ``report`` (e.g. those of a sitting cut short,
    whose remaining systems run on the next host), and both commands are kept."""
    if not out.exists():
        return
    earlier = json.loads(out.read_text())
    differ = [
        f"{key} {earlier.get(key)!r} != {report[key]!r}" for key in SITTING_KEYS if earlier.get(key) != report[key]
    ]
    if differ:
        raise SystemExit(f"--append: {out} holds another sitting's runs ({'; '.join(differ)})")
    report["runs"] = earlier["runs"]
    if "kernel_sweep" in earlier:  # this invocation's sweeps are added to it
        report["kernel_sweep"] = earlier["kernel_sweep"]
    if "server_engine" in earlier:  # likewise its server runs (run_server_engine checks the workload)
        report["server_engine"] = earlier["server_engine"]
    # a JSON appended to once holds "commands" and no "command" (get()'s default would be read anyway)
    before = earlier["commands"] if "commands" in earlier else [earlier["command"]]
    report["commands"] = before + [report.pop("command")]


def prepare_runs(runs: list[RunSpec], hf_config: dict[str, Any], report: dict[str, Any]) -> dict[str, Any]:
    """--prepare-only: the kt-hybrid runs' online-quantized CPU experts, into the cache
    their engines read (the expert files of a file --checkpoint are written already)."""
    from vllm_kt_tools.bench.prepare import fill_online_cache  # imports kt-kernel

    report["prepared"] = {spec.name: fill_online_cache(spec, hf_config) for spec in runs}
    print(f"[bench] prepared (layers quantized per run): {report['prepared']}", flush=True)
    return report


def sweep_kernels(runs: list[RunSpec], report: dict[str, Any], log_dir: Path, args: argparse.Namespace) -> None:
    """--kernel-sweep: bare kt-kernel through all layers, per kt-hybrid method, before any
    engine (alone on the host)."""
    plain = [spec for spec in runs if spec.system == "kt-hybrid" and not spec.variant and not spec.enforce_eager]
    if not plain:
        print("[bench] --kernel-sweep: no kt-hybrid run to take the CPU experts of: no sweep", flush=True)
    for spec in plain:
        wait_until_free(f"the kernel sweep of {spec.method}")
        sweep = sweep_in_child(spec.model, spec.load_format, spec.env, log_dir, args.timeout)
        report.setdefault("kernel_sweep", {})[spec.method] = sweep
        save(report, args.out)


def expert_files(args: argparse.Namespace, model: str, hf_config: dict[str, Any], sizes: ModelSizes) -> str | None:
    """For a --checkpoint whose experts kt-kernel reads from files (``fp8-block``,
    ``bf16-experts``) on a built-in shape: its routed experts, written once beside the model
    dir (vLLM's systems run dummy weights)."""
    method = CHECKPOINTS[args.checkpoint][1]
    if method is None or args.model or "kt-hybrid" not in system_order(args):
        return None
    out = Path(f"{model}-experts")
    print(f"[bench] {method} routed experts for kt-kernel: {out} (written once)", flush=True)
    write_dummy_experts(out, method, sizes.memory.moe_layers, sizes.num_experts, sizes.hidden, sizes.expert_inter)
    return str(out)


def run_layer_only(runs: list[RunSpec], report: dict[str, Any], workdir: Path, args: argparse.Namespace) -> dict:
    """--layer-only: the first kt-hybrid run's layer, timed alone (no engine starts)."""
    spec = next((s for s in runs if s.system == "kt-hybrid"), None)
    if spec is None:
        raise SystemExit("--layer-only needs a kt-hybrid run (--systems kt-hybrid)")
    if args.split_curve:  # the split's per-layer curve instead (docs/split.md)
        env = {**spec.env, "KT_CACHE_DIR": str(workdir / "layer-cache")}
        wait_until_free("the split curve")
        curve = split_curve_in_child(spec.model, env, workdir / "logs", args.timeout)
        report["split_curve"] = {"method": spec.method, **curve}
        save(report, args.out)
        return report
    time_layer(report, spec.model, spec.method, spec.env, workdir, args.timeout)
    save(report, args.out)
    return report


def time_layer(
    report: dict[str, Any], model: str, method: str, env: dict[str, str], workdir: Path, timeout_s: int
) -> dict[str, Any]:
    """One kt-hybrid layer of ``method`` timed alone, into ``report`` (with the whole-layer
    path's break-even where it was timed)."""
    env = {**env, "KT_CACHE_DIR": str(workdir / "layer-cache")}
    wait_until_free(f"the layer benchmark of {method}")
    layer = layer_in_child(model, env, workdir / "logs", timeout_s)
    report["layer_benchmark"] = {"method": method, **layer}
    if "gpu_prefill" in layer:
        report["gpu_prefill_break_even_tokens"] = layer.get("gpu_prefill_break_even_tokens")
    return layer


def run_load(
    args: argparse.Namespace, runs: list[RunSpec], hybrid: list[RunSpec], report: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    """--load: every system behind `vllm serve` under `vllm bench serve` (``hybrid``: kt-hybrid's
    runs, whose settings sglang-kt takes)."""
    report["load"] = {"input_len": args.load_input_len, "output_len": args.load_output_len, "runs": []}

    def load_of(spec_load: tuple[int, int]) -> Load:
        prompts, concurrency = spec_load
        return Load(prompts, concurrency, args.load_input_len, args.load_output_len, log_dir, args.timeout)

    # vLLM's offloaders are by far the slowest: last, so a sitting cut short keeps the others.
    for spec in sorted(runs, key=lambda spec: spec.system in VLLM_PEERS):
        if spec.enforce_eager:
            continue
        slow = spec.system in VLLM_PEERS and args.offload_load
        wait_until_free(f"load-{spec.name}")
        report["load"]["runs"].append(load_run(spec, load_of(args.offload_load if slow else args.load)))
        save(report, args.out)
    if SGLANG_PEER in system_order(args):
        for config in sglang_configs(args, hybrid, report["load"]):
            wait_until_free(f"load-{config.name}")
            report["load"]["runs"].append(sglang_load_run(config, load_of(args.load)))
            save(report, args.out)
    return report


def run_server_engine(
    args: argparse.Namespace, runs: list[RunSpec], hybrid: list[RunSpec], report: dict[str, Any], log_dir: Path
) -> dict[str, Any]:
    """--server-engine: the engine workload (decode at batch 1 and 16, 8 x 1,024, one long
    prompt) through each system's server: vLLM's systems and kt-hybrid behind `vllm serve`,
    sglang-kt behind its own (bench/server_engine.py says why; ``hybrid``: kt-hybrid's runs,
    whose settings it takes)."""
    if not runs and not hybrid:
        raise SystemExit(f"--server-engine: no system to measure (--systems {args.systems})")
    model = (runs or hybrid)[0].model
    config = json.loads((Path(model) / "config.json").read_text())
    max_model_len = min(LONG_PROMPT_TOKENS + 64, max_positions(model))
    work = ServerWorkload(
        vocab=config["vocab_size"],
        max_model_len=max_model_len,
        decode_tokens=args.decode_tokens,
        decode_repeats=args.decode_repeats,
        timeout_s=args.timeout,
    )
    load = None
    if args.load:  # then the load, against each server the workload measured
        prompts, concurrency = args.load
        load = Load(prompts, concurrency, args.load_input_len, args.load_output_len, log_dir, args.timeout)
    section: dict[str, Any] = {"workload": asdict(work), "runs": []}
    if load is not None:
        section["load"] = {"input_len": load.input_len, "output_len": load.output_len}
    earlier = report.get("server_engine")  # --append: this invocation's runs after the earlier ones
    if earlier is not None:
        if earlier["workload"] != section["workload"]:
            raise SystemExit(f"--append: {args.out} measured another server workload ({earlier['workload']})")
        section["runs"] = earlier["runs"]
        section.update({k: v for k, v in earlier.items() if k not in section})
    report["server_engine"] = section
    sizes = model_sizes(config)
    routed = (sizes.num_experts, sizes.top_k)

    def vllm_servers() -> None:
        for spec in runs:
            if spec.enforce_eager:
                continue
            env, flags = routing.server_recording()  # its routing, counted as in the engine mode
            wait_until_free(f"server-{spec.name}")
            server = VLLMServer(
                spec.model,
                [*serve_args(spec, max_model_len), *flags],
                env={**spec.env, **env},
                log_path=log_dir / f"server-{spec.name}-serve.log",
            )
            record = served_run_record(spec)
            run = server_engine_run(server, f"server-{spec.name}", record, work, routed, load, spec.model)
            add_limits(run, report)
            section["runs"].append(run)
            save(report, args.out)

    def sglang_servers() -> None:
        for sglang in sglang_configs(args, hybrid, section):
            wait_until_free(f"server-{sglang.name}")
            log_path = log_dir / f"server-{sglang.name}-serve.log"
            server = sglang_server(sglang, max_model_len, log_path)
            result = {"system": SGLANG_PEER, "method": sglang.method, "variant": sglang.name, "command": server.command}
            result = server_engine_run(server, f"server-{sglang.name}", result, work, None, load, model)
            section["runs"].append(check_sglang_run(result, log_path))
            save(report, args.out)

    order = system_order(args)
    if SGLANG_PEER not in order:
        vllm_servers()
    elif order[0] == SGLANG_PEER:  # listed first, run first (e.g. a sitting that may be cut short)
        sglang_servers()
        vllm_servers()
    else:
        vllm_servers()
        sglang_servers()
    return report


def sglang_configs(args: argparse.Namespace, hybrid_runs: list[RunSpec], section: dict[str, Any]) -> list[SglangKt]:
    """sglang-kt as kt-hybrid's first run is set up: its model dir, kt-kernel method, CPU
    threads and GPU experts per layer, reading the AMX experts --prepare-only made for it
    (recorded in ``section``: the load's or the server engine's)."""
    from vllm_kt_plugin.settings.loader import load_settings

    hybrid = hybrid_runs[0] if hybrid_runs else None
    if hybrid is None:
        raise SystemExit(f"{SGLANG_PEER} takes kt-hybrid's settings, and this sitting plans no kt-hybrid run")
    settings = load_settings({**os.environ, **hybrid.env})
    sizes = model_sizes(json.loads((Path(hybrid.model) / "config.json").read_text()))
    shape = (sizes.num_experts, sizes.hidden, sizes.expert_inter)
    weight_path = args.sglang_weight_path or str(
        prepared_amx_folder(settings.cache_dir, hybrid.model, hybrid.method, shape, settings.threadpool_count)
    )
    base = SglangKt(
        model=hybrid.model,
        weight_path=weight_path,
        method=hybrid.method,
        cpuinfer=settings.cpuinfer_threads,
        threadpool_count=settings.threadpool_count,
        num_gpu_experts=int(hybrid.env["KT_NUM_GPU_EXPERTS"]),
    )
    points = args.sglang_sweep or SGLANG_SWEEP_POINTS[:1]  # without --sglang-sweep: the documented point
    try:
        configs = sglang_sweep(base, points, chunk=args.max_num_batched_tokens or VLLM_SERVE_CHUNK)
    except ValueError as exc:  # a point sglang-kt cannot run (peers.SglangKt says why)
        raise SystemExit(f"--sglang-sweep: {exc}") from None
    section["sglang_kt"] = {
        "weight_path": weight_path,
        "sweep": [p if isinstance(p, str) else list(p) for p in points],
        "points": {config.name: config.command(python="SGLANG_PYTHON")[3:] for config in configs},
    }
    return configs


def kt_threads(runs: list[RunSpec]) -> int:
    """kt-kernel's thread count of the sitting (the first of its kt-hybrid ``runs``, else the
    plugin's default on this host): the memory bandwidth is measured with as many threads."""
    from vllm_kt_plugin.settings.loader import load_settings

    hybrid = next(iter(runs), None)
    return load_settings({**os.environ, **(hybrid.env if hybrid else {})}).cpuinfer_threads


def decode_limits(host: dict[str, Any], runs: list[RunSpec], sizes: ModelSizes) -> dict[str, Any]:
    """Per kt-hybrid method: the decode rate the host's memory bandwidth allows at batch 1
    and 16 with that run's CPU experts (``memory_bandwidth.decode_limit``)."""
    from vllm_kt_tools.bench.memory_bandwidth import decode_limit

    bandwidth = (host.get("memory_bandwidth") or {}).get("read_gb_s")
    limits: dict[str, Any] = {}
    for spec in runs:
        if not bandwidth or spec.system != "kt-hybrid" or spec.variant or spec.method in limits:
            continue
        limit = decode_limit(
            bandwidth,
            spec.method,
            sizes.hidden,
            sizes.expert_inter,
            sizes.layers,
            sizes.num_experts,
            sizes.top_k,
            int(spec.env["KT_NUM_GPU_EXPERTS"]),
        )
        if limit:
            limits[spec.method] = limit
    return limits


def _int_pairs(text: str, names: str, minimum: int, example: str) -> tuple[tuple[int, int], ...]:
    """``A:B[,A:B]`` as integer pairs, each number >= ``minimum``; else the parser's error."""
    try:
        pairs = tuple((int(a), int(b)) for a, b in (pair.split(":") for pair in text.split(",") if pair))
    except ValueError:
        pairs = ()
    if not pairs or any(a < minimum or b < minimum for a, b in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: expected {names}[,{names}], each >= {minimum}, e.g. {example}")
    return pairs


def _prefetch_points(text: str) -> tuple[tuple[int, int], ...]:
    return _int_pairs(text, "GROUP:STEP", 1, "8:1,8:2")


def _sglang_points(text: str) -> tuple[str | tuple[int, int], ...]:
    """Point names (``peers.sglang_points``) or THRESHOLD:DEFERRED pairs, comma-separated."""
    points: list[str | tuple[int, int]] = []
    for item in (part.strip() for part in text.split(",")):
        if item in SGLANG_POINT_NAMES:
            points.append(item)
        elif item:
            points += _int_pairs(item, "THRESHOLD:DEFERRED", 0, "documented,mirror or 0:2")
    if not points:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {','.join(SGLANG_POINT_NAMES)} or THRESHOLD:DEFERRED")
    return tuple(points)


def _gather_windows(text: str) -> tuple[float, ...]:
    try:
        windows = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        windows = ()
    if not windows or any(not 0 < w <= 10000 for w in windows):
        raise argparse.ArgumentTypeError(f"{text!r}: expected milliseconds in (0, 10000], e.g. 30 or 15,30,60")
    return windows


def _load_spec(text: str) -> tuple[int, int]:
    prompts, _, concurrency = text.partition(":")
    try:
        return int(prompts), int(concurrency)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected PROMPTS:CONCURRENCY, e.g. 1000:64") from None


def _env_pair(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name.startswith(SETTINGS_PREFIX):
        raise argparse.ArgumentTypeError(f"{text!r}: expected KT_NAME=VALUE, e.g. KT_STAGING_MIN_TOKENS=4096")
    return name, value


def _variant(text: str) -> tuple[str, dict[str, str]]:
    name, sep, settings = text.partition(":")
    pairs = [_env_pair(pair) for pair in settings.split(",") if pair] if sep else []
    if not name or not pairs:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME:KT_A=1[,KT_B=2], e.g. defer-1:KT_MAX_DEFERRED_EXPERTS_PER_TOKEN=1"
        )
    return name, dict(pairs)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES), help="built-in model shape")
    parser.add_argument(
        "--checkpoint",
        default="bf16",
        choices=sorted(CHECKPOINTS),
        help="the built-in shape's checkpoint format; fp8-block runs kt-hybrid with KT_METHOD=FP8 and "
        "bf16-experts with KT_METHOD=BF16 (which KT_DYNAMIC_GPU_EXPERTS needs), on routed experts written on "
        "this host",
    )
    parser.add_argument("--layers", type=int, default=0, help="decoder layers of the built-in shape (0: all)")
    parser.add_argument("--model", help="a model directory instead (real weights: BF16 CPU experts also run)")
    parser.add_argument("--gpu-weight-gb", type=float, default=17.0, help="GPU weight memory for offload and kt-hybrid")
    parser.add_argument("--methods", default="AMXINT4,AMXINT8", help="kt-kernel methods for kt-hybrid")
    parser.add_argument(
        "--systems",
        default="vllm-gpu,vllm-offload,kt-hybrid",
        help="the systems, run in this order (a --load sitting runs vllm-offload last, it is slowest)",
    )
    parser.add_argument(
        "--prefetch-sweep",
        type=_prefetch_points,
        default=DEFAULT_PREFETCH_SWEEP,
        metavar="GROUP:STEP[,GROUP:STEP]",
        help="vllm-prefetch: the (offload group size, prefetch step) points to run; each offloads the fewest "
        "layers per group that fit --gpu-weight-gb (the load stage takes the one point its sitting chose)",
    )
    parser.add_argument(
        "--sglang-weight-path",
        help="sglang-kt: the prepared AMX experts (default: the folder --prepare-only fills for the first method)",
    )
    parser.add_argument(
        "--sglang-sweep",
        nargs="?",
        const=SGLANG_SWEEP_POINTS,
        type=_sglang_points,
        help="sglang-kt: the points to run, in this order: " + ", ".join(SGLANG_POINT_NAMES) + " (docs/benchmarks.md), "
        "or THRESHOLD:DEFERRED on the documented point (its layerwise GPU prefill needs a native method: 0 with "
        "AMX experts); without a value " + ",".join(SGLANG_SWEEP_POINTS) + "; without the flag the documented point",
    )
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        help="vLLM's, for every engine and server of the sitting (default: vLLM's for its entry point and GPU; "
        "a kt-hybrid forward that streams the CPU experts costs one copy of them whatever its size, so larger "
        "prefill steps pay it fewer times: docs/split.md)",
    )
    parser.add_argument(
        "--decode-repeats", type=int, default=5, help="pairs of decode runs per batch size (the figure: their median)"
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="vLLM's, for every engine (lower leaves room for other processes on the GPU)",
    )
    parser.add_argument("--cpuinfer", type=int, default=0, help="KT_CPUINFER (default: the plugin's)")
    parser.add_argument("--eager-check", action="store_true", help="also run the first method with --enforce-eager")
    parser.add_argument(
        "--prefill-off-check",
        action="store_true",
        help="also run the first method with KT_STAGING_MIN_TOKENS=0 (staging off): the variant "
        "prefill-off:KT_STAGING_MIN_TOKENS=0",
    )
    parser.add_argument(
        "--variant",
        type=_variant,
        action="append",
        default=[],
        metavar="NAME:KT_A=1[,KT_B=2]",
        help="also run the first method with these KT_* settings, as run NAME (repeatable)",
    )
    parser.add_argument(
        "--gather-check",
        nargs="?",
        const=(None,),
        type=_gather_windows,
        metavar="MS[,MS]",
        help="also run the first method behind kt-hybrid's scheduler (--scheduler-cls "
        f"{GATHERING_SCHEDULER}: prompts sent together share one forward), as run gather at the plugin's "
        "KT_STAGING_GATHER_MS, or as gather-<MS>ms at each window given",
    )
    parser.add_argument(
        "--kt-env",
        type=_env_pair,
        action="append",
        default=[],
        metavar="KT_NAME=VALUE",
        help="a KT_* setting for every kt-hybrid run (repeatable), recorded under the run's env",
    )
    parser.add_argument(
        "--decode-timeline",
        action="store_true",
        help="record kt-hybrid's decode steps layer by layer (submit, GPU experts, wait for the CPU, the rest), "
        "a summary per batch size against the host's limit in the JSON's decode_timeline (stamps inside the "
        "CUDA graphs: a few kernels per layer)",
    )
    parser.add_argument("--workdir", default=str(cache_root() / "bench"))
    parser.add_argument("--out", default="benchmarks/results/bench.json", help="JSON path (PNG beside it)")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per engine")
    parser.add_argument(
        "--load",
        type=_load_spec,
        metavar="PROMPTS:CONCURRENCY",
        help="instead of the engine measurements: each system behind `vllm serve` under `vllm bench serve` "
        "(with --server-engine: after the engine workload, against the same server)",
    )
    parser.add_argument(
        "--server-engine",
        action="store_true",
        help="instead of vLLM's LLM: the engine workload through each system's server (/v1/completions), "
        "sglang-kt included (its only way in)",
    )
    parser.add_argument(
        "--offload-load",
        type=_load_spec,
        metavar="PROMPTS:CONCURRENCY",
        help="--load for vLLM's offloaders (vllm-offload, -offload-experts, -prefetch: they are slow)",
    )
    parser.add_argument(
        "--layer-only", action="store_true", help="only the layer benchmark of the first kt-hybrid method (no engines)"
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="add this invocation's runs to --out's (same shape, checkpoint, layers and GPU weight target)",
    )
    parser.add_argument(
        "--prepare-only",
        action="store_true",
        help="only make what the kt-hybrid runs' first start would (online-quantized CPU experts in "
        "KT_CACHE_DIR, the expert files of --checkpoint fp8-block or bf16-experts), without the GPU; no measurements",
    )
    parser.add_argument(
        "--kernel-sweep",
        action="store_true",
        help="before the engines, time bare kt-kernel decode through every layer, per kt-hybrid method (the "
        "kernel's own speed for the whole model, against one layer's cached speed)",
    )
    parser.add_argument(
        "--sweep-only", action="store_true", help="with --kernel-sweep: the sweep alone, no engines or servers"
    )
    parser.add_argument(
        "--skip-layer", action="store_true", help="no layer benchmark after the engines (e.g. run --layer-only first)"
    )
    parser.add_argument(
        "--split-curve",
        action="store_true",
        help="with --layer-only: per-layer time of the CPU path, the whole-layer stream, the split and the split with "
        "the FP8 host copy, 128 to 16,384 tokens (docs/split.md), instead of the layer benchmark",
    )
    parser.add_argument(
        "--cpu-methods",
        action="store_true",
        help="instead of a sitting: one Qwen3-30B-A3B MoE layer's decode time (batch 1, 16) for BF16, AMXINT4, "
        "AMXINT8 and LLAMAFILE Q4_K/Q8_0, in every kt-kernel CPU variant this host runs (KT_KERNEL_CPU_VARIANT), "
        "each in its own process; no GPU",
    )
    parser.add_argument(
        "--repeats", type=int, default=1, help="with --cpu-methods: rounds over all variants (each row keeps its best)"
    )
    parser.add_argument(
        "--plugin-table",
        metavar="PATH",
        help="with --cpu-methods: also write the reduced table the plugin ships (KT_METHOD=auto, doctor read it)",
    )
    parser.add_argument("--load-input-len", type=int, default=128, help="--load: prompt tokens")
    parser.add_argument("--load-output-len", type=int, default=16, help="--load: new tokens per request")


def run_cpu_methods(args: argparse.Namespace) -> int:
    """--cpu-methods: the method table of this host's CPU variants (``bench.cpu_methods``)."""
    from vllm_kt_tools.bench.cpu_methods import format_table, measure, plugin_table

    report = measure(Path(args.workdir).expanduser() / "cpu-methods", timeout_s=args.timeout, repeats=args.repeats)
    report["command"] = "vllm-kt bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(format_table(report))
    print(f"[bench] written to {out}")
    if args.plugin_table:
        Path(args.plugin_table).write_text(json.dumps(plugin_table(report, str(out)), indent=2) + "\n")
        print(f"[bench] plugin table written to {args.plugin_table}")
    return 0 if all("methods" in r for r in report["variants"].values()) else 1


def run(args: argparse.Namespace) -> int:
    if args.cpu_methods:
        return run_cpu_methods(args)
    process_groups.install_handlers()  # SIGTERM/SIGINT/exit stop every system's process group
    report = run_sitting(args)
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2))
    if args.layer_only:
        return 0 if "error" not in report["split_curve" if args.split_curve else "layer_benchmark"] else 1
    if args.prepare_only or args.sweep_only:
        return 0
    # a load or server-engine sitting fills only its own runs
    runs = (
        report["server_engine"]["runs"]
        if args.server_engine
        else report["load"]["runs"]
        if args.load
        else report["runs"]
    )
    failed = [r for r in runs if "error" in r or r.get("failed", 0) > 0 or r.get("completed", 1) == 0]
    return 0 if runs and not failed else 1


def workload_info(args: argparse.Namespace) -> dict[str, Any]:
    """The workload every system of the sitting runs (bench/routing.py says why it samples),
    with the distinct experts per layer per step that independent tokens would touch."""
    from vllm_kt_tools.bench.routing import COUNTED_TOKENS, TEMPERATURE, expected_distinct

    info: dict[str, Any] = {
        "temperature": TEMPERATURE,
        "engine_seed": 0,
        "decode_tokens": args.decode_tokens,
        "decode_repeats": args.decode_repeats,
    }
    if not args.model:
        config = SHAPES[args.shape]
        experts, top_k = config["num_experts"], config["num_experts_per_tok"]
        info["expected_distinct_experts"] = {
            f"bs{n}": round(expected_distinct(experts, top_k, n), 2) for n in COUNTED_TOKENS
        }
    return info


def record_prefetch_sweep(report: dict[str, Any]) -> None:
    """The prefetch offloader's sweep: its points, their figures and the one chosen
    (``peers.best_prefetch``), which the load stage then runs (--prefetch-sweep G:S)."""
    points = [r for r in report["runs"] if r["system"] == "vllm-prefetch"]
    if not points:
        return
    keys = ("variant", "engine_args", "configured_gpu_weight_gb", "decode_bs1_tok_s", "decode_bs16_tok_s")
    best = best_prefetch(points)
    report["prefetch_sweep"] = {
        "points": [{key: r.get(key) for key in keys} for r in points],
        "chosen": best["variant"] if best else None,
        "criterion": "highest decode_bs16_tok_s, then decode_bs1_tok_s",
    }
