"""What a user gets from a non-editable install: the built wheel holds every file the
packages read relative to themselves (the presets of configs/ as vllm_kt_plugin.configs,
the method table, ...: found in the source by tests/kt_testing/wheel_reads.py), KT_CONFIG
and the method table resolve from the install, and the tools that need a source checkout
say so in one line. tests/engine/test_wheel_install.py serves from such an install."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from kt_testing.wheel_reads import module_reads, not_in_wheel, package_reads

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import json, vllm_kt_plugin
from vllm_kt_plugin.settings.loader import load_settings
from vllm_kt_plugin.cpu_backends.kt_kernel.method_speeds import measured_table
settings = load_settings({"KT_CONFIG": "qwen3-30b-a3b", "KT_GPU_MEMORY_GB": "48"}, cores=16, numa_nodes=1)
print(json.dumps({"package": vllm_kt_plugin.__file__, "preset": settings.preset,
                  "method": settings.method, "gpu_experts": settings.num_gpu_experts,
                  "table_variants": sorted(measured_table()["variants"])}))
"""
BUILD_INPUTS = ("pyproject.toml", "README.md", "configs", "vllm_kt_plugin", "vllm_kt_tools")


def copy_source(destination: Path) -> Path:
    """What the build reads of the checkout, copied (a build leaves build/ and *.egg-info)."""
    destination.mkdir(parents=True)
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, destination / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, destination / name)
    return destination


def build_wheel(source: Path, out: Path) -> Path:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", "--no-deps"]
    subprocess.run([*command, "--no-build-isolation", "-w", str(out), str(source)], check=True, timeout=300)
    (wheel,) = out.glob("vllm_kt_plugin-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    return build_wheel(copy_source(tmp / "src"), tmp / "dist")


@pytest.fixture(scope="module")
def installed(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The wheel installed non-editably into a folder of its own; the environment and
    folder (outside the checkout) to run Python in, where only the installed copy imports."""
    target = tmp_path_factory.mktemp("site")
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, timeout=300)
    return target, {**os.environ, "PYTHONPATH": str(target)}


def test_wheel_carries_the_presets_and_kt_config_resolves_from_it(wheel: Path, installed) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    presets = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert {f"vllm_kt_plugin/configs/{name}" for name in presets} <= names, sorted(names)

    target, env = installed
    probe = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=target.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    assert found["package"].startswith(str(target)), found
    assert found["preset"] == str(target / "vllm_kt_plugin" / "configs" / "qwen3-30b-a3b.yaml"), found
    assert (found["method"], found["gpu_experts"]) == ("BF16", 75), found
    assert "avx2" in found["table_variants"], found  # KT_METHOD=auto's table, read from the install


def test_every_file_the_packages_read_is_in_the_wheel(wheel: Path) -> None:
    """Files read relative to a module or package (``__file__``, importlib.resources) of
    either package: each is in the built wheel. A new one fails here until pyproject.toml's
    package-data lists it, or it goes through vllm_kt_plugin/source_checkout.py (a file of
    the source checkout, for tooling that says it needs one)."""
    reads = package_reads(ROOT)
    targets = {read.target for read in reads}
    # the two known ones are found (the check is not blind to them)
    assert {"vllm_kt_plugin/cpu_backends/kt_kernel/method_speeds.json", "vllm_kt_plugin/configs"} <= targets, reads
    missing = not_in_wheel(reads, zipfile.ZipFile(wheel).namelist())
    assert not missing, "read by the package, missing from its wheel:\n" + "\n".join(map(str, missing))


def test_the_check_finds_an_unpackaged_read(tmp_path: Path) -> None:
    """Deliberately unpackaged: the method table left out of package data, and a new
    module reading a data file beside it: a real build leaves both out, and the check
    names both (and a path it cannot work out)."""
    source = copy_source(tmp_path / "src")
    pyproject = source / "pyproject.toml"
    text = pyproject.read_text()
    data_line = '"vllm_kt_plugin.cpu_backends.kt_kernel" = ["method_speeds.json"]\n'
    assert data_line in text
    pyproject.write_text(text.replace(data_line, ""))
    module = source / "vllm_kt_tools" / "support" / "extra_read.py"
    module.write_text(
        "from pathlib import Path\n\n"
        "EXTRA = Path(__file__).with_name('extra.json')\n\n\n"
        "def read(name: str) -> str:\n"
        "    return EXTRA.read_text() + (Path(__file__).parent / name).read_text()\n"
    )
    (source / "vllm_kt_tools" / "support" / "extra.json").write_text("{}")
    names = zipfile.ZipFile(build_wheel(source, tmp_path / "dist")).namelist()
    assert "vllm_kt_tools/support/extra_read.py" in names

    missing = not_in_wheel(package_reads(source), names)
    print("\n".join(map(str, missing)))  # what the check says
    assert {(read.module, read.target) for read in missing} == {
        (
            "vllm_kt_plugin/cpu_backends/kt_kernel/method_speeds.py",
            "vllm_kt_plugin/cpu_backends/kt_kernel/method_speeds.json",
        ),
        ("vllm_kt_tools/support/extra_read.py", "vllm_kt_tools/support/extra.json"),
        ("vllm_kt_tools/support/extra_read.py", None),  # Path(__file__).parent / name: cannot be checked
    }, missing


def test_reads_relative_to_a_module_are_worked_out() -> None:
    source = (
        "import importlib.resources, os\nfrom pathlib import Path\n"
        "HERE = Path(__file__).resolve().parent\n"
        "a = HERE / 'a.json'\n"
        "b = os.path.join(os.path.dirname(__file__), 'c', 'd.bin')\n"
        "c = importlib.resources.files(__package__).joinpath('e.yaml')\n"
        "d = importlib.resources.files('pkg.data') / 'f.txt'\n"
        "e = Path(__file__).resolve().parents[2] / 'README.md'\n"
    )
    reads = {read.code: read.target for read in module_reads("pkg/sub/mod.py", source)}
    assert reads == {
        "Path(__file__).resolve().parent": "pkg/sub",
        "HERE / 'a.json'": "pkg/sub/a.json",
        "os.path.join(os.path.dirname(__file__), 'c', 'd.bin')": "pkg/sub/c/d.bin",
        "importlib.resources.files(__package__).joinpath('e.yaml')": "pkg/sub/e.yaml",
        "importlib.resources.files('pkg.data') / 'f.txt'": "pkg/data/f.txt",
        "Path(__file__).resolve().parents[2] / 'README.md'": "README.md",  # the wheel's top: not package data
    }, reads


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "vllm_kt_tools.support.settings_doc"],
        ["-m", "vllm_kt_tools.bench.cpu_methods", "benchmarks/results/cpu_methods_xeon_amx_2core.json"],
    ],
)
def test_tools_that_read_the_checkout_say_so_from_a_wheel(installed, command: list[str]) -> None:
    target, env = installed
    proc = subprocess.run(
        [sys.executable, *command], cwd=target.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert f"python {' '.join(command[:2])} needs a source checkout of vllm-kt-plugin" in line, line


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
