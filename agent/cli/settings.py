"""The options that profile (`run`, `attach`, `serve`): adding them to a parser, and the pipeline's settings made
from them (Massif's options, the mode, the output files, the history store)."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from agent.argtypes import byte_size, int_at_least, int_between, percent, positive_seconds, yes_no
from agent.errors import EnvironmentProblem, UnsafePath, UsageError
from agent.export.registry import FORMATS
from agent.model.options import MassifOptions
from agent.model.sampling import (
    DAEMON_EXACT_STACKS,
    DEFAULT_CAPACITY,
    DEFAULT_MAX_SAMPLES,
    DEFAULT_SAMPLE_RATE,
    DEFAULT_TOTAL_SAMPLES_PER_CPU,
    MAX_MAX_SAMPLES,
    MAX_SAMPLE_RATE,
    MODES,
    Mode,
    ProfileMode,
)
from agent.offline.timespec import parse_duration, parse_thin_rules
from agent.store import Retention, SyncPolicy

if TYPE_CHECKING:  # imported where used: `report`, `diff`, `growth` and `view` need none of the profiling side
    from agent.session.pipeline import ProfileSettings
    from agent.session.storerec import StoreSettings



# Massif's options: (name, argparse keyword arguments). Their text as given goes into desc:. The two file
# options among Massif's come from the output registry (agent.export.registry).
_MASSIF_OPTIONS: list[tuple[str, dict]] = [  # type: ignore[type-arg]
    ("--heap", {"type": yes_no, "default": True, "metavar": "yes|no", "help": "profile the heap (default yes)"}),
    (
        "--heap-admin",
        {
            "type": int_between(0, 1024),
            "default": 8,
            "help": "admin bytes per block, in mem_heap_extra_B, 0 to 1024 (default 8)",
        },
    ),
    (
        "--alignment",
        {
            "type": int_between(16, 4096),
            "default": 16,
            "help": "minimum alignment of blocks, a power of two from 16 to 4096: the slop in mem_heap_extra_B "
            "(default 16)",
        },
    ),
    (
        "--stacks",
        {"type": yes_no, "default": False, "metavar": "yes|no", "help": "profile the threads' stacks (default no)"},
    ),
    (
        "--pages-as-heap",
        {
            "type": yes_no,
            "default": False,
            "metavar": "yes|no",
            "help": "profile mapped pages (mmap, brk) instead of malloc's blocks (default no)",
        },
    ),
    (
        "--depth",
        {
            "type": int_between(1, 200),
            "default": 30,
            "help": "frames kept below the allocation functions, 1 to 200 (default 30)",
        },
    ),
    (
        "--alloc-fn",
        {
            "action": "append",
            "default": [],
            "dest": "alloc_fns",
            "metavar": "NAME",
            "help": "one more allocation function, trimmed from the top of stacks like malloc (repeatable)",
        },
    ),
    (
        "--ignore-fn",
        {
            "action": "append",
            "default": [],
            "dest": "ignore_fns",
            "metavar": "NAME",
            "help": "leave out allocations made directly in NAME (repeatable)",
        },
    ),
    (
        "--threshold",
        {
            "type": percent,
            "default": 1.0,
            "help": "percent of the total below which tree nodes are merged (default 1.0)",
        },
    ),
    (
        "--peak-inaccuracy",
        {
            "type": percent,
            "default": 1.0,
            "help": "percent above the last peak snapshot's total a free must come down from to take a peak "
            "snapshot (default 1.0)",
        },
    ),
    (
        "--time-unit",
        {
            "choices": ("i", "ms", "B"),
            "default": "ms",
            "help": "ms: milliseconds since the start (default); B: bytes allocated and freed; "
            "i (instructions) is refused: it needs hardware counters",
        },
    ),
    (
        "--detailed-freq",
        {"type": int_between(1, 1000000), "default": 10, "help": "every Nth snapshot is detailed (default 10)"},
    ),
    (
        "--max-snapshots",
        {
            "type": int_between(10, 1000),
            "default": 100,
            "help": "snapshots kept, 10 to 1000; culled to between N/2 and N (default 100)",
        },
    ),
    (
        "--xtree-memory",
        {
            "choices": ("none", "allocs", "full"),
            "default": "none",
            "help": "write the xtree memory report: allocs (live bytes) or full (allocated and freed too)",
        },
    ),
]
_MASSIF_NAMES = {name for name, _ in _MASSIF_OPTIONS} | {f.file_option for f in FORMATS if f.massif_option}


def _add_mode_options(p: argparse.ArgumentParser, default: Mode) -> None:
    m = p.add_argument_group("mode")
    m.add_argument(
        "--mode",
        choices=MODES,
        default=default,
        help="exact: every allocation call, as Massif counts (three uprobes a malloc+free pair); sampled: an "
        "in-process sampler reports one allocation per --sample-rate bytes on average, and the heap figures are "
        f"estimates (default {default})",
    )
    m.add_argument(
        "--sample-rate",
        type=int_between(1, MAX_SAMPLE_RATE),
        default=None,
        metavar="BYTES",
        help=f"sampled mode: the mean bytes between samples, Poisson by bytes (default {DEFAULT_SAMPLE_RATE})",
    )
    m.add_argument(
        "--max-samples",
        type=int_between(0, MAX_MAX_SAMPLES),
        default=None,
        metavar="N",
        help="sampled mode: the samples a second each process may take; above it its sampler raises the rate in "
        "force (the estimates stay unbiased, with fewer samples), and lowers it again, never below --sample-rate. "
        f"0: no budget (default {DEFAULT_MAX_SAMPLES}: about 1%% of a core)",
    )
    m.add_argument(
        "--total-samples",
        type=int_between(0, MAX_MAX_SAMPLES),
        default=None,
        metavar="N",
        help="sampled mode, a daemon (serve, --http): the samples a second all its processes take together, shared "
        "among them each second (a process wanting less keeps its rate; the busy ones share the rest, each within "
        f"--max-samples). 0: no total (default {DEFAULT_TOTAL_SAMPLES_PER_CPU} a CPU: about 1%% of the machine)",
    )
    m.add_argument(
        "--page-calls",
        choices=("yes", "no"),
        default=None,
        help="sampled mode: also trace mmap, munmap, mremap and brk, for MALT's mmap statistics and the mapped "
        "total's highest point between looks (default no: any traced system call makes every process on the "
        "machine pay at every system call; the mapped total is read at each look); exact mode always traces them",
    )


def add_profile_options(p: argparse.ArgumentParser, mode: Mode = "exact") -> None:
    _add_mode_options(p, mode)
    g = p.add_argument_group("Massif options (Valgrind's names, defaults and meanings)")
    for name, kwargs in _MASSIF_OPTIONS:
        g.add_argument(name, **kwargs)
    o = p.add_argument_group("output files (%p: the PID, %q{VAR}: an environment variable)")
    for fmt in FORMATS:
        group = g if fmt.massif_option else o
        default = f" (default {fmt.default_file})" if fmt.default_file else "; off by default"
        group.add_argument(
            fmt.file_option,
            default=fmt.default_file,
            metavar="FILE",
            help=f"{fmt.summary}{default}".replace("%", "%%"),
        )
        if fmt.variant is not None:
            v = fmt.variant
            group.add_argument(v.option, choices=v.choices, default=v.default, help=v.help)
    o.add_argument(
        "--summary-file",
        default=None,
        metavar="FILE",
        help="write the end-of-run summary there as JSON (%%p: the PID); off by default",
    )
    h = p.add_argument_group("heapscope options")
    h.add_argument(
        "--sample-interval",
        type=positive_seconds,
        default=0.05,
        metavar="SECONDS",
        help="how often the kernel's counters are sampled for snapshots (default 0.05); a target that makes no "
        "call is looked at down to once a second, one that makes fewer than 1,000 a second down to five times; "
        "sampled mode looks at any target once a second (or each --store-interval if shorter)",
    )
    h.add_argument(
        "--max-blocks",
        type=int_at_least(1024),
        default=None,
        help="live blocks the kernel can track (sampled mode: live sampled blocks); more are counted as dropped "
        f"and reported (default {DEFAULT_CAPACITY['exact'][0]} exact, {DEFAULT_CAPACITY['sampled'][0]} sampled)",
    )
    h.add_argument(
        "--max-stacks",
        type=int_at_least(1024),
        default=None,
        help="distinct allocation stacks the kernel can keep; more are counted and reported "
        f"(default {DEFAULT_CAPACITY['exact'][1]} exact, {DAEMON_EXACT_STACKS} for serve's exact targets, "
        f"{DEFAULT_CAPACITY['sampled'][1]} sampled)",
    )
    h.add_argument(
        "--unwind",
        choices=("cfi", "fp"),
        default="cfi",
        help="walk stacks with .eh_frame tables (cfi, default) or frame pointers only (fp)",
    )
    h.add_argument(
        "--nice",
        type=int_between(-20, 19),
        default=None,
        metavar="N",
        help="run heapscope at nice level N (-20 to 19; default: as started). 10 has it take the CPU the services "
        "leave on a busy machine: it reads what its probes counted later, while the probes run in the kernel as "
        "before, and a thread it holds stopped to get in is held at nice -10 whatever N is",
    )
    h.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    h.add_argument("-v", "--verbose", action="count", default=0,
                   help="more detail (Massif's -v): where each allocation function's probe sits and how")
    h.add_argument("--stats", type=yes_no, default=False, metavar="yes|no",
                   help="at the end, Massif's statistics from heapscope's own counts: allocations, frees, "
                   "reallocs, snapshots and cullings (Valgrind's --stats; default no)")


def add_http_options(p: argparse.ArgumentParser, serve: bool) -> None:
    """The daemon's HTTP options. Left unset, they come from HEAPSCOPE_* variables (api.settings)."""
    g = p.add_argument_group("HTTP daemon (Massif's monitor commands, targets and Prometheus metrics over HTTP)")
    g.add_argument(
        "--http",
        metavar="HOST:PORT",
        default=None,
        help="listen there (default 127.0.0.1:7411)" if serve else "serve the profile over HTTP while it runs",
    )
    g.add_argument(
        "--token",
        default=None,
        help="bearer token every endpoint but /healthz requires; needed to listen beyond loopback "
        "(or HEAPSCOPE_TOKEN, which keeps it out of the process list)",
    )
    g.add_argument(
        "--output-dir", default=None, metavar="DIR", help="where files are written (default: the current directory)"
    )
    g.add_argument(
        "--malt",
        choices=("yes", "no"),
        default="yes",
        help="keep MALT's statistics of every target, for GET /malt (default yes; they cost ~20-30%% more a call)",
    )
    g.add_argument(
        "--metrics-top-stacks",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help="per-target allocation sites in /metrics, the rest summed into one series (default 10)",
    )


