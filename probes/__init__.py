"""The kernel and in-process parts heapscope builds at run time: heap.bpf.c (its parts in bpf/) and
procevents.bpf.c, compiled by bcc with heap.h shared with agent/contract.py; sampler/, the library injected in
sampled mode (see sampler/README.md)."""
