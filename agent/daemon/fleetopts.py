"""`heapscope serve`'s fleet options: selectors, limits, and how long ended targets stay. The command line (and a
Kubernetes ConfigMap read as an argument file, `@FILE`) becomes a FleetConfig here."""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING

from agent.argtypes import int_at_least, positive_seconds
from agent.errors import HeapscopeError, UsageError
from agent.model.fleet import Limits
from agent.model.selector import Selector
from agent.offline.timespec import parse_duration

if TYPE_CHECKING:  # the command line is parsed without the daemon's modules: `heapscope growth` starts quickly
    from agent.daemon.fleet import FleetConfig

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """Bytes, with an optional K, M, G or T (powers of 1024; `Ki`, `MiB` and the like too)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text.lower())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 512M or 2G, got {text!r}")
    value = int(float(m.group(1)) * _UNITS[m.group(2)])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0, got {text!r}")
    return value


def seconds_or_zero(text: str) -> float:
    if text.strip() == "0":
        return 0.0
    return positive_seconds(text)


def age_or_zero(text: str) -> float:
    """A duration (30m, 12h, 7d; a bare number is seconds), or 0 for `never`."""
    try:
        return parse_duration(text)
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_fleet_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "selectors: profile the processes that match, as they appear (each option is one selector; any may match)"
    )
    g.add_argument(
        "--attach-comm",
        action="append",
        default=[],
        metavar="REGEX",
        help="process name (/proc/PID/comm) searched with REGEX, as pgrep does (repeatable)",
    )
    g.add_argument(
        "--attach-cmdline",
        action="append",
        default=[],
        metavar="REGEX",
        help="command line (arguments joined by spaces) searched with REGEX (repeatable)",
    )
    g.add_argument(
        "--attach-cgroup",
        action="append",
        default=[],
        metavar="PATH",
        help="processes in the cgroup v2 PATH or below (/system.slice/nginx.service; shell wildcards allowed, "
        "* crosses /), or pod:UID, or container:ID (repeatable)",
    )
    g.add_argument(
        "--follow-children",
        choices=("yes", "no"),
        default="yes",
        help="also profile the children a selected process forks, while they run its program (default yes)",
    )
    g.add_argument(
        "--rescan-interval",
        type=positive_seconds,
        default=60.0,
        metavar="SECONDS",
        help="scan /proc this often besides the kernel's exec and fork events, in case (default 60)",
    )
    lim = p.add_argument_group("limits: at a limit a new target is refused, logged and counted (0: no limit)")
    lim.add_argument(
        "--max-targets",
        type=int_at_least(0),
        default=256,
        metavar="N",
        help="processes profiled at once (default 256)",
    )
    lim.add_argument(
        "--max-sites",
        type=int_at_least(0),
        default=0,
        metavar="N",
        help="allocation sites held by all targets, ended ones kept for reading included (default: no limit)",
    )
    lim.add_argument(
        "--max-memory",
        type=lambda t: 0 if t.strip() == "0" else byte_size(t),
        default=0,
        metavar="SIZE",
        help="the daemon's resident memory, e.g. 900M (default: no limit)",
    )
    lim.add_argument(
        "--keep-exited",
        type=seconds_or_zero,
        default=3600.0,
        metavar="SECONDS",
        help="how long a target whose profile ended stays in /targets (default 3600)",
    )
    lim.add_argument(
        "--max-exited",
        type=int_at_least(0),
        default=256,
        metavar="N",
        help="targets whose profile ended kept in /targets at most: beyond, the oldest is forgotten first, its files "
        "and history kept (default 256; 0: no limit)",
    )
    lim.add_argument(
        "--output-max-age",
        type=age_or_zero,
        default="7d",
        metavar="AGE",
        help="how long the output files (massif.out.PID and the others) of a process no longer profiled stay in "
        "the output directory: 7d (the default), 12h, 30m...; 0 keeps them for good",
    )


def fleet_config_from(ns: argparse.Namespace) -> FleetConfig:
    """The fleet's configuration; a bad selector is a UsageError naming the option."""
    from agent.daemon.fleet import FleetConfig

    follow = getattr(ns, "follow_children", "yes") == "yes"
    selectors: list[Selector] = []
    for option, key in (("--attach-comm", "attach_comm"), ("--attach-cmdline", "attach_cmdline"),
                        ("--attach-cgroup", "attach_cgroup")):
        for value in getattr(ns, key, []) or []:
            try:
                selectors.append(Selector.make(**{option.removeprefix("--attach-"): value}, follow_children=follow))
            except HeapscopeError as exc:
                raise UsageError(f"{option}: {exc}") from None
    return FleetConfig(
        selectors=tuple(selectors),
        limits=Limits(
            max_targets=getattr(ns, "max_targets", 0) or None,
            max_sites=getattr(ns, "max_sites", 0) or None,
            max_memory=getattr(ns, "max_memory", 0) or None,
        ),
        keep_exited=getattr(ns, "keep_exited", 3600.0),
        max_exited=getattr(ns, "max_exited", 256) or None,
        output_max_age=getattr(ns, "output_max_age", 7 * 86400.0),
        rescan_interval=getattr(ns, "rescan_interval", 60.0),
    )
