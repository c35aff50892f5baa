"""The daemon's HTTP settings: pydantic BaseSettings, read from arguments and then HEAPSCOPE_* variables.

    HEAPSCOPE_HOST, HEAPSCOPE_PORT, HEAPSCOPE_TOKEN, HEAPSCOPE_OUTPUT_DIR, HEAPSCOPE_METRICS_TOP_STACKS

Secure by default: the daemon listens on 127.0.0.1, and any other address needs a token.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from agent.errors import UsageError

DEFAULT_PORT = 7411


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HEAPSCOPE_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    # When set, every endpoint but /healthz needs `Authorization: Bearer <token>`.
    token: SecretStr | None = None
    # Monitor commands write their files here, and nowhere else.
    output_dir: Path = Path(".")
    # Per-target label cardinality of the site metrics: this many sites plus one "(other sites)".
    metrics_top_stacks: int = Field(10, ge=0, le=1000)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


def check_exposure(settings: ApiSettings) -> None:
    """Refuse to serve beyond loopback without a token."""
    token = settings.token.get_secret_value() if settings.token is not None else ""
    if settings.token is not None and not token.strip():
        raise UsageError("the token is empty")
    if not is_loopback(settings.host) and settings.token is None:
        raise UsageError(
            f"listening on {settings.host} (not loopback) needs a token: --token or HEAPSCOPE_TOKEN; "
            "clients then send `Authorization: Bearer <token>`"
        )
