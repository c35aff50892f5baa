"""heapscope's tests: unit/ (pure logic; `make unit` runs those not marked `tools` with no root and no external
tools), integration/ (real probes on real programs and services, judged by Valgrind, ms_print, callgrind_annotate,
go tool pprof and Chromium), support/ (what they share). Capability skips are in conftest.py."""
