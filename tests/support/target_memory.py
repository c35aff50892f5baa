"""A live target's memory read from outside, as the sampler tests check it: a GOT slot, a word, a libc function's
address."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from elftools.elf.elffile import ELFFile
from elftools.elf.relocation import RelocationSection

from agent.process.sampler import read_map_lines
from agent.symbols.elf import open_elf


def got_slot(pid: int, exe: Path, symbol: str) -> int:
    """Address of the executable's GOT slot for `symbol` in process `pid`."""
    base = next(m.start for m in read_map_lines(pid) if m.offset == 0 and os.path.samefile(m.path, exe))
    with open(exe, "rb") as f:
        elf = ELFFile(f)
        pie = elf.header["e_type"] == "ET_DYN"
        for section in elf.iter_sections():
            if not isinstance(section, RelocationSection):
                continue
            symtab = elf.get_section(section["sh_link"])
            for rel in section.iter_relocations():
                if rel["r_info_sym"] and symtab.get_symbol(rel["r_info_sym"]).name == symbol:
                    return (base if pie else 0) + rel["r_offset"]
    raise AssertionError(f"{exe} has no relocation for {symbol}")


def read_word(pid: int, address: int) -> int:
    with open(f"/proc/{pid}/mem", "rb") as f:
        f.seek(address)
        return struct.unpack("<Q", f.read(8))[0]


def libc_function(pid: int, name: str) -> int:
    libc = next(m for m in read_map_lines(pid) if os.path.basename(m.path).startswith("libc.so") and m.offset == 0)
    found = open_elf(f"/proc/{pid}/root{libc.path}").find_symbol(name)
    assert found is not None
    return libc.start + found[0]
