#!/usr/bin/env python3
"""Unwind tables: how long they take to build, cold and from the on-disk cache, and how big they are.

    .venv/bin/python bench/unwind_tables.py                 # libc, libstdc++ and the loader, 5 repeats
    .venv/bin/python bench/unwind_tables.py --repeats 9 /path/to/lib.so ...

Every measurement runs in a fresh interpreter (imports done before the clock starts), so "cached" includes
reading the object's build-id, as it would for a process seen for the first time:
- cold:   load_table() with an empty cache directory (parse the CFI, build the rows, write the cache file);
- cached: load_table() with the file written by the cold run.
Goals: at most 2 s cold, at most 50 ms from cache. The median of the repeats is reported, and the
table's contents: rows and bytes, rows per CFA type, and the rows the format cannot express and why.
Results also go to bench/results/unwind_tables.json.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
RESULTS = BENCH_DIR / "results" / "unwind_tables.json"

DEFAULT_OBJECTS = [
    "/lib/x86_64-linux-gnu/libc.so.6",
    "/usr/lib/x86_64-linux-gnu/libstdc++.so.6",
    "/lib64/ld-linux-x86-64.so.2",
]
GOAL_COLD_S = 2.0
GOAL_CACHED_S = 0.050

# Runs in the child: time one load_table() call, print the figures as JSON.
_CHILD = r"""
import json, sys, time
from agent.symbols.unwind import FLAG_RBP_UNKNOWN, ROW, load_table
path, cache = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
table = load_table(path, cache)
seconds = time.perf_counter() - t0
rbp_unknown = sum(1 for row in ROW.iter_unpack(table.rows) if row[2] & FLAG_RBP_UNKNOWN)
print(json.dumps({
    "seconds": seconds, "build_seconds": table.build_seconds, "rows": table.n_rows, "bytes": len(table.rows),
    "source": table.source, "types": table.type_counts(), "unsupported": table.unsupported,
    "reasons": dict(table.reasons), "skipped_fdes": table.skipped_fdes, "rbp_unknown_rows": rbp_unknown,
}))
"""

TYPE_NAMES = {"0": "rsp", "1": "rbp", "2": "plt", "3": "none", "4": "end"}


def measure(path: str, cache: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, path, cache], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout
    return json.loads(out)


def bench_object(path: str, repeats: int) -> dict:
    cold: list[float] = []
    cached: list[float] = []
    last: dict = {}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory(prefix="unwind-bench-") as cache:
            first = measure(path, cache)
            cold.append(first["seconds"])
            again = measure(path, cache)
            cached.append(again["seconds"])
            if again["rows"] != first["rows"]:
                raise SystemExit(f"{path}: the cached table differs from the one built ({again} vs {first})")
            last = first
    return {
        "path": os.path.realpath(path),
        "cold_s": statistics.median(cold),
        "cached_s": statistics.median(cached),
        "cold_all_s": cold,
        "cached_all_s": cached,
        **{k: v for k, v in last.items() if k != "seconds"},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("objects", nargs="*", default=DEFAULT_OBJECTS)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    results = [bench_object(p, args.repeats) for p in args.objects if os.path.exists(p)]
    print(f"{'object':<28} {'rows':>7} {'bytes':>9} {'cold':>8} {'cached':>8}  rows per CFA type")
    ok = True
    for r in results:
        types = ", ".join(f"{TYPE_NAMES.get(k, k)} {v}" for k, v in sorted(r["types"].items()))
        cold_ok = r["cold_s"] <= GOAL_COLD_S
        cached_ok = r["cached_s"] <= GOAL_CACHED_S
        ok &= cold_ok and cached_ok
        print(
            f"{Path(r['path']).name:<28} {r['rows']:>7} {r['bytes']:>9} "
            f"{r['cold_s'] * 1000:>6.0f}ms{'' if cold_ok else '!'} {r['cached_s'] * 1000:>6.1f}ms"
            f"{'' if cached_ok else '!'}  {types}"
        )
        print(
            f"{'':<28} {r['unsupported']} CFI rows given no rule, {r['rbp_unknown_rows']} rows with rbp unknown, "
            f"{r['skipped_fdes']} FDEs outside code"
        )
        for why, n in sorted(r["reasons"].items()):
            print(f"{'':<32}{n:>5}  {why}")
    print(f"goals: cold <= {GOAL_COLD_S:.0f} s, cached <= {GOAL_CACHED_S * 1000:.0f} ms: {'met' if ok else 'MISSED'}")

    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "when": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
                "host": platform.node(),
                "python": platform.python_version(),
                "repeats": args.repeats,
                "goals": {"cold_s": GOAL_COLD_S, "cached_s": GOAL_CACHED_S},
                "objects": results,
            },
            indent=2,
        )
        + "\n"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