DEFAULT_STORE = "store"  # serve's store, under --output-dir


def add_store_options(p: argparse.ArgumentParser, serve: bool) -> None:
    """The history store: every sample on disk, read back with `heapscope report` and `heapscope diff`."""
    g = p.add_argument_group("history store (every sample kept on disk, for heapscope report and diff)")
    if serve:
        g.add_argument("--store", metavar="DIR", default=None,
                       help=f"keep each target's history in DIR/<pid>/, DIR under --output-dir "
                            f"(default {DEFAULT_STORE})")
        g.add_argument("--no-store", action="store_true", help="keep no history on disk")
    else:
        g.add_argument("--store", metavar="DIR", default=None,
                       help="keep every sample of the profile in DIR/<pid>/ (off by default)")
    g.add_argument("--store-interval", type=positive_seconds, default=1.0, metavar="SECONDS",
                   help="seconds between stored samples (default 1)")
    g.add_argument("--store-quiet-interval", type=positive_seconds, default=60.0, metavar="SECONDS",
                   help="seconds between stored samples of a target whose heap, mappings and RSS do not move "
                        "(default 60); the history keeps it as a step")
    g.add_argument("--store-sync", choices=("interval", "always", "never"), default="interval",
                   help="when stored samples are forced to disk: at most --store-interval after they are written "
                        "(interval, the default: a power loss costs at most that much history), after each "
                        "(always), or when the kernel pleases (never). A crash of heapscope alone loses nothing")
    g.add_argument("--store-max-size", type=byte_size, default=Retention.max_bytes, metavar="SIZE",
                   help="history kept per process, oldest deleted first (default 4G)")
    g.add_argument("--store-max-age", default="7d", metavar="AGE",
                   help="history older than this is deleted (default 7d); `serve` also deletes it from the "
                        "histories of processes it no longer profiles")
    g.add_argument("--store-thin", default=None, metavar="AGE:EVERY,...",
                   help="thin older history: 1h:10s,1d:1m keeps one snapshot per 10 s of history older than an "
                        "hour, one a minute beyond a day (default: nothing is thinned)")


