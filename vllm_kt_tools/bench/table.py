"""The README's benchmark table, written from a sitting's JSON and nothing else, so that no
figure in it is typed by hand (``python -m vllm_kt_tools.bench.table RESULT.json``; a unit
test keeps the README's table equal to this output for the JSON it names).

One row per engine run (and per server run of ``--server-engine``), in the JSON's order;
a figure the run did not measure is "n/a", a run that failed says so (unless a later run of
the same system and variant measured it: the sitting's retry). Below them, where the
sitting recorded them, the decode limit of the host's memory bandwidth and bare kt-kernel's
own rate, so that the engine figures are read against both."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vllm_kt_tools.bench.report import kernel_alone_tok_s, sitting_runs

SYSTEM_NAMES = {
    "vllm-gpu": "vLLM, all on GPU",
    "vllm-offload": "vLLM `--cpu-offload-gb`",
    "vllm-offload-experts": "vLLM `--cpu-offload-gb --cpu-offload-params experts`",
    "vllm-prefetch": "vLLM prefetch offloader, experts",
    "kt-hybrid": "kt-hybrid",
    "sglang-kt": "sglang-kt",
}

# (column, the run's key, unit, digits after the point)
COLUMNS = (
    ("decode, batch 1", "decode_bs1_tok_s", "tok/s", 1),
    ("decode, batch 16", "decode_bs16_tok_s", "tok/s", 1),
    ("prefill, 8 × 1,024", "prefill_tok_s", "tok/s", 0),
    ("first token, one 1,024-token prompt", "ttft_one_prompt_s", "s", 3),
    ("one 16,384-token prompt", "prefill_long_tok_s", "tok/s", 0),
)


def _number(value: float, digits: int) -> str:
    """Thousands apart by a space, as the docs write them."""
    return f"{value:,.{digits}f}".replace(",", " ")


def _system(run: dict[str, Any]) -> str:
    name = SYSTEM_NAMES.get(run["system"], run["system"])
    if run["system"] in ("kt-hybrid", "sglang-kt"):
        name += f" {run['method']}"
    if run.get("variant"):
        name += f" ({run['variant']})"
    if run.get("via") == "server":
        name += ", through its server"
    return name


def _cells(run: dict[str, Any]) -> list[str]:
    weights = run.get("gpu_weight_gb")
    cells = [_system(run), f"{weights:.1f} GiB" if weights else "n/a"]
    for _, key, unit, digits in COLUMNS:
        value = run.get(key)
        cells.append(f"{_number(value, digits)} {unit}" if value else "n/a")
    load = run.get("load") or {}  # --server-engine --load: the load against the same server
    served = load.get("output_throughput")
    cells.append(f"{_number(served, 1)} tok/s ({load['prompts']} at {load['concurrency']})" if served else "n/a")
    routing = (run.get("routing") or {}).get("bs16") or {}
    measured = routing.get("measured_distinct_per_layer_step")
    cells.append(f"{measured:.1f} of {routing['expected_independent']:.1f}" if measured else "n/a")
    if "error" in run:
        cells[0] += " (failed: see the JSON)"
    return cells


def _decode_row(name: str, bs1: float | None, bs16: float | None) -> list[str]:
    """A row with decode figures only (the host's own figures beside the runs')."""
    decode = [f"{_number(v, 1)} tok/s" if v else "n/a" for v in (bs1, bs16)]
    return [name, "—", *decode, *("—" for _ in COLUMNS[2:]), "—", "—"]


def _host_rows(report: dict[str, Any]) -> list[list[str]]:
    """The sitting's host figures beside its runs: the decode limit its memory bandwidth
    implies (bench/memory_bandwidth.py) and bare kt-kernel's own rate (the kernel sweep: not a
    bound; old JSONs name it decode_bound_tok_s)."""
    rows = []
    for method, limit in report.get("decode_limit", {}).items():
        name = f"memory-bandwidth limit, {method} ({limit['read_gb_s']:.0f} GB/s read)"
        rows.append(_decode_row(name, limit["bs1"]["tok_s"], limit["bs16"]["tok_s"]))
    for method, sweep in report.get("kernel_sweep", {}).items():
        tokens = sweep.get("tokens", {})
        rates = [kernel_alone_tok_s(tokens[n]) if n in tokens else None for n in ("1", "16")]
        rows.append(_decode_row(f"bare kt-kernel alone, {method} (kernel sweep)", *rates))
    return rows


def _retried(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The runs less each failed one that a later run of the same system, method and variant
    measured (a sitting's retry, ``--append``); the JSON keeps both."""
    key = lambda run: (run["system"], run.get("method"), run.get("variant"))  # noqa: E731
    return [
        run
        for i, run in enumerate(runs)
        if "error" not in run or not any(key(later) == key(run) and "error" not in later for later in runs[i + 1 :])
    ]


def _rows(report: dict[str, Any]) -> list[list[str]]:
    return [*(_cells(run) for run in _retried(sitting_runs(report))), *_host_rows(report)]


def _table(rows: list[list[str]]) -> str:
    header = [
        "system",
        "GPU weights",
        *(column for column, *_ in COLUMNS),
        "load, output",
        "experts per layer, batch 16",
    ]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def markdown_table(report: dict[str, Any]) -> str:
    """The table of every run in ``report`` (engine runs, then server runs), then the host's
    decode limit and kernel rate where the sitting recorded them."""
    return _table(_rows(report))


def table_of(paths: list[Path]) -> str:
    """The table of these sittings' JSON files, in turn."""
    return _table([row for path in paths for row in _rows(json.loads(path.read_text()))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="a sitting's JSON (several: their runs in turn)")
    print(table_of(parser.parse_args().results), end="")


if __name__ == "__main__":
    main()
