"""Symbols and unwinding: ELF objects, DWARF names and lines with Valgrind's naming rules, separate debug files,
and the unwind tables compiled from .eh_frame for the kernel's stack walker."""
