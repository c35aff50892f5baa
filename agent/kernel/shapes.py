"""One loaded heap program per shape, shared by every target of that shape in this process.

A shape is what changes the program's code or its maps' sizes (the -D defines of probes.shape_cflags): a daemon
whose targets share their settings compiles and verifies the program once, and a further target only takes a slot,
gets maps of its own and links its uprobes with the slot as their cookie (probes/bpf/common.h). Slot 0 uses the maps
bcc made (the templates); every other slot gets copies made with BPF_MAP_CREATE, put in the slot of each per-target
map's array of maps. A target's detach removes its links, its entries and its maps; the others go on recording.
"""

from __future__ import annotations

import copy
import ctypes
import mmap
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ClassVar

import numpy as np

from agent.errors import EnvironmentProblem
from agent.kernel.abi import CTL_COUNT
from agent.kernel.arrays import MappedWords
from agent.kernel.emptying import MapInfo, empty_map, map_info
from agent.kernel.links import BPF_TRACE_UPROBE_MULTI, bpf_syscall
from agent.kernel.loader import BCC_LOCK, compile_program, load_bcc, trim_heap, unload
from agent.kernel.waits import side_by_side

SLOT_SHIFT = 56  # a block's key: its address | slot << SLOT_SHIFT (probes/bpf/blocks.h block_key)
_BPF_MAP_CREATE = 0


