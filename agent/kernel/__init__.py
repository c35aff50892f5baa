"""The kernel layer: the eBPF programs of probes/ compiled and loaded through bcc, their maps read, uprobes linked,
process events watched. The only layer that touches bcc."""