def store_settings(ns: argparse.Namespace, output_dir: Path | None = None) -> StoreSettings | None:
    """The store of `run` and `attach` (--store DIR, as given), or of `serve` (`output_dir`/store unless
    --no-store; a --store DIR that leaves the output directory is refused)."""
    from agent.session.storerec import StoreSettings

    if ns.command == "serve":
        assert output_dir is not None
        if ns.no_store:
            if ns.store is not None:
                raise UsageError("--store and --no-store contradict each other")
            return None
        root = _under_output_dir(output_dir, ns.store or DEFAULT_STORE)
    elif ns.store is None:
        return None
    else:
        root = Path(ns.store)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot create the store directory {root}: {exc.strerror}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise EnvironmentProblem(f"the store directory {root} is not writable")
    thin = parse_thin_rules(ns.store_thin) if ns.store_thin else ()
    retention = Retention(max_bytes=ns.store_max_size, max_age_s=parse_duration(ns.store_max_age), thin=thin)
    sync = SyncPolicy(ns.store_sync, interval=max(ns.store_interval, 1.0) if ns.store_sync == "interval" else 1.0)
    return StoreSettings(root, interval=ns.store_interval, sync=sync, retention=retention,
                         quiet_interval=max(ns.store_quiet_interval, ns.store_interval))


