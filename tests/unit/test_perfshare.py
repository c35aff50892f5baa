"""bench/perfshare.py's count of `perf script` samples by where they fell (bench/request_cost.py --perf): pure
parsing of the text perf writes, with samples as perf 6.1 prints them."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from perfshare import HZ, count_samples

SAMPLER = "/var/cache/heapscope/libhs_sampler-cadd7b21616f6cdf.so"

IN_BPF = f"""apache2 32375
\tffffffffc002997f bpf_prog_6e997e293d7ff0c3_sample_alloc_enter (bpf_prog_6e997e293d7ff0c3_sample_alloc_enter)
\tffffffff814cee9f uprobe_prog_run ([kernel.kallsyms])
\tffffffff8159e989 handle_syscall_uprobe ([kernel.kallsyms])
\tffffffff8133e547 __x64_sys_uprobe ([kernel.kallsyms])
\tffffffff8223b5d1 do_syscall_64 ([kernel.kallsyms])
\t            3700 hs_sample_alloc ({SAMPLER})
\t            8e6e deflateInit2_ (/usr/lib/x86_64-linux-gnu/libz.so.1.2.13)
"""
# the way in: under the uprobe's entry, no program on the stack
IN_UPROBE = f"""apache2 32375
\tffffffff8159e271 handler_chain ([kernel.kallsyms])
\tffffffff8159e989 handle_syscall_uprobe ([kernel.kallsyms])
\tffffffff8133e547 __x64_sys_uprobe ([kernel.kallsyms])
\t            3843 hs_sample_free ({SAMPLER})
"""
IN_SAMPLER = f"""apache2 32376
\t            3843 hs_hook_free ({SAMPLER})
\t           2f1a0 apr_pool_destroy (/usr/lib/x86_64-linux-gnu/libapr-1.so.0.7.2)
"""
# the sampler calls malloc: the time in malloc is the service's own, not the sampler's
SAMPLER_BELOW = f"""apache2 32376
\t           a1b2c _int_malloc (/usr/lib/x86_64-linux-gnu/libc.so.6)
\t            3843 hs_hook_malloc ({SAMPLER})
"""
OWN = """apache2 32376
\tffffffff81e0a1c0 tcp_sendmsg ([kernel.kallsyms])
\t           11d2b writev (/usr/lib/x86_64-linux-gnu/libc.so.6)
"""
IDLE = """swapper     0
\tffffffff82240ddb pv_native_safe_halt ([kernel.kallsyms])
"""
LOAD_TOOL = """ab 4410
\tffffffff81e0a1c0 tcp_sendmsg ([kernel.kallsyms])
"""
HEAPSCOPE = """python 4000
\t          1234 _PyEval_EvalFrameDefault (/usr/lib/libpython3.11.so)
"""


def _text(*blocks: str) -> str:
    return "\n".join(blocks) + "\n"


def test_samples_fall_where_their_stack_says() -> None:
    """Only the service's samples count (not the idle CPU's, the load tool's or heapscope's); of them, those under a
    probe's entry, those in a BPF program there, and those at the sampler's own code."""
    s = count_samples(_text(IN_BPF, IN_UPROBE, IN_SAMPLER, SAMPLER_BELOW, OWN, OWN, IDLE, LOAD_TOOL, HEAPSCOPE),
                      "apache2")
    assert (s.service, s.probes, s.bpf, s.sampler) == (6, 2, 1, 1)


def test_another_services_command_name_picks_its_samples() -> None:
    s = count_samples(_text(HEAPSCOPE, IN_BPF), "python")
    assert (s.service, s.probes, s.sampler) == (1, 0, 0)


def test_samples_become_microseconds_a_request() -> None:
    s = count_samples(_text(*[OWN] * HZ), "apache2")  # one CPU for one second
    assert s.us(s.service, requests=1000) == 1000.0
    assert s.us(s.service, requests=0) == 0.0
