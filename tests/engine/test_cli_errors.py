"""A mistake in a KT_* variable stops `vllm serve` before any weight is loaded, with a
line naming the variable, the value and what is allowed."""

from __future__ import annotations

import subprocess

import pytest
from support.engines import clean_env

from vllm_kt_plugin.support.server import vllm_command

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    "variable,value,expected",
    [
        ("KT_NUM_GPU_EXPERTS", "99", "KT_NUM_GPU_EXPERTS='99' is invalid (the model has 8 routed experts per layer)"),
        ("KT_CPUINFER", "many", "KT_CPUINFER='many' is invalid (not an integer); allowed: a positive integer"),
        ("KT_BACKEND", "cuda", "KT_BACKEND='cuda' is invalid"),
    ],
)
def test_vllm_serve_stops_with_one_clear_line(tiny_model, variable: str, value: str, expected: str) -> None:
    model = tiny_model("qwen3_moe")
    proc = subprocess.run(
        [*vllm_command(), "serve", str(model), "--quantization", "kt-hybrid"],
        capture_output=True,
        text=True,
        env=clean_env(**{variable: value}),
        timeout=600,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    error_lines = [line for line in output.splitlines() if "ERROR" in line and "kt-hybrid: " in line]
    assert error_lines and expected in error_lines[0], output[-3000:]
    assert "Loading weights" not in output and "EngineCore" not in output