def _under_output_dir(output_dir: Path, name: str) -> Path:
    """`name` (relative to `output_dir`, or absolute) as a path that stays under `output_dir` once symbolic links
    and `..` are resolved: the daemon writes nowhere else."""
    base = output_dir.resolve()
    path = (base / name).resolve()
    if path != base and base not in path.parents:
        raise UnsafePath(f"--store {name} is outside the output directory {output_dir}: the daemon writes only "
                         "under --output-dir (give a directory below it)")
    if path == base:
        raise UnsafePath(f"--store {name} is the output directory itself: give a directory below it")
    return path



def options_from(ns: argparse.Namespace) -> MassifOptions:
    opts = MassifOptions(
        heap=ns.heap,
        heap_admin=ns.heap_admin,
        alignment=ns.alignment,
        stacks=ns.stacks,
        pages_as_heap=ns.pages_as_heap,
        depth=ns.depth,
        alloc_fns=ns.alloc_fns,
        ignore_fns=ns.ignore_fns,
        threshold=ns.threshold,
        peak_inaccuracy=ns.peak_inaccuracy,
        time_unit=ns.time_unit,
        detailed_freq=ns.detailed_freq,
        max_snapshots=ns.max_snapshots,
        xtree_memory=ns.xtree_memory,
    )
    if opts.stacks and opts.pages_as_heap:
        raise UsageError("--stacks=yes cannot be combined with --pages-as-heap=yes (as in Massif)")
    if not opts.heap:
        # Massif then records no blocks, pages included, and profiles the stacks alone or nothing; heapscope's
        # snapshots and stack samples come from the allocator's calls and the page syscalls it would not count.
        raise UsageError("--heap=no: Massif then profiles only the stacks (--stacks=yes) or nothing, not even "
                         "pages; heapscope takes its snapshots at the allocator's calls and page syscalls, so it "
                         "always profiles the heap, or the pages with --pages-as-heap=yes: leave --heap=no out")
    if opts.time_unit == "i":
        raise UsageError(
            "--time-unit=i needs hardware instruction counters, which heapscope does not read yet "
            "(and this machine may not have them: see `perf stat -e instructions true`); use ms or B"
        )
    if opts.alignment & (opts.alignment - 1):
        raise UsageError(f"--alignment must be a power of two, got {opts.alignment}")
    return opts


