"""The man page (heapscope.1) and the CLI reference (docs/cli.md) are what scripts/gen_cli_docs.py makes of the
argument parser now: an option added without running the script fails here. And `man -l` renders the page
without a warning."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_cli_docs.py"
REGENERATE = f".venv/bin/python {SCRIPT.relative_to(REPO)}"


def _generator():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gen_cli_docs", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


GEN = _generator()


@pytest.mark.parametrize("path", [GEN.MAN_PAGE, GEN.CLI_REFERENCE], ids=lambda p: p.name)
def test_committed_file_is_what_the_parser_gives(path: Path) -> None:
    expected = GEN.outputs()[path]
    assert path.exists(), f"{path.relative_to(REPO)} is missing: run {REGENERATE}"
    assert path.read_text() == expected, f"{path.relative_to(REPO)} is out of date: run {REGENERATE}"


def test_every_command_and_option_is_documented() -> None:
    parser = GEN.build_parser()
    page, reference = GEN.man(parser), GEN.markdown(parser)
    for command in GEN.commands(parser):
        assert f"## heapscope {command.name}\n" in reference
        assert f'.SS "heapscope {command.name}"' in page
        for group in command.groups:
            for option in group.options:
                for name in option.names:
                    assert f"`{name}" in reference or f", {name}" in reference, name
                    assert GEN._roff(name) in page, name


def test_an_added_option_makes_the_files_differ() -> None:
    parser = GEN.build_parser()
    before = (GEN.man(parser), GEN.markdown(parser))
    run = GEN._subparsers(parser).choices["run"]
    run.add_argument("--an-option-nobody-documented", help="made up by the test")
    after = (GEN.man(parser), GEN.markdown(parser))
    assert "an\\-option\\-nobody\\-documented" in after[0] and "--an-option-nobody-documented" in after[1]
    assert before[0] != after[0] and before[1] != after[1]


def test_check_mode_reports_a_stale_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page, reference = tmp_path / "heapscope.1", tmp_path / "cli.md"
    monkeypatch.setattr(GEN, "REPO", tmp_path)
    monkeypatch.setattr(GEN, "MAN_PAGE", page)
    monkeypatch.setattr(GEN, "CLI_REFERENCE", reference)
    real = GEN.outputs

    def outputs() -> dict[Path, str]:
        texts = list(real().values())
        return {page: texts[0], reference: texts[1]}

    monkeypatch.setattr(GEN, "outputs", outputs)
    assert GEN.main(["--check"]) == 1  # neither file exists
    assert GEN.main([]) == 0
    assert GEN.main(["--check"]) == 0
    reference.write_text(reference.read_text() + "- `--by-hand`: an option written in by hand\n")
    assert GEN.main(["--check"]) == 1


@pytest.mark.needs("man")
def test_man_renders_the_page_without_warnings() -> None:
    env = {**os.environ, "MANPAGER": "cat", "PAGER": "cat", "MANWIDTH": "80", "LC_ALL": "C.UTF-8"}
    done = subprocess.run(["man", "--warnings=all", "-l", str(GEN.MAN_PAGE)], capture_output=True, text=True,
                          env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert "HEAPSCOPE(1)" in done.stdout
    for section in ("NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "EXIT STATUS", "ENVIRONMENT"):
        assert f"\n{section}\n" in done.stdout, section
    assert "heapscope attach [options] PID" in done.stdout
