"""What a user gets from a non-editable install: a built wheel carries the presets of
configs/ (as vllm_kt_plugin.configs), and KT_CONFIG=<name> resolves from the install."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, vllm_kt_plugin
from vllm_kt_plugin.settings.loader import load_settings
settings = load_settings({"KT_CONFIG": "qwen3-30b-a3b", "KT_GPU_MEMORY_GB": "48"}, cores=16, numa_nodes=1)
print(json.dumps({"package": vllm_kt_plugin.__file__, "preset": settings.preset,
                  "method": settings.method, "gpu_experts": settings.num_gpu_experts}))
"""


def test_wheel_carries_the_presets_and_kt_config_resolves_from_it(tmp_path: Path) -> None:
    source = tmp_path / "src"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for folder in ("configs", "vllm_kt_plugin", "vllm_kt_tools"):
        shutil.copytree(ROOT / folder, source / folder, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(source)],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("vllm_kt_plugin-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert {f"vllm_kt_plugin/configs/{name}" for name in presets} <= names, sorted(names)

    target = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}
    # Run outside the checkout, so that only the installed copy can be imported.
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["package"].startswith(str(target)), found
    assert found["preset"] == str(target / "vllm_kt_plugin" / "configs" / "qwen3-30b-a3b.yaml"), found
    assert (found["method"], found["gpu_experts"]) == ("BF16", 75), found


def test_every_package_of_the_tree_is_listed_for_the_build() -> None:
    """pyproject.toml lists the packages by hand (configs/ is mapped in from the top of the
    tree); a new subpackage missing there would be left out of wheels."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    in_tree = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for package in ("vllm_kt_plugin", "vllm_kt_tools")
        for init in (ROOT / package).rglob("__init__.py")
    }
    assert listed == in_tree | {"vllm_kt_plugin.configs"}
