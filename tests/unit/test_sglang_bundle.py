"""sglang-kt's package set (issue 37): the check that fails, before anything is carried, when
the set lacks ``sgl_kernel/sm90/common_ops.abi3.so``, one of the five payload modules, or a
module the server imports (both ways the 2026-12-06 sitting's sglang-kt failed to start).
On small synthetic wheels laid out as the real ones, then on the real download where this
machine has it (~/.cache/sglbundle/full)."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from vllm_kt_tools.bench.sglang_bundle import (
    Strength,
    check,
    imports_of,
    plan,
    wheels_in,
)

PAYLOADS = (
    ("kt_kernel", "sgl_kernel_kt_payload_core"),
    ("transformers_kt", "transformers_kt_sgl_kernel_payload"),
    ("sglang_kt", "sglang_kt_sgl_kernel_payload"),
    ("ktransformers", "ktransformers_sgl_kernel_payload"),
    ("accelerate_kt", "accelerate_kt_sgl_kernel_payload"),
)
SM90 = "sgl_kernel/sm90/common_ops.abi3.so"
ROOTS = ("sglang.launch_server", "kt_kernel", "sgl_kernel")

LAUNCH_SERVER = """
import os
from sglang.utils import helper

def run_server():
    from sglang.srt.http_server import launch  # a function's: lazy

if __name__ == "__main__":
    import uvicorn  # runs: the server starts as python -m sglang.launch_server
"""
UTILS = """
from typing import TYPE_CHECKING
from contextlib import suppress
import IPython
try:
    import ujson
except ImportError:
    ujson = None
with suppress(ImportError):
    import fqdn
if TYPE_CHECKING:
    import mypy_only
if _is_npu:
    import torch_npu  # another platform's: no wheel of the download has it
if get_bool_env_var("SGLANG_USE_MODELSCOPE"):
    from modelscope import AutoConfig
import torch._C._nn  # inside an extension module: its own business

def helper():
    import decord  # lazy: only multimodal inputs call it
"""


KT_KERNEL_INIT = "import sys\nsys.modules['kt_kernel_ext'] = object()\nfrom kt_kernel import utils\n"


def payload(module: str) -> bytes:
    return f"part of {module}\n".encode()


def wheel(folder: Path, dist: str, files: dict[str, bytes | str], version: str = "1.0") -> Path:
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist}-{version}.dist-info/METADATA", f"Name: {dist}\n")
    return path


def download(folder: Path) -> Path:
    """A download laid out as ``ktransformers[sglang]==0.7.2``'s: the manifest in kt_kernel's
    wheel, the sm90 ops in ktransformers', one payload part in each of five wheels."""
    folder.mkdir(parents=True, exist_ok=True)
    archive_sha = hashlib.sha256(b"".join(payload(m) for _, m in PAYLOADS)).hexdigest()
    modules = tuple(m for _, m in PAYLOADS)
    manifest = f"VERSION = '0.3.21.post2'\nARCHIVE_SHA256 = {archive_sha!r}\nPAYLOAD_MODULES = {modules!r}\n"
    parts = {dist: {f"{m}/__init__.py": "", f"{m}/payload.part": payload(m)} for dist, m in PAYLOADS}
    wheel(
        folder,
        "kt_kernel",
        {
            "sgl_kernel/__init__.py": "import torch\n",
            "sgl_kernel/_payload_manifest.py": manifest,
            "kt_kernel/__init__.py": KT_KERNEL_INIT,
            "kt_kernel/utils.py": "from kt_kernel_ext import moe  # kt_kernel registered it\n",
            **parts["kt_kernel"],
        },
        "0.7.2",
    )
    wheel(folder, "ktransformers", {SM90: b"\x7fELF", "ktransformers.py": "", **parts["ktransformers"]}, "0.7.2")
    sglang = {"sglang/__init__.py": "", "sglang/launch_server.py": LAUNCH_SERVER, "sglang/utils.py": UTILS}
    wheel(folder, "sglang_kt", {**sglang, **parts["sglang_kt"]}, "0.7.2")
    wheel(folder, "transformers_kt", parts["transformers_kt"])
    wheel(folder, "accelerate_kt", parts["accelerate_kt"])
    wheel(folder, "torch", {"torch/__init__.py": "", "torch/_C.cpython-312-x86_64-linux-gnu.so": b"\x7fELF"})
    for dist, module in (("ipython", "IPython"), ("uvicorn", "uvicorn"), ("modelscope", "modelscope")):
        wheel(folder, dist, {f"{module}/__init__.py": ""})
    wheel(folder, "decord2", {"decord/__init__.py": ""})
    return folder


def without(folder: Path, dist: str) -> Path:
    (path,) = folder.glob(f"{dist}-*.whl")
    path.unlink()
    return folder


def verdict(folder: Path, reference: Path | None = None):  # noqa: ANN201 - the Verdict
    return check(wheels_in(folder), wheels_in(reference) if reference else None, roots=ROOTS)


def test_a_complete_set_passes_and_each_import_has_its_strength(tmp_path: Path) -> None:
    result = verdict(download(tmp_path / "set"))
    assert result.ok, result.failures
    assert result.reach["ipython"] == "required" and result.reach["uvicorn"] == "required"
    assert result.reach["modelscope"] == "conditional" and result.reach["decord2"] == "lazy"
    edges = {edge.target: edge.strength for edge in imports_of(UTILS, "sglang.utils", is_package=False)}
    assert edges["IPython"] == Strength.REQUIRED and edges["torch._C._nn"] == Strength.REQUIRED
    assert edges["ujson"] == edges["fqdn"] == Strength.GUARDED  # try/except ImportError, suppress(ImportError)
    assert edges["torch_npu"] == edges["modelscope"] == Strength.CONDITIONAL
    assert edges["decord"] == Strength.LAZY and "mypy_only" not in edges
    main = {edge.target: edge.strength for edge in imports_of(LAUNCH_SERVER, "sglang.launch_server", False, True)}
    assert main["uvicorn"] == Strength.REQUIRED and main["sglang.srt.http_server"] == Strength.LAZY
    assert "uvicorn" not in {e.target for e in imports_of(LAUNCH_SERVER, "sglang.launch_server", False)}


