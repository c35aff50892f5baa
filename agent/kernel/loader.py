"""Loading programs through bcc: the one import of bcc, the lock every load and unload holds, a program's text with
its parts written in, compiling it with clang's messages caught, and letting a program and what bcc keeps of it go."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import re
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from agent.errors import EnvironmentProblem


def load_bcc():  # type: ignore[no-untyped-def]
    try:
        import bcc
    except ImportError as exc:
        raise EnvironmentProblem("the bcc Python module is not available (python3-bpfcc; run `make setup`)") from exc
    return bcc


# libbcc keeps every loaded program's tables in one process-wide map, unguarded: two threads loading, unloading or
# looking up tables at once crashed a daemon with several targets (in ebpf::TableStorage). Every load and cleanup
# holds this lock, and each program's tables are looked up once, under it, at the load (cache_tables).
BCC_LOCK = threading.RLock()


def cache_tables(bpf: Any) -> None:
    """Look every table of a freshly loaded program up once (bcc caches the objects), so that later reads never
    search libbcc's shared table map while another thread changes it. Call with BCC_LOCK held."""
    lib = load_bcc().libbcc.lib
    lib.bpf_num_tables.restype = ctypes.c_size_t
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    for i in range(lib.bpf_num_tables(bpf.module)):
        name = lib.bpf_table_name(bpf.module, i)
        if name:
            with warnings.catch_warnings():  # bcc warns of str names, but the code reads tables by them: cache those
                warnings.simplefilter("ignore", DeprecationWarning)
                bpf[name.decode()]


def unload(bpf: Any) -> None:
    """Unload a program and let its Python objects go: bcc registers every BPF object's cleanup with atexit, which
    would keep each one, its tables and their ctypes types alive for the life of a daemon (megabytes a target)."""
    with BCC_LOCK:
        bpf.cleanup()
    atexit.unregister(bpf.cleanup)
    bpf.tables.clear()


# A part of a program (probes/bpf/): a line `#include "bpf/NAME.h"`.
_PART = re.compile(r'^#include "(bpf/[\w.-]+)"[ \t]*$', re.M)


def program_text(path: str | Path) -> str:
    """The program at `path` (probes/heap.bpf.c) as one text for bcc.BPF(text=...): each line `#include "bpf/NAME.h"`
    replaced by that file (found in the program's directory, a part's own parts too), between #line directives so
    that clang's messages name the file and line they come from. bcc rewrites table calls (`table.lookup(&key)`)
    and takes programs only in the main source it compiles: in a file clang includes, a table call is left as a call
    through a null pointer (the kernel refuses the program) and a program is not seen. Other includes (heap.h, types
    and sizes only) are left to clang and its -I."""
    main = Path(path)

    def written_in(source: Path) -> str:
        try:
            text = source.read_text()
        except OSError as exc:
            raise EnvironmentProblem(f"cannot read the BPF program's source {source}: {exc.strerror}") from exc
        pieces, at = [f'#line 1 "{source}"\n'], 0
        for part in _PART.finditer(text):
            pieces.append(text[at : part.start()])
            pieces.append(written_in(main.parent / part.group(1)))
            after = text.count("\n", 0, part.end()) + 2  # the number of the line after the include
            pieces.append(f'#line {after} "{source}"\n')
            at = part.end() + 1
        pieces.append(text[at:])
        return "".join(piece if piece.endswith("\n") else piece + "\n" for piece in pieces if piece)

    return written_in(main)


@contextlib.contextmanager
def captured_stderr() -> Iterator[Callable[[], list[str]]]:
    """Hold what clang and libbpf write to fd 2 while compiling, so errors reach the user as one line."""
    with contextlib.suppress(OSError, ValueError):  # a log that cannot be written (agent.log) is no error here
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: (tmp.seek(0), tmp.read().decode(errors="replace").splitlines())[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def compile_program(failure: str, **source: Any) -> Any:
    """bcc.BPF(**source) (text= or src_file=, and cflags=): compiled and loaded under BCC_LOCK, its tables looked
    up at once (cache_tables). A failure is an EnvironmentProblem, `failure` and the first error clang or libbpf
    wrote."""
    bcc = load_bcc()
    with BCC_LOCK, captured_stderr() as messages:
        try:
            bpf = bcc.BPF(**source)
        except Exception as exc:  # bcc raises bare Exception for compile, load and attach failures
            first = next((ln for ln in messages() if "error" in ln.lower()), str(exc))
            raise EnvironmentProblem(f"{failure}: {first.strip()}") from exc
        cache_tables(bpf)
    return bpf


def trim_heap() -> None:
    """Give the C heap's free memory back to the system. Compiling with clang allocates and frees some 40 MB,
    in the malloc arena of the thread that compiles (a daemon compiles in each target's own thread); glibc
    keeps such freed memory in the arena, so without this every target would add its compile's peak to the
    daemon's RSS for good."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
