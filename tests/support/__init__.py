"""What the tests share: the integration harness and the programs' runs, readers of every output (Massif, MALT,
the store, the page), the oracle's comparisons with Valgrind, fakes of the daemon and of the kernel interface,
containers, services, and waits on a condition."""