def massif_desc(argv: Sequence[str]) -> list[str]:
    """Massif's desc: the Massif options as the user wrote them (each takes a value, as Valgrind's do)."""
    out = []
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name in _MASSIF_NAMES:
            if "=" not in arg and i + 1 < len(argv):
                arg = f"{arg}={argv[i + 1]}"
            out.append(arg)
    return out


def expand_filename(template: str, pid: int, env: dict[str, str] | None = None) -> str:
    """Valgrind's %p (PID), %q{VAR} (an environment variable) and %% in output file names."""
    env = dict(os.environ) if env is None else env

    def one(m: re.Match[str]) -> str:
        token = m.group(0)
        if token == "%%":
            return "%"
        if token == "%p":
            return str(pid)
        var = m.group(1)
        if var is None:
            raise UsageError(f"bad output file name {template!r}: %q must be followed by {{VARIABLE}}")
        if var not in env:
            raise UsageError(f"output file name {template!r}: environment variable {var} is not set")
        return env[var]

    name = re.sub(r"%%|%p|%q(?:\{([^}]*)\})?", one, template)
    if re.search(r"%[^%pq]", name.replace("%%", "")) and "%" in template:
        raise UsageError(f"bad output file name {template!r}: only %p, %q{{VAR}} and %% are understood")
    return name


def mode_from(ns: argparse.Namespace) -> ProfileMode:
    if ns.sample_rate is not None and ns.mode != "sampled":
        raise UsageError("--sample-rate applies to --mode=sampled")
    if ns.max_samples is not None and ns.mode != "sampled":
        raise UsageError("--max-samples applies to --mode=sampled")
    if ns.total_samples is not None and ns.mode != "sampled":
        raise UsageError("--total-samples applies to --mode=sampled")
    if ns.mode == "sampled" and ns.pages_as_heap:
        raise UsageError("--pages-as-heap=yes profiles mapped pages, which sampled mode does not sample; "
                         "use --mode=exact")
    if ns.page_calls is not None and ns.mode != "sampled":
        raise UsageError("--page-calls applies to --mode=sampled: exact mode always traces the page calls")
    return ProfileMode(ns.mode, DEFAULT_SAMPLE_RATE if ns.sample_rate is None else ns.sample_rate,
                       DEFAULT_MAX_SAMPLES if ns.max_samples is None else ns.max_samples)


def total_samples_from(ns: argparse.Namespace, daemon: bool) -> int:
    """A daemon's total of samples a second (--total-samples; by default DEFAULT_TOTAL_SAMPLES_PER_CPU a CPU it
    may run on); 0 without a daemon, where one process keeps its own budget."""
    if not daemon:
        if ns.total_samples is not None:
            raise UsageError("--total-samples applies to a daemon (serve, or --http), which profiles several "
                             "processes; one process has --max-samples")
        return 0
    if ns.total_samples is not None:
        return int(ns.total_samples)
    return DEFAULT_TOTAL_SAMPLES_PER_CPU * max(1, len(os.sched_getaffinity(0)))


def settings_from(ns: argparse.Namespace, desc: Sequence[str], daemon: bool) -> ProfileSettings:
    """The pipeline's settings from the command line. A daemon keeps MALT's statistics unless --malt=no (for
    GET /malt); `run` and `attach` keep them only for a MALT file."""
    from agent.session.pipeline import ProfileSettings

    opts = options_from(ns)
    files = {f.name: getattr(ns, f.dest) for f in FORMATS if getattr(ns, f.dest) is not None}
    variants = {f.name: getattr(ns, f.variant.dest) for f in FORMATS if f.variant is not None}
    return ProfileSettings(
        opts=opts,
        desc=tuple(desc),
        files=files,
        variants=variants,
        sample_interval=ns.sample_interval,
        unwind=ns.unwind,
        verbose=ns.verbose,
        max_blocks=ns.max_blocks,
        max_stacks=ns.max_stacks,
        node_blocks=getattr(ns, "node_blocks", 0),  # serve's: its targets share the block table
        keep_programs=getattr(ns, "keep_programs", 0.0),  # serve's: a shape outlives its last target
        malt=ns.malt == "yes" if daemon else "malt" in files,
        mode=mode_from(ns),
        page_calls=ns.page_calls == "yes",
        store=store_settings(ns) if ns.command != "serve" else None,  # serve's is under --output-dir (profiling._serve)
    )

