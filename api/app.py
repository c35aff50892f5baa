"""The HTTP API: `create_app(settings, manager)` builds the FastAPI app. Its lifespan starts the manager and,
at shutdown (SIGTERM included), ends every profile so that each target's files are written."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry

from agent import __version__
from agent.export.metrics import FleetCollector, HeapscopeCollector
from agent.export.webdata import SiteCache
from api.errors import install_error_handlers
from api.ports import ManagerPort
from api.routers import growth, health, history, metrics, monitor, pprof, profiles, selectors, targets, web
from api.security import token_dependency
from api.settings import ApiSettings, check_exposure

DESCRIPTION = """\
heapscope's daemon: heap profiles of running processes, taken with eBPF, in Valgrind Massif's formats.

`/snapshot`, `/detailed_snapshot`, `/all_snapshots` and `/xtmemory` return exactly what Massif's monitor
commands write (read them with `ms_print` and `callgrind_annotate`); `?format=json` gives the same data as JSON.
`/pprof` (and Go's `/debug/pprof/heap`) give the heap as a pprof profile, for `go tool pprof`, Pyroscope and Parca.
"""


def create_app(settings: ApiSettings, manager: ManagerPort) -> FastAPI:
    check_exposure(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        manager.start()
        try:
            yield
        finally:
            manager.shutdown()

    app = FastAPI(title="heapscope", version=__version__, description=DESCRIPTION, lifespan=lifespan)
    app.state.settings = settings
    app.state.manager = manager
    # The registry is the app's own, not prometheus_client's global one.
    app.state.registry = CollectorRegistry(auto_describe=False)
    app.state.registry.register(HeapscopeCollector(manager, settings.metrics_top_stacks))
    app.state.registry.register(FleetCollector(manager))
    app.state.site_cache = SiteCache()  # the web page's per-tree site sums
    install_error_handlers(app)

    auth = token_dependency(settings)
    guarded = [Depends(auth)] if auth is not None else []
    app.include_router(health.router)
    app.include_router(web.page_router)
    routers = (profiles.router, monitor.router, targets.router, selectors.router, metrics.router, pprof.router)
    for r in (*routers, web.router, history.router, growth.router):
        app.include_router(r, dependencies=guarded)
    return app
