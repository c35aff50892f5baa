# heapscope daemon image: Debian 12, the Debian packages heapscope runs with, heapscope in a venv.
#
#   docker build -t heapscope .
#   docker run -d --privileged --pid=host -p 127.0.0.1:7411:7411 -e HEAPSCOPE_TOKEN=... heapscope   # the daemon
#   docker run --rm --privileged --pid=host heapscope attach PID                                    # one profile
#
# Without arguments it runs `heapscope serve` on 0.0.0.0:7411: reachable from outside the container, so the
# daemon refuses to start without a token (HEAPSCOPE_TOKEN). Files go to /var/lib/heapscope (a volume).
# Kubernetes: deploy/kubernetes/heapscope.yaml.
#
# At run time it needs the host's PID namespace (--pid=host) to see the target, and BPF + uprobes:
# --privileged, or at least --cap-add=BPF --cap-add=PERFMON --cap-add=SYS_ADMIN --cap-add=SYS_PTRACE
# with /sys/kernel/tracing reachable. Kernel headers come from the image (Debian's), and the entry point
# links them for whatever kernel the host runs; uprobes and tracepoints do not need an exact match.
FROM debian:bookworm-slim

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/heapscope

# System packages first, so this layer stays cached while the code changes: only scripts/apt-packages.txt, what
# heapscope needs at run time (bcc, kernel headers, libc6-dbg, the compilers of the sampler, python3), not
# scripts/apt-packages-dev.txt, which `make setup` adds for the tests (Valgrind, Chromium, Go, PostgreSQL, buildah...:
# about 2.4 GB more image). Debian's python3 (3.11) keeps venv support in python3-venv.
COPY scripts/setup.sh scripts/apt-packages.txt scripts/docker-entrypoint.sh scripts/
RUN HEAPSCOPE_APT_DEV=0 bash scripts/setup.sh apt \
    && apt-get install -y -q --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The package itself (not editable), with bcc linked into the venv by the same setup step as on a
# developer machine.
COPY pyproject.toml README.md ./
COPY agent/ agent/
COPY api/ api/
COPY probes/ probes/
RUN PYTHON=/usr/bin/python3 VENV=/opt/heapscope/venv HEAPSCOPE_EDITABLE=0 bash scripts/setup.sh venv \
    && rm -rf build ./*.egg-info

ENV PATH=/opt/heapscope/venv/bin:$PATH
RUN mkdir -p /var/lib/heapscope
VOLUME ["/var/lib/heapscope"]
EXPOSE 7411
# /healthz needs no token.
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s \
    CMD ["/opt/heapscope/venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7411/healthz', timeout=4)"]
ENTRYPOINT ["/opt/heapscope/scripts/docker-entrypoint.sh"]
CMD ["serve", "--http", "0.0.0.0:7411", "--output-dir", "/var/lib/heapscope"]
