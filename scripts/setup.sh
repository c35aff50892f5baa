#!/usr/bin/env bash
# Sets heapscope up on a fresh Debian 12 machine, and does nothing that is already done.
#
#   scripts/setup.sh                 every step, in order
#   scripts/setup.sh STEP...         only these steps: apt kernel tracefs venv sampler
#
# Every step checks before it acts, so a second run takes about a second and a run
# that was interrupted half way simply carries on.
#
# Settings (environment):
#   PYTHON              interpreter for the venv (default: python3 on PATH; CPython >= 3.11)
#   VENV                the venv's folder (default: <repo>/.venv)
#   HEAPSCOPE_EDITABLE  1 (default): pip install -e '.[dev]'; 0: pip install '.' (the Dockerfile)
#                       (not PIP_*: pip reads every PIP_<option> variable as an option of its own)
#   HEAPSCOPE_APT_DEV   1 (default): apt installs scripts/apt-packages.txt (what heapscope runs with) and
#                       scripts/apt-packages-dev.txt (the tests' judges, peers and servers); 0: only the first
#                       (the Dockerfile)
#   MODULES_ROOT        where the kernel header links go (default: /lib/modules; for trying it elsewhere)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python3}
VENV=${VENV:-$ROOT/.venv}
HEAPSCOPE_EDITABLE=${HEAPSCOPE_EDITABLE:-1}
HEAPSCOPE_APT_DEV=${HEAPSCOPE_APT_DEV:-1}
MODULES_ROOT=${MODULES_ROOT:-/lib/modules}
BCC_DIR=/usr/lib/python3/dist-packages/bcc

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

# Root is needed only for the steps that change the system; run them through sudo if we are not root.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        die "this step needs root (or sudo): $*"
    fi
}

apt_updated=0
apt_install() {
    # Package lists on a fresh image are stale or absent: refresh them once per run, only when installing.
    if [ "$apt_updated" -eq 0 ]; then
        say "apt-get update"
        as_root env DEBIAN_FRONTEND=noninteractive apt-get update -q
        apt_updated=1
    fi
    say "apt-get install $*"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "$@"
}

missing_packages() {
    local pkg status
    for pkg in "$@"; do
        status=$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null || true)
        [ "$status" = "install ok installed" ] || printf '%s\n' "$pkg"
    done
}

step_apt() {
    local lists=("$ROOT/scripts/apt-packages.txt") wanted missing list
    [ "$HEAPSCOPE_APT_DEV" = 0 ] || lists+=("$ROOT/scripts/apt-packages-dev.txt")
    for list in "${lists[@]}"; do
        [ -f "$list" ] || die "$list is missing"
    done
    mapfile -t wanted < <(cat "${lists[@]}" | grep -Ev '^[[:space:]]*(#|$)' | sort -u)
    mapfile -t missing < <(missing_packages "${wanted[@]}")
    if [ "${#missing[@]}" -eq 0 ]; then
        say "apt: all ${#wanted[@]} packages installed"
        return
    fi
    apt_install "${missing[@]}"
}

# The Debian header folder to use: the running kernel's own if Debian has it, else the newest
# plain -amd64 flavour (not -cloud-amd64 or -rt-amd64). uprobes and tracepoints do not need an exact match.
pick_headers() {
    local k=$1
    if [ -d "/usr/src/linux-headers-$k" ]; then
        printf '%s\n' "/usr/src/linux-headers-$k"
        return
    fi
    find /usr/src -maxdepth 1 -type d -name 'linux-headers-*-amd64' -printf '%f\n' 2>/dev/null \
        | grep -E '^linux-headers-[0-9]+\.[0-9]+\.[0-9]+-[0-9]+-amd64$' \
        | sort -V | tail -n 1 | sed 's|^|/usr/src/|'
}

# Point $1 at $2 unless it already does. A real directory (headers that came with the kernel) is left alone.
ensure_link() {
    local link=$1 target=$2
    if [ -L "$link" ] && [ "$(readlink "$link")" = "$target" ]; then
        say "kernel: $link -> $target (already)"
    elif [ -e "$link" ] && [ ! -L "$link" ]; then
        say "kernel: $link is a real directory; leaving it"
    else
        as_root ln -sfn "$target" "$link"
        say "kernel: $link -> $target"
    fi
}

