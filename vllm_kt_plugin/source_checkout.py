"""Files that exist only in a source checkout of vllm-kt-plugin (a git clone), never in its
wheel: README.md, docs/, benchmarks/, tests/, and configs/ where it is not mapped into the
package. The docs generators and the benchmark's bookkeeping read them through here, and
only here, so that the wheel check (tests/kt_testing/wheel_reads.py) can tell them from
files the installed package reads, which must ship as package data (importlib.resources).
From an installed wheel, ``checkout_path`` stops with one line that says a checkout is needed.
Imports nothing of the package: settings/ and the tooling both use it.
"""

from __future__ import annotations

from pathlib import Path

# The folder holding this package: the checkout's top in a clone, site-packages once installed.
_TOP = Path(__file__).resolve().parents[1]


class SourceCheckoutRequired(SystemExit):
    """A tool that reads the source tree was run from an installed wheel. A SystemExit, so
    that ``python -m ...`` ends with its one line and no traceback."""


def checkout_root() -> Path | None:
    """The top of the source checkout this package was imported from; None when it was
    imported from an install (no pyproject.toml and configs/ beside the package)."""
    return _TOP if (_TOP / "pyproject.toml").is_file() and (_TOP / "configs").is_dir() else None


def checkout_path(*parts: str, needed_by: str) -> Path:
    """``parts`` under the checkout's top, for ``needed_by`` (a command or module name);
    raises SourceCheckoutRequired where the package is installed rather than checked out."""
    root = checkout_root()
    if root is None:
        raise SourceCheckoutRequired(
            f"{needed_by} needs a source checkout of vllm-kt-plugin (a git clone, or PYTHONPATH pointing into "
            f"one): it reads {'/'.join(parts)}, which an installed wheel does not hold (imported from {_TOP})"
        )
    return root.joinpath(*parts)
