"""The bench's sglang-kt command lines parse with sglang-kt 0.7.2's own flags (copied from its
wheel: tests/kt_testing/sglang_kt_flags.py), so a flag sglang-kt lacks or a value it refuses
fails here, not on the GPU host after minutes of installing."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
from kt_testing.sglang_kt_flags import committed, flags_from_source, parser_from

from vllm_kt_tools.bench.peers import SglangKt, sglang_points, sglang_sweep
from vllm_kt_tools.bench.sglang_bundle import KTRANSFORMERS_VERSION

BASE = SglangKt(model="/work/model", weight_path="/work/experts/AMXINT4-pools1")


def server_args(config: SglangKt) -> list[str]:
    command = config.command(python="python")
    assert command[:3] == ["python", "-m", "sglang.launch_server"]
    return command[3:]


def test_the_flag_copy_is_of_the_sglang_kt_the_bench_installs() -> None:
    """Bumping sglang-kt in the bundle without regenerating the copy fails here."""
    flags = committed()
    assert flags["version"] == KTRANSFORMERS_VERSION, flags["command"]
    bundle_script = (Path(__file__).resolve().parents[2] / "benchmarks" / "sglang-bundle.sh").read_text()
    assert f"'ktransformers[sglang]=={KTRANSFORMERS_VERSION}'" in bundle_script
    assert len(flags["flags"]) > 300 and "--kt-method" in flags["flags"]


@pytest.mark.parametrize("point", [*sglang_points(BASE), "t1024-d1"])
def test_every_sitting_point_parses_with_sglang_kts_flags(point: str) -> None:
    named = sglang_points(BASE)
    # a layerwise-prefill threshold needs native CPU experts (SglangKt refuses it with AMX ones)
    config = named[point] if point in named else sglang_sweep(replace(BASE, method="BF16"), ((1024, 1),))[0]
    parsed = parser_from(committed()["flags"]).parse_args(server_args(config))
    assert parsed.grammar_backend == "none"  # llguidance dies on the bench model's WordPiece tokenizer
    assert parsed.kt_method == config.method and parsed.kt_cpuinfer == str(config.cpuinfer)


def test_the_parser_refuses_what_sglang_kt_would() -> None:
    """The parse can fail: an unknown flag, a value outside the choices, a missing value."""
    parser = parser_from(committed()["flags"])
    args = server_args(BASE)
    for bad in (
        [*args, "--kt-no-such-flag", "1"],
        [arg if arg != "none" else "lark" for arg in args],
        [*args, "--grammar-backend"],
    ):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            parser.parse_args(bad)


def test_flags_are_read_from_add_cli_args() -> None:
    source = """
CHOICES = ["a", "b"]
class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--x", type=int)
        parser.add_argument("--on", action="store_true")
        parser.add_argument("--pick", choices=CHOICES)
def other(parser):
    parser.add_argument("--not-a-server-flag")
"""
    flags = flags_from_source(source)
    assert set(flags) == {"--x", "--on", "--pick"}
    assert flags["--on"]["value"] is False and flags["--pick"]["choices"] == ["a", "b"]