step_kernel() {
    # bcc compiles its BPF C against /lib/modules/$(uname -r)/{build,source}; the kernel has no
    # in-kernel headers (CONFIG_IKHEADERS off), and BCC_KERNEL_SOURCE alone was not enough: both links are needed.
    local k build source
    k=$(uname -r)
    # `|| true`: under pipefail, pick_headers fails when grep finds no headers, and the assignment would end the
    # script before the line below says why.
    build=$(pick_headers "$k" || true)
    [ -n "$build" ] || die "no Debian kernel headers under /usr/src (install linux-headers-amd64: scripts/setup.sh apt)"
    source=${build%-amd64}-common
    [ -d "$source" ] || source=$build  # the running kernel's own package has no -common split
    as_root mkdir -p "$MODULES_ROOT/$k"
    ensure_link "$MODULES_ROOT/$k/build" "$build"
    ensure_link "$MODULES_ROOT/$k/source" "$source"
}

step_tracefs() {
    local t=/sys/kernel/tracing
    if [ -n "$(ls -A "$t" 2>/dev/null)" ]; then
        say "tracefs: mounted at $t"
        return
    fi
    # Not fatal: unit tests and the model work without it; the uprobe steps will say what is missing.
    if as_root mount -t tracefs nodev "$t"; then
        say "tracefs: mounted at $t"
    else
        say "WARNING: could not mount tracefs at $t; uprobes will not attach until it is mounted"
    fi
}

site_packages() {
    "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))'
}

step_venv() {
    # A venv whose interpreter has gone (pyenv removed, image changed) is rebuilt rather than patched.
    if [ -x "$VENV/bin/python" ] && ! "$VENV/bin/python" -c 'pass' 2>/dev/null; then
        say "venv: $VENV is broken; recreating"
        rm -rf "$VENV"
    fi
    if [ ! -x "$VENV/bin/python" ]; then
        command -v "$PYTHON" >/dev/null || die "no $PYTHON on PATH"
        "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
            || die "$PYTHON is $("$PYTHON" -V 2>&1); heapscope needs Python >= 3.11"
        # Debian's own python3 keeps venv's ensurepip in a separate package.
        if ! "$PYTHON" -c 'import ensurepip' 2>/dev/null; then
            apt_install python3-venv
        fi
        say "venv: creating $VENV with $("$PYTHON" -V 2>&1)"
        "$PYTHON" -m venv "$VENV"
    fi

    # Reinstall only when pyproject.toml or the interpreter changed since the last successful install.
    local stamp="$VENV/.heapscope-install" want
    want="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) $("$VENV/bin/python" -V 2>&1) editable=$HEAPSCOPE_EDITABLE"
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/heapscope" ]; then
        say "venv: heapscope installed (pyproject.toml unchanged)"
    else
        say "venv: pip install"
        if [ "$HEAPSCOPE_EDITABLE" = 1 ]; then
            "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "${ROOT}[dev]"
        else
            "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$ROOT"
        fi
        printf '%s\n' "$want" >"$stamp"
    fi

    # bcc is pure Python over ctypes (libbcc.so.0), shipped only for Debian's python3. Link that one
    # package into the venv; adding all of dist-packages would mix Debian's modules into ours.
    [ -d "$BCC_DIR" ] || die "$BCC_DIR missing (install python3-bpfcc: scripts/setup.sh apt)"
    local site
    site=$(site_packages)
    if [ -L "$site/bcc" ] && [ "$(readlink "$site/bcc")" = "$BCC_DIR" ]; then
        say "venv: bcc linked"
    else
        rm -rf "$site/bcc"
        ln -s "$BCC_DIR" "$site/bcc"
        say "venv: linked $site/bcc -> $BCC_DIR"
    fi
    "$VENV/bin/python" -c 'import bcc' || die "bcc does not import in $VENV"
}

step_sampler() {
    # The in-process sampler of sampled mode (probes/sampler/hs_sampler.c), built ahead into the root-only
    # cache (HEAPSCOPE_CACHE_DIR, default /var/cache/heapscope) so that attaching never waits for gcc.
    # Not fatal: exact mode does not need it, and heapscope builds it on first use otherwise.
    local built
    if built=$(as_root env ${HEAPSCOPE_CACHE_DIR:+HEAPSCOPE_CACHE_DIR="$HEAPSCOPE_CACHE_DIR"} PYTHONPATH="$ROOT" \
        "$VENV/bin/python" -c 'from agent.process.sampler import build_sampler; print(build_sampler())'); then
        say "sampler: $built"
    else
        say "WARNING: could not build the sampler library; sampled mode will try again at attach"
    fi
}

main() {
    local steps=("$@") s
    [ "${#steps[@]}" -gt 0 ] || steps=(apt kernel tracefs venv sampler)
    for s in "${steps[@]}"; do
        case $s in
            apt | kernel | tracefs | venv | sampler) "step_$s" ;;
            *) die "unknown step '$s' (steps: apt kernel tracefs venv sampler)" ;;
        esac
    done
    if [[ " ${steps[*]} " == *" venv "* ]]; then
        say "done: $VENV/bin/heapscope"
    fi
}

main "$@"
