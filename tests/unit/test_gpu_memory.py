"""Has the GPU's memory come back before the next system starts (issue 37)? The decision,
from nvidia-smi's CSV as it prints it (texts below in its format: `--format=csv,noheader,nounits`)."""

from __future__ import annotations

import pytest

from vllm_kt_tools.support import gpu_memory
from vllm_kt_tools.support.gpu_memory import Gpu, not_free, parse_gpus, parse_processes

# an H100 after the 2026-12-06 sitting's stopped bench: its engine core lived on
GPUS_BUSY = "0, NVIDIA H100 80GB HBM3, 74561, 81559\n"
APPS_BUSY = "48211, VLLM::EngineCore, 72700\n"
GPUS_IDLE = "0, NVIDIA H100 80GB HBM3, 1, 81559\n"


def test_parses_nvidia_smis_csv() -> None:
    assert parse_gpus(GPUS_BUSY + "1, NVIDIA H200, 0, 143771\n") == [
        Gpu(0, "NVIDIA H100 80GB HBM3", 74561, 81559),
        Gpu(1, "NVIDIA H200", 0, 143771),
    ]
    processes = parse_processes(APPS_BUSY + "77, python3 -c x, y, [N/A]\n\n")
    assert [(p.pid, p.name, p.used_mib) for p in processes] == [
        (48211, "VLLM::EngineCore", 72700),
        (77, "python3 -c x, y", None),  # a name with commas; memory a container may not see
    ]
    assert parse_processes("") == [] and parse_processes("No running processes found\n") == []


def test_an_orphan_holding_memory_is_named_in_one_line() -> None:
    why = not_free(parse_gpus(GPUS_BUSY), parse_processes(APPS_BUSY), own_pid=1)
    assert why == "GPU 0 74,561 of 81,559 MiB in use: pid 48211 VLLM::EngineCore holds 72,700 MiB"
    assert "\n" not in why


def test_a_free_gpu_and_the_other_ways_it_is_not() -> None:
    """Memory decides (a container may list no pid, or another namespace's); the process list
    names who holds it."""
    idle = parse_gpus(GPUS_IDLE)
    assert not_free(idle, [], own_pid=1) is None
    # a stray CUDA context or a small process is no leftover system
    assert not_free(parse_gpus("0, NVIDIA H100 80GB HBM3, 600, 81559\n"), parse_processes("9, x, 500\n"), 1) is None
    # memory in use that no listed process holds (another container's, a leak)
    assert not_free(parse_gpus(GPUS_BUSY), [], own_pid=1).endswith(
        "(idle is at most 2,048 MiB), by no process nvidia-smi lists"
    )
    several = parse_processes("9, python3, 40000\n8, other, 300\n")
    assert not_free(parse_gpus(GPUS_BUSY), several, own_pid=1).endswith(
        "pid 9 python3 holds 40,000 MiB and 1 more process(es)"
    )
    # the benchmark's own CUDA context holding it: said so
    mine = parse_processes("4242, python3, 70000\n")
    assert "this benchmark's own process" in not_free(parse_gpus(GPUS_BUSY), mine, own_pid=4242)


def test_the_bench_stops_with_that_line_after_its_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait polls nvidia-smi until the GPU is free; past it the benchmark stops (SystemExit
    with the line); a host without nvidia-smi (this one) passes at once."""
    answers = [(parse_gpus(GPUS_BUSY), parse_processes(APPS_BUSY))] * 2 + [(parse_gpus(GPUS_IDLE), [])]
    monkeypatch.setattr(gpu_memory, "query", lambda: answers.pop(0))
    monkeypatch.setattr(gpu_memory.time, "sleep", lambda s: None)
    gpu_memory.wait_until_free("kt-hybrid-amxint4", wait_s=60)
    assert answers == []  # it waited through two busy answers
    monkeypatch.setattr(gpu_memory, "query", lambda: (parse_gpus(GPUS_BUSY), parse_processes(APPS_BUSY)))
    with pytest.raises(SystemExit, match=r"before sglang-kt-mirror after 0 s: .* pid 48211 VLLM::EngineCore"):
        gpu_memory.wait_until_free("sglang-kt-mirror", wait_s=0)
    monkeypatch.setattr(gpu_memory, "query", lambda: None)
    gpu_memory.wait_until_free("anything", wait_s=0)
