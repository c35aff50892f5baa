"""Fixtures for the integration tests: compile the C/C++ programs, run them under real Valgrind Massif and
under heapscope, and hand the outputs to the real readers (ms_print, callgrind_annotate).

These tests need root, BPF with uprobes and kernel headers: the fixtures that ask for them (`bpf_ready`,
`valgrind_tools`) are in tests/conftest.py, with every other capability skip.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import pytest

# tests/ is not a package installed in the venv: make `tests.support` and `tests.integration` importable.
_REPO = Path(__file__).resolve().parents[2]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from tests.support.harness import (  # noqa: E402
    DEBUG_FLAGS,
    ORACLE_OPTIONS,
    PROGRAMS,
    REPO,
    RUN_TIMEOUT,
    Completed,
)


@pytest.fixture(scope="session")
def cli_cmd() -> list[str]:
    """The command that runs the heapscope CLI (for checks that need no probes, such as bad options)."""
    exe = REPO / ".venv" / "bin" / "heapscope"
    if exe.exists():
        return [str(exe)]
    return [sys.executable, "-m", "agent.cli"]


@pytest.fixture(scope="session")
def heapscope_cmd(bpf_ready: None, cli_cmd: list[str]) -> list[str]:
    """The CLI, on a machine where it can attach probes."""
    return cli_cmd


@pytest.fixture(scope="session")
def build(tmp_path_factory: pytest.TempPathFactory, valgrind_tools: None) -> Callable[..., Path]:
    """build(source, flags=DEBUG_FLAGS, shared=False) -> the compiled program (cached per session)."""
    out_dir = tmp_path_factory.mktemp("bin")
    cache: dict[tuple[str, tuple[str, ...], bool], Path] = {}

    def _build(source: str, flags: Sequence[str] = DEBUG_FLAGS, shared: bool = False) -> Path:
        key = (source, tuple(flags), shared)
        if key in cache:
            return cache[key]
        src = PROGRAMS / source
        stem = src.stem + ("-O2" if "-O2" in flags else "")
        target = out_dir / (f"{stem}.so" if shared else stem)
        compiler = "g++" if src.suffix == ".cpp" else "gcc"
        cmd = [compiler, *flags, "-o", str(target), str(src)]
        if shared:
            cmd[1:1] = ["-shared", "-fPIC"]
        else:
            cmd += ["-lpthread", "-ldl"]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{' '.join(cmd)} failed:\n{done.stderr}"
        cache[key] = target
        return target

    return _build


@pytest.fixture(scope="session")
def run_massif(valgrind_tools: None, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Completed]:
    """run_massif(program, args=(), options=(), xtree=False) -> Completed, under valgrind --tool=massif.
    Each run gets its own directory (session scope: the oracle's cases share one run per program)."""

    def _run(program: Path, args: Sequence[str] = (), options: Sequence[str] = (), xtree: bool = False) -> Completed:
        tmp_path = tmp_path_factory.mktemp("massif")
        out = tmp_path / "ref.out"
        xt = tmp_path / "ref.xtree" if xtree else None
        cmd = ["valgrind", "-q", "--tool=massif", *ORACLE_OPTIONS, *options, f"--massif-out-file={out}"]
        if xt is not None:
            cmd += ["--xtree-memory=full", f"--xtree-memory-file={xt}"]
        done = subprocess.run(
            [*cmd, str(program), *args],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            cwd=tmp_path,
            check=False,
        )
        return Completed(done.returncode, done.stdout, done.stderr, out, xt)

    return _run


@pytest.fixture(scope="session")
def run_heapscope(heapscope_cmd: list[str], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Completed]:
    """run_heapscope(program, args=(), options=(), xtree=False, env=None) -> Completed, under `heapscope run`
    (env: variables set on top of ours)."""

    def _run(
        program: Path,
        args: Sequence[str] = (),
        options: Sequence[str] = (),
        xtree: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> Completed:
        tmp_path = tmp_path_factory.mktemp("heapscope")
        out = tmp_path / "heapscope.out"
        xt = tmp_path / "heapscope.xtree" if xtree else None
        summary = tmp_path / "summary.json"
        cmd = [*heapscope_cmd, "run", *ORACLE_OPTIONS, *options, f"--massif-out-file={out}"]
        cmd.append(f"--summary-file={summary}")
        if xt is not None:
            cmd += ["--xtree-memory=full", f"--xtree-memory-file={xt}"]
        done = subprocess.run(
            [*cmd, "--", str(program), *args],
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
            cwd=tmp_path,
            check=False,
            env={**os.environ, **(env or {})},
        )
        assert "Traceback" not in done.stderr, done.stderr
        return Completed(done.returncode, done.stdout, done.stderr, out, xt, summary)

    return _run
