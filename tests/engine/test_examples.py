"""The examples in examples/ run as documented."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from kt_testing.engines import clean_env

pytestmark = pytest.mark.engine
ROOT = Path(__file__).resolve().parents[2]


def test_offline_llm_example(tiny_model) -> None:
    model = tiny_model("qwen3_moe")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "offline_llm.py"), str(model)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "-> 'Paris is the capital of France.'" in proc.stdout, proc.stdout
