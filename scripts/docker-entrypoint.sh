#!/usr/bin/env bash
# Container entry point. The kernel header links depend on the host's kernel (uname -r), which is known
# only at run time, and tracefs may need mounting in a fresh mount namespace: do both, then run heapscope.
set -euo pipefail
bash /opt/heapscope/scripts/setup.sh kernel tracefs >&2
exec /opt/heapscope/venv/bin/heapscope "$@"
