"""The kernel layer: the eBPF programs of probes/ compiled and loaded through bcc, their maps read, uprobes linked,
process events watched. The only layer that touches bcc. What the session sees of it is pure: the ABI shared with
probes/heap.h (abi) and the readers and settings of the probes (interface); only the pipeline makes HeapProbes."""
