"""heapscope: heap profiling of running processes with eBPF and an injected sampler, Massif-compatible.

Layers, imports flowing downward only (declared in pyproject.toml, checked by import-linter):
  cli -> api | daemon -> session | offline -> kernel | export -> process | store -> symbols -> model
  -> contract | errors | argtypes | log
The model, the exporters and the store are pure Python (no process, no kernel); only agent.kernel imports bcc.
docs/ARCHITECTURE.md walks through the pipeline.
"""

__version__ = "0.1.0"
