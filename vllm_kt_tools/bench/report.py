"""The report of ``vllm-kt bench``: the JSON file, its PNG chart, and the figures read off
the runs (the best kt-hybrid run, kt-kernel's thread count from its log). Nothing here
asserts a speed: the numbers are for people to read."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

# The kernel sweep's rate of bare kt-kernel through all layers (bench/kernel_sweep.py), and
# its name in JSON files before 2026-12-07, when it was misread as a bound
KERNEL_ALONE_KEY = "kernel_alone_tok_s"
OLD_KERNEL_ALONE_KEY = "decode_bound_tok_s"


def kernel_alone_tok_s(timing: dict[str, Any]) -> float | None:
    """One kernel-sweep entry's rate, under its name of any sitting."""
    return timing.get(KERNEL_ALONE_KEY, timing.get(OLD_KERNEL_ALONE_KEY))


def write_chart(report: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no chart", flush=True)
        return False
    runs = [r for r in report["runs"] if "error" not in r and not r.get("enforce_eager")]
    labels = [f"{r['system']}\n{r['method']} {r.get('variant', '')}\n{_weights_gb(r)} GiB" for r in runs]
    metrics = [
        ("decode_bs1_tok_s", "decode, batch 1"),
        ("decode_bs16_tok_s", "decode, batch 16"),
        ("prefill_tok_s", "prefill, 8 x 1,024 tokens"),
        ("prefill_long_tok_s", "prefill, one 16,384-token prompt"),
    ]
    fig, axes = plt.subplots(1, len(metrics), figsize=(20, 4.5))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        values = [r.get(key) or 0 for r in runs]  # a missing measurement shows as "n/a"
        bars = ax.bar(range(len(runs)), values, color=[_color(r["system"]) for r in runs])
        ax.bar_label(bars, labels=[f"{v:.0f}" if v else "n/a" for v in values], fontsize=8)
        ax.set_xticks(range(len(runs)), labels, fontsize=7)
        ax.set_title(f"{title} (tok/s)")
        ax.set_yscale("log")
        limits = _decode_limits(report, key)
        for method, limit in limits:  # what the host's memory bandwidth allows (bench/memory_bandwidth.py)
            ax.axhline(limit, color="black", linestyle="--", linewidth=0.8)
            ax.annotate(f"{method} memory limit {limit:.0f}", (0, limit), fontsize=7, va="bottom")
        values += [limit for _, limit in limits]
        if any(values):  # at least a decade, from below: bars of close values look close
            ax.set_ylim(min(min(v for v in values if v), max(values) / 10) / 2, max(values) * 2)
    fig.suptitle(f"{report['model']} on {report['host'].get('gpu', 'GPU')}: tokens/s (log scale)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def _decode_limits(report: dict[str, Any], key: str) -> list[tuple[str, float]]:
    """The host's decode limits (``decode_limit``: bench/memory_bandwidth.py) for a chart
    panel: decode_bs1_tok_s reads bs1; the prefill panels have none."""
    batch = key.removeprefix("decode_").removesuffix("_tok_s")
    return [
        (method, limit[batch]["tok_s"]) for method, limit in report.get("decode_limit", {}).items() if batch in limit
    ]


def _weights_gb(run: dict[str, Any]) -> float:
    return run["gpu_weight_gb"] or run["configured_gpu_weight_gb"]


def _color(system: str) -> str:
    return {"vllm-gpu": "#4c72b0", "vllm-offload": "#c44e52", "kt-hybrid": "#55a868"}.get(system, "gray")


def best_hybrid(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [
        r
        for r in runs
        if r["system"] == "kt-hybrid" and "error" not in r and not r.get("enforce_eager") and not r.get("variant")
    ]
    return max(ok, key=lambda r: r["decode_bs1_tok_s"] or 0.0, default=None)


def threads_from_log(path: Path) -> int | None:
    if not path.exists():
        return None
    found = re.findall(r"with (\d+) threads", path.read_text(errors="replace"))
    return int(found[0]) if found else None


def save(report: dict[str, Any], out: Path) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    if report["runs"]:
        write_chart(report, out.with_suffix(".png"))


METRICS_LINE = re.compile(
    r"kt-hybrid metrics: .*?(\d+) layer forwards: per layer forward CPU experts \(submit to result\) ([\d.]+) ms, "
    r"GPU experts ([\d.]+) ms, waiting on the CPU ([\d.]+) ms .*?, ([\d.]+) tokens/forward\)"
)

LARGE_FORWARD_LINE = re.compile(r"kt-hybrid: a forward of (\d+) tokens takes the (\S+) path \(queued at ([\d.]+) s")


def large_forwards(log_text: str) -> list[list[Any]]:
    """KT_METRICS_INTERVAL's prefill-sized forwards in an engine log, in order: [tokens, path,
    seconds since the one before was queued] — how the engine split each batch of prompts into
    steps (the first is vLLM's profiling forward at start-up). Queue times, not run times:
    vLLM may queue a step before the one before has run."""
    found = [(int(tokens), path, float(at)) for tokens, path, at in LARGE_FORWARD_LINE.findall(log_text)]
    return [[tokens, path, round(at - (found[i - 1][2] if i else at), 3)] for i, (tokens, path, at) in enumerate(found)]


def layer_metrics(log_text: str) -> dict[str, dict[str, float]]:
    """KT_METRICS_INTERVAL's lines in an engine log, by batch: the per-layer-forward CPU
    experts / GPU experts / wait times (a line per batch size and window, weighted by their
    forwards; the line of the sizes beyond the clock's slots has a mixed mean, left out unless
    it happens to be whole). Where decode time goes, per layer, at default settings."""
    sums: dict[str, list[float]] = {}
    for forwards, cpu, gpu, wait, tokens in METRICS_LINE.findall(log_text):
        if float(tokens) != int(float(tokens)):
            continue  # a window that mixed batch sizes
        n = int(forwards)
        acc = sums.setdefault(str(int(float(tokens))), [0.0, 0.0, 0.0, 0, 0])
        acc[0] += n * float(cpu)
        acc[1] += n * float(gpu)
        acc[2] += n * float(wait)
        acc[3] += n
        acc[4] += 1
    return {
        batch: {
            "cpu_experts_ms": round(cpu / n, 4),
            "gpu_experts_ms": round(gpu / n, 4),
            "cpu_wait_ms": round(wait / n, 4),
            "layer_forwards": int(n),
            "windows": int(windows),
        }
        for batch, (cpu, gpu, wait, n, windows) in sorted(sums.items(), key=lambda item: int(item[0]))
    }


def run_label(run: dict[str, Any]) -> str:
    """A run's name in tables and charts: system, method and variant (two runs of one method
    differ only by their variant)."""
    return " ".join(part for part in (run["system"], run.get("method") or "", run.get("variant") or "") if part)


def sitting_time(path: Path) -> float:
    """When a result file was committed (git), else written (mtime): results carry no date."""
    import subprocess

    try:
        out = subprocess.run(
            ["git", "log", "-1", "--format=%ct", "--", path.name],
            cwd=path.parent,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return float(out) if out else path.stat().st_mtime


def sitting_runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """A sitting's measured runs: its engine runs, then its server runs (``--server-engine``)."""
    return [*report.get("runs", []), *report.get("server_engine", {}).get("runs", [])]


def newest_sitting(results: Path) -> Path:
    """The newest ``vllm-kt bench`` result with decode figures (engine or server runs) in ``results``."""
    sittings = []
    for path in results.glob("*.json"):
        if any("decode_bs1_tok_s" in r for r in sitting_runs(json.loads(path.read_text()))):
            sittings.append((sitting_time(path), path.name, path))
    if not sittings:
        raise FileNotFoundError(f"no engine or server benchmark results in {results}")
    return max(sittings)[2]
