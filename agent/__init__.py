"""heapscope agent: attach to a running process and profile its heap with eBPF.

Layers, imports flowing downward only:
  cli -> profiler -> {bpf, discovery, symbols} -> model -> exporters (massif, xtree)
The model and the exporters are pure Python and never import bcc; only agent.kernel.probes does.
"""

__version__ = "0.1.0"
