"""The README's benchmark table, written from a sitting's JSON and nothing else, so that no
figure in it is typed by hand (``python -m vllm_kt_tools.bench.table RESULT.json``; a unit
test keeps the README's table equal to this output for the JSON it names).

One row per engine run (and per server run of ``--server-engine``), in the JSON's order;
a figure the run did not measure is "n/a", a run that failed says so."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

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
    routing = (run.get("routing") or {}).get("bs16") or {}
    measured = routing.get("measured_distinct_per_layer_step")
    cells.append(f"{measured:.1f} of {routing['expected_independent']:.1f}" if measured else "n/a")
    if "error" in run:
        cells[0] += " (failed: see the JSON)"
    return cells


def _runs(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Engine runs, then server runs."""
    return [*report.get("runs", []), *report.get("server_engine", {}).get("runs", [])]


def markdown_table(report: dict[str, Any]) -> str:
    """The table of every run in ``report`` (engine runs, then server runs)."""
    header = ["system", "GPU weights", *(column for column, *_ in COLUMNS), "experts per layer, batch 16"]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(_cells(run)) + " |" for run in _runs(report)]
    return "\n".join(lines) + "\n"


def table_of(paths: list[Path]) -> str:
    """The table of the runs of these sittings' JSON files, in turn."""
    return markdown_table({"runs": [run for path in paths for run in _runs(json.loads(path.read_text()))]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, nargs="+", help="a sitting's JSON (several: their runs in turn)")
    print(table_of(parser.parse_args().results), end="")


if __name__ == "__main__":
    main()
