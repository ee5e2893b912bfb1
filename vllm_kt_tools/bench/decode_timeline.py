"""kt-hybrid's decode steps in a bench run (``vllm_kt_plugin.hybrid.decode_timeline``), one
summary per batch size: per layer and per step, the submit, the GPU experts, the wait for the
CPU experts, the rest of the model and what runs outside the MoE layers (sampling, the host's
step), and against the host's memory-bandwidth limit, where the time between the two goes.

``--decode-timeline`` arms it in kt-hybrid's engine or server at start (its stamps must be in
the CUDA graphs); the bench reads it after each batch size's decode runs, through
``collective_rpc`` (``bench/timeline.py``'s ``collect_decode``).
"""

from __future__ import annotations

import statistics
from typing import Any

from vllm_kt_plugin.hybrid.decode_timeline import ARM_VARIABLE

ARMED_ENV = {ARM_VARIABLE: "1"}
COLUMNS = ("submit_ms", "gpu_ms", "wait_ms", "cpu_ms", "rest_ms")


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def summarize(steps: list[dict[str, Any]], batch: int) -> dict[str, Any] | None:
    """The steps of ``batch`` tokens (CUDA graphs pad a batch to its captured size): medians
    per step of each column's sum over the layers, of the step's time and of the time outside
    the MoE layers' span; each layer's median columns. None where no such step was seen."""
    mine = [s for s in steps if s["tokens"] == batch and s["step_ms"] is not None]
    if not mine:
        return None
    sums = {c: [sum(layer[c] or 0.0 for layer in s["layers"]) for s in mine] for c in COLUMNS}
    summary: dict[str, Any] = {
        "steps": len(mine),
        "layers": len(mine[0]["layers"]),
        "step_ms": _median([s["step_ms"] for s in mine]),
        "step_ms_min_max": [min(s["step_ms"] for s in mine), max(s["step_ms"] for s in mine)],
        "outside_ms": _median([s["step_ms"] - s["span_ms"] for s in mine]),
        **{f"sum_{c}": _median(v) for c, v in sums.items()},
        "per_layer": [_layer_medians(mine, i) for i in range(len(mine[0]["layers"]))],
    }
    return summary


def _layer_medians(steps: list[dict[str, Any]], i: int) -> dict[str, Any]:
    """The ``i``-th layer's median columns over ``steps`` (the last layer has no rest)."""
    rows = [s["layers"][i] for s in steps]
    medians = {c: _median([r[c] for r in rows if r[c] is not None]) for c in COLUMNS if rows[0][c] is not None}
    return {"layer": rows[0]["layer"], **medians}


def against_limit(
    summary: dict[str, Any], limit: dict[str, Any], batch: int, kernel_layer_ms: float | None = None
) -> dict[str, Any]:
    """Where the time between the host's limit and the measured step goes (ms per step): the
    limit is one step's read of its distinct CPU experts at the host's bandwidth
    (``memory_bandwidth.decode_limit``). A step is the submits, the GPU experts and the wait
    for the CPU (the CPU side as the GPU's stream sees it), the rest of the model between MoE
    layers and what runs outside them. With bare kt-kernel's own time per layer (the kernel
    sweep, ``kernel_layer_ms``), the CPU side beyond the read splits into kt-kernel's compute
    beyond it and the rest (its threads' wake-up, the sync, GPU work not under the CPU's)."""
    limit_ms = 1e3 * batch / limit[f"bs{batch}"]["tok_s"]
    cpu_side = summary["sum_gpu_ms"] + summary["sum_wait_ms"]
    parts: dict[str, float] = {}
    if kernel_layer_ms is None:
        parts["cpu_side_beyond_read_ms"] = round(cpu_side - limit_ms, 4)
    else:
        kernel_ms = kernel_layer_ms * summary["layers"]
        parts["kt_kernel_beyond_read_ms"] = round(kernel_ms - limit_ms, 4)
        parts["cpu_side_beyond_kt_kernel_ms"] = round(cpu_side - kernel_ms, 4)
    parts.update(
        submit_ms=summary["sum_submit_ms"],
        rest_of_model_ms=summary["sum_rest_ms"],
        outside_moe_layers_ms=summary["outside_ms"],
    )
    step = summary["step_ms"]
    return {
        "limit_step_ms": round(limit_ms, 4),
        "measured_step_ms": step,
        "share_of_limit": round(limit_ms / step, 3),
        "gap_ms": round(step - limit_ms, 4),
        "gap": parts,
        "unexplained_ms": round(step - limit_ms - sum(parts.values()), 4),  # medians do not add up exactly
    }


def add_limits(run: dict[str, Any], report: dict[str, Any]) -> None:
    """A run's decode summaries against the sitting's limit for its method (``decode_limit``)
    and bare kt-kernel's time per layer (``kernel_sweep``, at the sweep's thread count)."""
    method = run.get("method", "")
    limit = report.get("decode_limit", {}).get(method)
    sweep = report.get("kernel_sweep", {}).get(method, {}).get("tokens", {})
    for batch, summary in (run.get("decode_timeline") or {}).items():
        if limit is not None and f"bs{batch}" in limit:
            kernel = sweep.get(batch, {}).get("per_layer_ms")
            summary["against_limit"] = against_limit(summary, limit, int(batch), kernel)


def describe(batch: int, summary: dict[str, Any]) -> str:
    """One line for the bench's log."""
    line = (
        f"decode at batch {batch}: {summary['steps']} steps, {summary['step_ms']:.3f} ms a step: submits "
        f"{summary['sum_submit_ms']:.3f}, GPU experts {summary['sum_gpu_ms']:.3f}, waiting on the CPU "
        f"{summary['sum_wait_ms']:.3f}, rest of the model {summary['sum_rest_ms']:.3f}, outside the MoE layers "
        f"{summary['outside_ms']:.3f}"
    )
    limit = summary.get("against_limit")
    if limit:
        line += f"; the limit's step {limit['limit_step_ms']:.3f} ms ({100 * limit['share_of_limit']:.0f} % of it)"
    return line
