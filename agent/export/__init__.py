"""Exporters: the profile model written as massif.out, xtree (Callgrind), MALT JSON, pprof, Prometheus metrics and
the web page. Pure Python: no process, no kernel (checked by import-linter)."""
