"""model_check.vision_shim: torchvision's import needs its two op schemas, which the hook
defines first (pure logic; the real torchvision import is the model check's, --torchvision)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm_kt_tools.model_check import vision_shim

_PROBE = """
import sys, torch
sys.modules.pop("torchvision", None)
{setup}
import torchvision  # the fake package below: asks for the schema as torchvision's import does
print("defined", hasattr(torch.ops.torchvision, "nms") and hasattr(torch.ops.torchvision, "qnms"))
"""


def _fake_torchvision(tmp_path: Path) -> Path:
    # torchvision's _meta_registrations: register_fake("torchvision::nms") raises without the schema
    package = tmp_path / "torchvision"
    package.mkdir()
    (package / "__init__.py").write_text(
        "import torch\n"
        "torch.library.register_fake('torchvision::nms')(lambda dets, scores, iou_threshold: dets.new_empty(0))\n"
    )
    return tmp_path


def _run(tmp_path: Path, setup: str) -> subprocess.CompletedProcess[str]:
    code = _PROBE.format(setup=setup)
    return subprocess.run([sys.executable, "-c", code], cwd=_fake_torchvision(tmp_path), capture_output=True, text=True)


def test_without_the_hook_torchvisions_import_fails(tmp_path: Path) -> None:
    done = _run(tmp_path, "")
    assert done.returncode != 0
    assert "torchvision::nms" in done.stderr


def test_the_hook_defines_the_schemas_before_torchvision_imports(tmp_path: Path) -> None:
    done = _run(tmp_path, "from vllm_kt_tools.model_check.vision_shim import install_hook; install_hook()")
    assert done.returncode == 0, done.stderr
    assert "defined True" in done.stdout


def test_the_engines_sitecustomize_installs_the_hook(tmp_path: Path) -> None:
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(vision_shim._SITECUSTOMIZE)
    done = _run(tmp_path, f"sys.path.insert(0, {str(shim)!r}); import sitecustomize")
    assert done.returncode == 0, done.stderr
    assert "defined True" in done.stdout
