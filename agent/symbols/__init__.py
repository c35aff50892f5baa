"""Symbols and unwinding: ELF objects, function names by Valgrind's rules, DWARF lines and inlined calls, separate
debug files, the frames they make, and the unwind tables compiled from .eh_frame for the kernel's stack walker."""