def test_fails_without_the_sm90_ops(tmp_path: Path) -> None:
    """sglang-kt alone: its wheels have sm100's ops only (the 2026-12-06 failure)."""
    result = verdict(without(download(tmp_path / "set"), "ktransformers"))
    assert f"no wheel carries {SM90}" in result.failures
    assert "payload module ktransformers_sgl_kernel_payload missing" in " ".join(result.failures)


@pytest.mark.parametrize(("dist", "module"), PAYLOADS)
def test_fails_without_any_of_the_five_payload_modules(tmp_path: Path, dist: str, module: str) -> None:
    folder = download(tmp_path / "set")
    if dist == "kt_kernel":  # it also carries the manifest: drop the payload module only
        (path,) = folder.glob("kt_kernel-*.whl")
        with zipfile.ZipFile(path) as archive:
            kept = {n: archive.read(n) for n in archive.namelist() if not n.startswith(module)}
        path.unlink()
        wheel(folder, "kt_kernel", {k: v for k, v in kept.items() if ".dist-info/" not in k}, "0.7.2")
    else:
        (path,) = folder.glob(f"{dist}-*.whl")
        with zipfile.ZipFile(path) as archive:
            kept = {
                n: archive.read(n) for n in archive.namelist() if not n.startswith(module) and ".dist-info/" not in n
            }
        path.unlink()
        wheel(folder, dist, kept, "0.7.2" if dist in ("sglang_kt", "ktransformers") else "1.0")
    assert f"payload module {module} missing (listed by sgl_kernel/_payload_manifest.py)" in verdict(folder).failures


def test_fails_when_the_payload_parts_do_not_make_the_manifests_archive(tmp_path: Path) -> None:
    folder = download(tmp_path / "set")
    without(folder, "accelerate_kt")
    wheel(folder, "accelerate_kt", {"accelerate_kt_sgl_kernel_payload/payload.part": b"another release"})
    assert any("ARCHIVE_SHA256" in f for f in verdict(folder).failures)


@pytest.mark.parametrize(
    ("dist", "line"),
    [
        ("ipython", "IPython: imported by sglang.utils:4 at module level, provided by wheel ipython, left out"),
        ("uvicorn", "uvicorn: imported by sglang.launch_server:9 at module level, provided by wheel uvicorn, left out"),
        (
            "modelscope",
            "modelscope: imported by sglang.utils:16 under a condition, provided by wheel modelscope, left out",
        ),
        ("torch", "torch: imported by sgl_kernel:1 at module level, provided by wheel torch, left out"),
    ],
)
def test_fails_without_a_module_the_server_imports(tmp_path: Path, dist: str, line: str) -> None:
    """A wheel left out that the server imports at module level (IPython: sglang.utils), in the
    entry point's main block, or under a condition the host may meet; named with the line."""
    reference = download(tmp_path / "download")
    folder = without(download(tmp_path / "set"), dist)
    assert line in verdict(folder, reference).failures
    if dist == "ipython":  # without the download to compare with: no wheel of it
        assert "IPython: imported by sglang.utils:4 at module level, provided by no wheel of the download" in (
            verdict(folder).failures
        )


def test_lazy_and_guarded_imports_of_a_left_out_wheel_are_listed_not_failed(tmp_path: Path) -> None:
    reference = download(tmp_path / "download")
    result = verdict(without(download(tmp_path / "set"), "decord2"), reference)
    assert result.ok, result.failures
    assert result.trimmed_optional_users == {"decord2": ["decord (lazy, sglang.utils:20)"]}


def test_fails_on_two_versions_of_one_distribution(tmp_path: Path) -> None:
    folder = download(tmp_path / "set")
    wheel(folder, "uvicorn", {"uvicorn/__init__.py": ""}, "2.0")
    assert "two versions of uvicorn: 1.0 and 2.0" in verdict(folder).failures


REAL = Path(os.environ.get("SGLBUNDLE_CACHE", Path.home() / ".cache/sglbundle/full"))


@pytest.mark.skipif(
    not any(REAL.glob("ktransformers-0.7.2-*.whl")),
    reason=f"no ktransformers[sglang]==0.7.2 download in {REAL} (benchmarks/sglang-bundle.sh says how to fill it)",
)
def test_the_real_package_set(tmp_path: Path) -> None:
    """The download itself: sglang-kt's wheels alone lack the sm90 ops and a payload module;
    the set benchmarks/sglang-bundle.sh carries (its trims left out) passes the whole check,
    IPython among what it keeps. About a minute: the walk reads ~10,000 modules."""
    download_set = wheels_in(REAL)
    alone = [w for w in download_set if w.dist != "ktransformers"]
    failures = check(alone, imports=False).failures
    assert f"no wheel carries {SM90}" in failures
    assert (
        "payload module ktransformers_sgl_kernel_payload missing (listed by sgl_kernel/_payload_manifest.py)"
        in failures
    )
    kept, left_out = plan(REAL)
    assert {w.dist for w in left_out} >= {"torchaudio", "av", "datasets"}
    result = check(kept, download_set)
    assert result.ok, result.failures
    assert result.reach["ipython"] == "required" and result.reach["kt_kernel"] == "required"
    assert result.modules_reached > 5000