class _CreateAttr(ctypes.Structure):
    _fields_ = [
        ("map_type", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("inner_map_fd", ctypes.c_uint32),
        ("numa_node", ctypes.c_uint32),
        ("map_name", ctypes.c_char * 16),
    ]


def clone_map(info: MapInfo) -> int:
    """A new, empty map like the one `info` describes (type, sizes, flags, name); returns its descriptor."""
    attr = _CreateAttr(info.type, info.key_size, info.value_size, info.max_entries, info.map_flags, 0, 0, info.name)
    new = bpf_syscall(_BPF_MAP_CREATE, attr)
    if new < 0:
        raise EnvironmentProblem(f"cannot create a map for a new target ({info.name.decode()}): {os.strerror(-new)}")
    return new


def _in_maps_of_maps(outer_fds: Sequence[int], slot: int, inner_fds: Sequence[int] | None) -> None:
    """Put each inner map at `slot` of its outer map (or, with inner_fds None, take it out), all at once: the kernel
    ends every update or delete of a map of maps with a wait for an RCU grace period (tens of milliseconds here),
    and the waits of calls made side by side end together. One after another, a target's twenty maps took a
    quarter of a second to its first recorded call."""
    lib = load_bcc().libbcc.lib
    key = ctypes.c_int(slot)

    def one(i: int) -> int:
        if inner_fds is None:
            lib.bpf_delete_elem(outer_fds[i], ctypes.byref(key))  # already gone: nothing to take out
            return 0
        return int(lib.bpf_update_elem(outer_fds[i], ctypes.byref(key), ctypes.byref(ctypes.c_int(inner_fds[i])), 0))

    failed = [r for r in side_by_side(one, range(len(outer_fds))) if r != 0]
    if failed:
        raise EnvironmentProblem(f"cannot give a new target its maps: {os.strerror(abs(failed[0]))}")


class TargetMaps:
    """One target's maps in its shape: bcc table objects (for their key and value types) on the target's own
    descriptors. The counters and control words are the shape's, at the target's slot."""

    def __init__(self, shape: ProgramShape, slot: int, tables: dict[str, Any], owned: list[int]) -> None:
        self.shape = shape
        self.slot = slot
        self.tables = tables
        self._owned = owned  # descriptors of the copies (slot 0 owns none: bcc's maps are its maps)

    def __getitem__(self, name: str) -> Any:
        own = self.tables.get(name)  # (not `or`: a table's truth is its length, and an empty hash map is false)
        return own if own is not None else self.shape.bpf[name]

    def empty(self, infos: dict[str, MapInfo], sites: int) -> None:
        """Make the maps as empty as new ones for the slot's next target (agent.kernel.emptying); the arrays indexed
        by site id as far as `sites` ids reach. Only while the slot has no target."""
        for name, table in self.tables.items():
            empty_map(table.map_fd, infos[name], sites if name in _BY_SITE else None)
            if hasattr(table, "_open_key_fds"):  # a perf event array: no reader of the last target's left
                table._open_key_fds = {}
                table._cbs = {}

    def close(self) -> None:
        for fd in self._owned:
            os.close(fd)
        self._owned.clear()


# The per-target arrays indexed by site id: emptied as far as the last target's site ids reached.
_BY_SITE = frozenset({"sites", "site_flags"})
# A slot's maps are kept for its next target, emptied, for this many slots at most (those of a fleet's churn);
# beyond, a detached target's maps are freed, so that the kernel memory a shape holds without targets is bounded.
KEPT_SLOTS = 8

# Detached targets' blocks are forgotten in batches: one pass over the block table (15 ms in exact mode) for this
# many detaches; a target that leaves this many live blocks or more has its own pass at once.
PURGE_BATCH = 8
PURGE_NOW_BLOCKS = 1 << 16


class ProgramShape:
    """A compiled and loaded heap program and the slots of its targets. Get one with ProgramShape.acquire and give
    it back with release: the last release unloads it."""

    _shapes: ClassVar[dict[tuple[str, ...], ProgramShape]] = {}
    _shapes_lock = threading.Lock()

    def __init__(
        self, key: tuple[str, ...], source: str, cflags: list[str], slots: int, links: bool, only: set[bytes] | None
    ) -> None:
        self.key = key
        self.links = links  # programs loaded for uprobe_multi links (whose cookie is the slot), else perf events
        self.bpf = compile_program("cannot compile or load the BPF program", text=source.encode(), cflags=cflags)
        self.lock = threading.Lock()
        self.slots = slots
        self._free = list(range(slots - 1, -1, -1))  # slot 0 first: the first target uses bcc's maps
        # Slots given back whose blocks are still in the shared tables: forgotten together (one pass over the table
        # for several detaches), before any of them is used again (_purge_dirty).
        self._dirty: list[int] = []
        self._purge_lock = threading.Lock()  # one purge at a time: a slot is free only once its blocks are gone
        self._programs: dict[bytes, Any] = {}
        self._walkers_installed = False
        self.users = 0
        self._idle: threading.Timer | None = None  # the unload of a shape kept loaded without targets (release)
        self._blocks_mem: mmap.mmap | None = None  # exact mode's block table, mapped at the first detach
        # The copy of its address column a purge looks at, kept: made anew at each purge, its 8 MB were faulted in
        # (and zeroed by the kernel) each time, a tenth of the daemon's CPU in a fleet's churn.
        self._blocks_column: np.ndarray | None = None
        self._kept: dict[int, TargetMaps] = {}  # slot -> the maps its last target had, for its next (give_back)
        self._infos: dict[str, MapInfo] | None = None  # the per-target maps' descriptions, read once (_map_infos)
        # exact mode's shared block tables (block_slots, blocks); sampled mode's are compiled at their smallest and
        # unused: its programs and hooks record no block there (interface.py)
        self._block_tables = self.bpf["block_slots"].max_entries > 2
        # The per-target maps: each one that has an array of maps NAME_of (probes/bpf/common.h).
        self.per_target = sorted(name[:-3] for name in self.bpf.tables if name.endswith("_of"))
        self._map_fds: list[int] = []  # the maps' own descriptors once bcc's module is freed
        try:
            self.load(self._function_names() if only is None else only)
            self._tracepoints = list(self.bpf.tracepoint_fds)  # attached by bcc at the compile
            self._release_compiler()
            # Every target's counters and control words, read in place (each slot's at its index).
            self.globals = MappedWords(self.bpf["globals"], slots)
            self.control = MappedWords(self.bpf["control"], slots * CTL_COUNT)
        except BaseException:
            unload(self.bpf)
            raise

    def _function_names(self) -> list[bytes]:
        """Every program of the source but the tracepoints bcc loads and attaches itself: all are loaded at once, so
        that the compiler can be freed and a further target of any allocator finds what it needs."""
        lib = load_bcc().libbcc.lib
        lib.bpf_num_functions.restype = ctypes.c_size_t
        lib.bpf_num_functions.argtypes = [ctypes.c_void_p]
        lib.bpf_function_name.restype = ctypes.c_char_p
        lib.bpf_function_name.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        with BCC_LOCK:
            names = [lib.bpf_function_name(self.bpf.module, i) for i in range(lib.bpf_num_functions(self.bpf.module))]
        return [n for n in names if n and not n.startswith(b"tracepoint__")]

    def _release_compiler(self) -> None:
        """Free what bcc keeps of the compilation once every program is loaded: its module holds clang's LLVM
        context, the optimized IR, the JIT's objects and the rewritten source of every function, ~8 MB for as long
        as the program lives. The maps' descriptors are owned by that module, so each table (all were looked up at
        the load: cache_tables) gets a descriptor of its own first."""
        lib = load_bcc().libbcc.lib
        with BCC_LOCK:  # the module's tables leave libbcc's process-wide table map
            for table in self.bpf.tables.values():
                table.map_fd = os.dup(table.map_fd)
                self._map_fds.append(table.map_fd)
            lib.bpf_module_destroy(self.bpf.module)
            self.bpf.module = None

    # ---- life cycle -----------------------------------------------------------------------------------

    @classmethod
    def acquire(
        cls,
        key: tuple[str, ...],
        source: Callable[[], str],
        cflags: list[str],
        slots: int,
        links: bool,
        only: set[bytes] | None,
    ) -> ProgramShape:
        """The loaded program of this shape, compiled now (from the text `source` gives: read only then) if no
        target of this process has it: with every program of its source, or `only` these (a command's one target:
        the others would only cost their verification)."""
        with cls._shapes_lock:
            shape = cls._shapes.get(key)
            if shape is None:
                shape = cls._shapes[key] = ProgramShape(key, source(), cflags, slots, links, only)
                trim_heap()
            if shape._idle is not None:  # kept loaded after its last target: in use again
                shape._attach_tracepoints()
                shape._idle.cancel()
                shape._idle = None
            shape.users += 1
            return shape

    def release(self, keep: float = 0.0) -> None:
        """A target is done with the shape; the last one unloads it, at once or, with `keep`, once the shape has
        had no target for that many seconds: a daemon whose workers recycle, or that is asked to attach again and
        again, compiles and verifies each shape once (seconds of CPU), not at each first target after a gap."""
        with self._shapes_lock:
            self.users -= 1
            if self.users > 0:
                return
            if keep > 0:
                self._detach_tracepoints()
                self._idle = threading.Timer(keep, self._unload_if_idle)
                self._idle.daemon = True
                self._idle.start()
                return
            self._shapes.pop(self.key, None)
        self._unload()

    def _detach_tracepoints(self) -> None:
        """A shape kept loaded without a target leaves its tracepoints until its next target: an attached system call
        tracepoint costs every system call on the machine (tens of nanoseconds each), not only the targets'. The
        programs stay loaded, so attaching them again takes milliseconds."""
        with BCC_LOCK:
            for tp in self._tracepoints:
                if tp in self.bpf.tracepoint_fds:
                    self.bpf.detach_tracepoint(tp)

    def _attach_tracepoints(self) -> None:
        with BCC_LOCK:
            for tp in self._tracepoints:
                if tp in self.bpf.tracepoint_fds:
                    continue
                try:  # bcc's program of a TRACEPOINT_PROBE, loaded with the others at the compile
                    self.bpf.attach_tracepoint(tp=tp, fn_name=b"tracepoint__" + tp.replace(b":", b"__"))
                except Exception as e:  # bcc raises Exception itself
                    raise EnvironmentProblem(f"cannot attach to the tracepoint {tp.decode()}: {e}") from None

    def _unload_if_idle(self) -> None:
        with self._shapes_lock:  # held through the unload: whoever sees it gone finds it unloaded
            if self.users > 0 or self._shapes.get(self.key) is not self:
                return  # taken again meanwhile
            self._shapes.pop(self.key)
            if self._idle is not None:
                self._idle.cancel()
                self._idle = None
            self._unload()

    @classmethod
    def unload_kept(cls) -> None:
        """Unload now every shape kept loaded without a target."""
        with cls._shapes_lock:
            kept = [shape for shape in cls._shapes.values() if shape.users == 0]
        for shape in kept:
            shape._unload_if_idle()

    def _unload(self) -> None:
        with self.lock:
            kept, self._kept = list(self._kept.values()), {}
        for maps in kept:
            maps.close()
        self.globals.close()
        self.control.close()
        if self._blocks_mem is not None:
            self._blocks_mem.close()
            self._blocks_mem = self._blocks_column = None
        unload(self.bpf)
        for fd in self._map_fds:
            os.close(fd)
        self._map_fds.clear()

    @classmethod
    def loaded(cls) -> list[ProgramShape]:
        """The shapes loaded in this process now (for tests and the daemon's figures)."""
        with cls._shapes_lock:
            return list(cls._shapes.values())

    # ---- programs -------------------------------------------------------------------------------------

    def program(self, name: bytes) -> Any:
        """A program of this shape, loaded (and verified) when the shape was: for a uprobe_multi link (or a perf
        event), or a tracepoint for the page walker."""
        with self.lock:
            got = self._programs.get(name)
        if got is not None:
            return got
        if self.bpf.module is None:
            raise EnvironmentProblem(f"the BPF program has no function {name.decode()}")
        bcc = load_bcc()
        try:
            if name == b"page_enter_walk":
                got = self.bpf.load_func(name, bcc.BPF.TRACEPOINT)
            elif self.links:
                got = self.bpf.load_func(name, bcc.BPF.KPROBE, attach_type=BPF_TRACE_UPROBE_MULTI)
            else:
                got = self.bpf.load_func(name, bcc.BPF.KPROBE)
        except Exception as exc:  # bcc raises bare Exception when the verifier refuses a program
            raise EnvironmentProblem(f"the kernel refused the BPF program {name.decode()}: {exc}") from exc
        with self.lock:
            return self._programs.setdefault(name, got)

    def load(self, names: Iterable[bytes]) -> None:
        """Load these programs, two at a time: the kernel verifies each on the calling thread and ctypes lets go of
        the GIL meanwhile, so on two CPUs the programs that walk stacks take half as long."""
        with self.lock:
            missing = sorted(set(names) - set(self._programs))
        if missing:
            with ThreadPoolExecutor(max_workers=2, thread_name_prefix="bpf-load") as pool:
                list(pool.map(self.program, missing))

    def install_walkers(self, walkers: Sequence[tuple[str, bytes]]) -> None:
        """The programs holding the shared copies of the stack walk, in the program arrays the probes tail-call:
        once per shape, before any probe of it can fire."""
        with self.lock:
            if self._walkers_installed:
                return
        for table, name in walkers:
            self.bpf[table][ctypes.c_int(0)] = ctypes.c_int(self.program(name).fd)
        with self.lock:
            self._walkers_installed = True

    # ---- targets --------------------------------------------------------------------------------------

    def take_slot(self, tgid: int) -> TargetMaps:
        """A slot for the process tgid, with maps of its own (the slot's last target's, emptied, or new ones), its
        counters and control words zeroed, and the tracepoints told where it is. Raises EnvironmentProblem when
        every slot is taken."""
        with self.lock:
            short = not self._free and bool(self._dirty)
        if short:
            self._purge_dirty()
        with self.lock:
            if not self._free:
                raise EnvironmentProblem(
                    f"every slot of the BPF program is taken ({self.slots} targets of these settings at once)"
                )
            # a slot whose maps were kept first, else the last freed
            slot = next((s for s in reversed(self._free) if s in self._kept), self._free[-1])
            self._free.remove(slot)
            kept = self._kept.pop(slot, None)
        maps = None
        try:
            maps = self._emptied(kept, slot) if kept is not None else None
            if maps is None:
                maps = self._new_maps(slot)
            self._reset_slot(slot)
            self.bpf["targets"][ctypes.c_uint32(tgid)] = ctypes.c_uint32(slot)
        except BaseException:
            if maps is not None:  # the slot's next target gets new ones
                maps.close()
            with self.lock:
                self._free.append(slot)
            raise
        return maps

    def _emptied(self, kept: TargetMaps, slot: int) -> TargetMaps | None:
        """The slot's kept maps emptied for a new target, or None (closed) when the kernel refused: new ones then."""
        n_sites = self.bpf["globals"].Leaf.n_sites.offset // 8
        sites = self.globals.words[slot * self.globals.stride // 8 + n_sites] + 1  # the last target's, before the reset
        try:
            kept.empty(self._map_infos(), sites)
        except EnvironmentProblem:
            kept.close()
            return None
        return kept

    def _map_infos(self) -> dict[str, MapInfo]:
        with self.lock:
            if self._infos is None:
                self._infos = {name: map_info(self.bpf[name].map_fd) for name in self.per_target}
            return self._infos

    def _new_maps(self, slot: int) -> TargetMaps:
        """New maps for the slot, put in the arrays of maps (slot 0 takes bcc's own, the templates)."""
        tables: dict[str, Any] = {}
        owned: list[int] = []
        infos = self._map_infos() if slot else {}
        try:
            with BCC_LOCK:
                for name in self.per_target:
                    template = self.bpf[name]
                    own = copy.copy(template)
                    if hasattr(own, "_open_key_fds"):  # a perf event array: readers of its own
                        own._open_key_fds = {}
                        own._cbs = {}
                    if slot:
                        own.map_fd = clone_map(infos[name])
                        owned.append(own.map_fd)
                    tables[name] = own
            outer = [self.bpf[f"{name}_of"].map_fd for name in self.per_target]
            _in_maps_of_maps(outer, slot, [tables[name].map_fd for name in self.per_target])
        except BaseException:
            for fd in owned:
                os.close(fd)
            raise
        return TargetMaps(self, slot, tables, owned)

    def _reset_slot(self, slot: int) -> None:
        """Zero a slot's counters and control words (a slot is used again after its target left) and write its
        number into its counters, where the programs find it."""
        glob = self.bpf["globals"]
        fresh = glob.Leaf()
        fresh.slot = slot
        glob[ctypes.c_int(slot)] = fresh
        control = self.bpf["control"]
        for index in range(slot * CTL_COUNT, (slot + 1) * CTL_COUNT):
            control[ctypes.c_int(index)] = ctypes.c_uint64(0)

    def _purge_blocks(self, slots: Sequence[int]) -> None:
        """Forget the blocks these slots' targets left in the shared block tables (their links are gone: nothing
        adds more), so that the next target of a slot does not find them. The other targets' entries are left as
        they are: no program of theirs writes an entry that holds another target's key. One pass over the tables,
        however many slots: the exact table's scan is some 15 ms. Sampled mode's tables are unused: nothing to do."""
        if not self._block_tables:
            return
        table = self.bpf["block_slots"]
        lib = load_bcc().libbcc.lib
        gone = np.array(sorted(slots), dtype=np.uint64)
        with self.lock:  # mapped once a shape: mapping its 32 MB again at each detach cost more
            if self._blocks_mem is None:
                size = table.max_entries * ctypes.sizeof(table.Leaf)
                prot = mmap.PROT_READ | mmap.PROT_WRITE
                self._blocks_mem = mmap.mmap(table.map_fd, size, flags=mmap.MAP_SHARED, prot=prot)
                self._blocks_column = np.empty(table.max_entries, dtype=np.uint64)
            mem, column = self._blocks_mem, self._blocks_column
        assert column is not None
        entries = np.frombuffer(mem, dtype=np.uint64).reshape(-1, ctypes.sizeof(table.Leaf) // 8)
        addr = entries[:, 0]
        # The table is mostly empty: look at its entries only, in a copy of the column: the live targets'
        # probes change the table meanwhile, and np.nonzero in place, which counts the entries before it lists
        # them, then fails ("number of non-zero array elements changed"). A row seen holding a gone slot's
        # entry still holds it (nothing removes it but this, nothing else takes a held row).
        np.copyto(column, addr)
        held = np.flatnonzero(column)
        addr[held[np.isin(column[held] >> np.uint64(SLOT_SHIFT), gone)]] = 0
        del entries, addr, held  # no view may outlive the mapping (closed at the unload)
        hashed = self.bpf["blocks"]
        keys = [int(getattr(k, "value", k)) for k in list(hashed)]
        wanted = set(slots)
        for key in keys:
            if key >> SLOT_SHIFT in wanted and key & ((1 << SLOT_SHIFT) - 1):
                lib.bpf_delete_elem(hashed.map_fd, ctypes.byref(ctypes.c_uint64(key)))

    def _purge_dirty(self) -> None:
        """The dirty slots' blocks forgotten, and the slots free again (slot 0 excepted: see give_back)."""
        with self._purge_lock:
            with self.lock:
                dirty, self._dirty = self._dirty, []
            if not dirty:
                return
            try:
                self._purge_blocks(dirty)
            except BaseException:
                with self.lock:  # still dirty: never used again before a purge has forgotten their blocks
                    self._dirty.extend(dirty)
                raise
            with self.lock:
                self._free.extend(s for s in dirty if s)

    def give_back(self, maps: TargetMaps, tgid: int, blocks_left: int) -> None:
        """A target's detach: its entry goes, and its maps are kept for the slot's next target (KEPT_SLOTS) or
        freed; the slot is free again once its blocks are forgotten, with other slots' (PURGE_BATCH at once), or at
        once when it left many (PURGE_NOW_BLOCKS: their room in the shared table is not held for others) or a new
        target needs the slot. Slot 0's maps are bcc's own, which the next target would find full of this one's
        figures: it is not used again."""
        lib = load_bcc().libbcc.lib
        lib.bpf_delete_elem(self.bpf["targets"].map_fd, ctypes.byref(ctypes.c_uint32(tgid)))
        with self.lock:
            keep = bool(maps.slot) and len(self._kept) < KEPT_SLOTS
            if keep:  # still in the arrays of maps, found by no program: its links are gone, and so is its entry
                self._kept[maps.slot] = maps
        if not keep:
            # the programs find no map at the slot from here on
            _in_maps_of_maps([self.bpf[f"{name}_of"].map_fd for name in self.per_target], maps.slot, None)
            maps.close()
        with self.lock:
            self._dirty.append(maps.slot)
            # Without exact mode's block tables there is nothing to forget: the slot, and the maps kept with it, are
            # free at once (else the next targets took never-used slots and made new maps, 3-4 ms each, a worker's
            # churn in a prefork server).
            now = blocks_left >= PURGE_NOW_BLOCKS or len(self._dirty) >= PURGE_BATCH or not self._block_tables
        if now:
            self._purge_dirty()
