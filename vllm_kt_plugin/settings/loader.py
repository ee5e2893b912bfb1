"""The settings as vLLM's processes see them: preset, then variables, then routing profile.

``load_settings`` is the one entry point: it warns about unknown KT_* names, lays the
``KT_CONFIG`` preset under the environment (the environment wins), parses and checks the
variables, and reads the routing profile ``KT_EXPERT_PROFILE`` names, so that every
mistake surfaces here, at config time, before any weight is loaded.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from dataclasses import replace

from vllm_kt_plugin.settings.catalogue import KNOWN_VARIABLES, KT_KERNEL_OWN_VARIABLES, LOGGER_NAME, SETTINGS_PREFIX
from vllm_kt_plugin.settings.presets import apply_preset
from vllm_kt_plugin.settings.routing_profile import load_routing_profile
from vllm_kt_plugin.settings.variables import ALONE, HostShare, KTSettings, numa_node_count, usable_cores

logger = logging.getLogger(LOGGER_NAME)


def unknown_variables(env: Mapping[str, str]) -> list[str]:
    """KT_* names neither we nor kt-kernel know (likely typos), each logged as a warning."""
    known = KNOWN_VARIABLES | KT_KERNEL_OWN_VARIABLES
    unknown = sorted(n for n in env if n.startswith(SETTINGS_PREFIX) and n not in known)
    for name in unknown:
        close = difflib.get_close_matches(name, KNOWN_VARIABLES, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        logger.warning("kt-hybrid: ignoring unknown variable %s%s", name, hint)
    return unknown


def load_settings(
    env: Mapping[str, str] | None = None,
    *,
    cores: int | None = None,
    numa_nodes: int | None = None,
    share: HostShare = ALONE,
) -> KTSettings:
    """Every KT_* setting, checked: ``KTConfigError`` on the first mistake. ``share``: the
    kt-kernel processes of this host (one per pipeline stage here), which divide its cores."""
    env = os.environ if env is None else env
    cores = usable_cores() if cores is None else cores
    numa_nodes = numa_node_count() if numa_nodes is None else numa_nodes
    unknown_variables(env)
    given = tuple(sorted((name, value) for name, value in env.items() if name in KNOWN_VARIABLES))
    preset = None
    if (env.get("KT_CONFIG") or "").strip():
        env, preset = apply_preset(env, cores=cores, numa_nodes=numa_nodes)
    settings = KTSettings.from_env(env, cores=cores, numa_nodes=numa_nodes, share=share)
    if settings.expert_profile is not None:
        load_routing_profile(settings.expert_profile)
    return replace(settings, preset=preset, given=given)


def environment_drift(settings: KTSettings, env: Mapping[str, str] | None = None) -> list[str]:
    """The KT_* variables whose value in ``env`` (a worker's environment) differs from the
    one ``settings`` were parsed from, as ``NAME=worker value (vllm serve: value)``. A Ray
    worker on another host starts from that host's environment; vLLM copies the launching
    shell's KT_* there (``register`` makes it), but a node may set its own."""
    env = os.environ if env is None else env
    given = dict(settings.given)
    here = {name: value for name, value in env.items() if name in KNOWN_VARIABLES}
    return [
        f"{name}={here.get(name, '<unset>')} (vllm serve: {given.get(name, '<unset>')})"
        for name in sorted(given.keys() | here.keys())
        if here.get(name) != given.get(name)
    ]
