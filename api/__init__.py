"""The HTTP API of the daemon (FastAPI): targets, snapshots and trees, history, growth, pprof, metrics, the web
page and the monitor. Depends on the model and on ports (api/ports.py), not on the daemon's internals."""
