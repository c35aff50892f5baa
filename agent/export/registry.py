"""Every output format heapscope writes, declared once.

A format names its file option and default file (the CLI builds its options from these, and the pipeline writes
the files at the end), its HTTP route and media type (the API builds its routes from these), and how it is
rendered from a profile. Adding a format is one entry here and its renderer's module.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from agent.export.malt import SiteResolver, write_malt
from agent.export.massif import write_massif
from agent.export.pprof import DEFAULT_SAMPLE_TYPE, SAMPLE_TYPES, PprofContext, render_pprof
from agent.export.xtree import write_xtree
from agent.model.malt import MaltProfile
from agent.model.options import MassifOptions
from agent.model.snapshot import Snapshot
from agent.model.stack import SiteCounts, Stack
from agent.model.target import ProfileHeader


@dataclass(frozen=True)
class MaltDocument:
    """MALT's profile and the resolver that names its stacks' addresses."""

    profile: MaltProfile
    resolve: SiteResolver


class ProfileSource(Protocol):
    """What an output is rendered from: one target's profile, live or ended (agent.session.pipeline.Profile)."""

    def header(self) -> ProfileHeader: ...

    def snapshots(self) -> list[Snapshot]: ...

    def xtree_sites(self) -> dict[Stack, SiteCounts]: ...

    def malt_document(self) -> MaltDocument: ...

    def pprof_context(self) -> PprofContext: ...


@dataclass(frozen=True)
class Variant:
    """A choice made when rendering (MALT's format version): a CLI option and an HTTP query parameter."""

    option: str
    param: str
    choices: tuple[str, ...]
    default: str
    help: str

    @property
    def dest(self) -> str:
        """The argparse attribute of the option."""
        return self.option.removeprefix("--").replace("-", "_")


def _always(opts: MassifOptions) -> bool:
    return True


@dataclass(frozen=True)
class OutputFormat:
    name: str
    route: str  # the HTTP GET path that serves it
    media_type: str
    summary: str  # what it is, for --help and the API's documentation
    file_option: str  # the CLI option naming its file (%p: the PID)
    default_file: str | None  # None: written only when the file option is given
    render: Callable[[ProfileSource, str], str | bytes]  # (profile, the variant's value or "")
    massif_option: bool = False  # one of Massif's own options: listed in Massif's group and in desc:
    variant: Variant | None = None
    # Besides a file name, what else must be asked for (xtree: --xtree-memory other than none).
    written_if: Callable[[MassifOptions], bool] = field(default=_always)

    @property
    def dest(self) -> str:
        """The argparse attribute of the file option."""
        return self.file_option.removeprefix("--").replace("-", "_")


def render_massif(source: ProfileSource, variant: str = "") -> str:
    h = source.header()
    out = io.StringIO()
    write_massif(out, source.snapshots(), desc=h.desc, cmd=h.cmd, time_unit=h.time_unit, threshold=h.threshold)
    return out.getvalue()


def render_xtree(source: ProfileSource, variant: str = "") -> str:
    # Valgrind's xtree drops only the allocation function itself (not in our stacks) and cuts below main;
    # it keeps other alloc-fns and all Massif captured (--depth + 49 frames), not --depth of them.
    h = source.header()
    out = io.StringIO()
    desc: tuple[str, ...] = ()
    if h.mode == "sampled":
        desc = (f"Mode: sampled, one sample per {h.sample_rate} bytes on average: the values are estimates",)
    write_xtree(out, source.xtree_sites(), cmd=h.cmd, pid=h.pid, kind=h.xtree_kind, desc=desc)
    return out.getvalue()


def render_malt(source: ProfileSource, variant: str = "1.1") -> str:
    doc = source.malt_document()
    out = io.StringIO()
    write_malt(out, doc.profile, format_version="1.6" if variant == "1.6" else "1.1", resolve=doc.resolve)
    return out.getvalue()


def render_pprof_profile(source: ProfileSource, variant: str = "") -> bytes:
    c = source.pprof_context()
    return render_pprof(
        source.xtree_sites(),  # the xtree's stacks: bytes per function equal callgrind_annotate's
        c.mappings,
        build_ids=c.build_ids,
        main_path=c.main_path,
        sample_rate=c.sample_rate,
        prescaled=c.prescaled,
        time_ns=c.time_ns,
        duration_ns=c.duration_ns,
        comments=c.comments,
        default_sample_type=variant or DEFAULT_SAMPLE_TYPE,
    )


MASSIF = OutputFormat(
    name="massif",
    route="/all_snapshots",
    media_type="text/plain",
    summary="Massif's massif.out: every snapshot (read by ms_print and massif-visualizer)",
    file_option="--massif-out-file",
    default_file="massif.out.%p",
    render=render_massif,
    massif_option=True,
)
XTREE = OutputFormat(
    name="xtree",
    route="/xtmemory",
    media_type="text/plain",
    summary="the xtree heap memory report, in callgrind format (callgrind_annotate, KCachegrind)",
    file_option="--xtree-memory-file",
    default_file="xtmemory.kcg.%p",
    render=render_xtree,
    massif_option=True,
    written_if=lambda opts: opts.xtree_memory != "none",
)
MALT = OutputFormat(
    name="malt",
    route="/malt",
    media_type="application/json",
    summary="MALT's JSON profile: per-stack statistics, lifetimes, timelines, memory, threads, leaks",
    file_option="--malt-out-file",
    default_file=None,
    render=render_malt,
    variant=Variant(
        option="--malt-format",
        param="version",
        choices=("1.1", "1.6"),
        default="1.1",
        help="1.1 (the documented format, default) or 1.6 (what current MALT's reader requires)",
    ),
)

PPROF = OutputFormat(
    name="pprof",
    route="/pprof",
    media_type="application/octet-stream",  # gzipped protobuf, as Go's net/http/pprof serves it
    summary="the heap as a gzipped pprof profile (go tool pprof, Pyroscope, Parca)",
    file_option="--pprof-out-file",
    default_file=None,
    render=render_pprof_profile,
    variant=Variant(
        option="--pprof-sample-index",
        param="sample_index",
        choices=tuple(name for name, _ in SAMPLE_TYPES),
        default=DEFAULT_SAMPLE_TYPE,
        help="the sample type pprof shows first; inuse_space (default), as in Go's heap profile",
    ),
)

FORMATS: tuple[OutputFormat, ...] = (MASSIF, XTREE, MALT, PPROF)
BY_NAME: dict[str, OutputFormat] = {f.name: f for f in FORMATS}
