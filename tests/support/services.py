"""Real servers from Debian's packages, each started as its package starts it (the same program, the same users, the
same process tree: a master and its workers or background processes) but with its own configuration, files and
sockets in a temporary directory and on a free port of 127.0.0.1: the system's own instances (nginx on :80,
postgres on 5432, memcached on 11211...), running or not, are neither used nor disturbed.

    with SERVICES["nginx"]() as svc:      # started and ready; stopped and its directory removed at the end
        svc.processes()                   # {pid: role} of the master and every worker
        svc.load(3.0)                     # its own load tool (ab): requests per second, and whether it erred
        svc.answers()

Each service's `selector` is a regular expression for `heapscope serve --attach-cmdline` (or POST /targets
{"cmdline": ...}) that matches its main process only (apache2's workers keep its command line: they match too); the
daemon reaches the workers by following its children.
Used by tests/integration/test_service_panel.py and bench/service_panel.py.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import ClassVar

import psutil

PG_BIN = Path("/usr/lib/postgresql/15/bin")
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 20.0
PAGE = "<html><body>heapscope service panel</body></html>\n" * 20  # about 1 KiB, as a small static page


class ServiceError(Exception):
    """A service that would not start, answer or stop: one line, with the last line of its log."""


@dataclass(frozen=True)
class LoadResult:
    tool: str
    rate: float  # requests (pgbench: transactions) per second, as the tool reports it
    requests: int  # requests completed (0 when the tool does not say)
    ok: bool  # the tool exited 0 and reported no failed request
    error: str = ""  # the tool's complaint when not ok: one line

    def __str__(self) -> str:
        state = "ok" if self.ok else f"FAILED: {self.error}"
        return f"{self.tool}: {self.rate:,.0f}/s, {self.requests} requests, {state}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "(no output)"


def roles(pids: Iterable[int]) -> dict[int, str]:
    """pid -> what the process says it is: the title a prefork server sets ("nginx: worker process" ->
    "worker process", "nginx: master process /usr/sbin/nginx -c ..." -> "master process", "postgres: checkpointer"
    -> "checkpointer"), else "main"."""
    out = {}
    for pid in pids:
        try:
            cmdline = psutil.Process(pid).cmdline()
        except psutil.Error:
            continue
        title = " ".join(cmdline).strip()
        m = re.match(r"^[\w.-]+: (.*)$", title)
        out[pid] = m.group(1).split(" /")[0].strip() if m else "main"
    return out


def _ids(user: str) -> tuple[int, int]:
    pw = pwd.getpwnam(user)
    return pw.pw_uid, pw.pw_gid


def _socket_exchange(port: int, send: bytes, expect: bytes, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(send)
            got = b""
            while expect not in got and len(got) < 4096:
                chunk = s.recv(4096)
                if not chunk:
                    break
                got += chunk
            return expect in got
    except OSError:
        return False


def _http_ok(port: int, path: str = "/index.html", timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
            return r.status == 200 and r.read() == PAGE.encode()
    except OSError:
        return False


def _number(pattern: str, text: str) -> float | None:
    m = re.search(pattern, text, re.MULTILINE)
    return float(m.group(1)) if m else None


def run_ab(port: int, seconds: float, concurrency: int = 8, path: str = "/index.html",
           headers: Iterable[str] = ()) -> LoadResult:  # fmt: skip
    """ApacheBench for `seconds`, a new connection per request (as ab does without -k)."""
    # -t alone caps at 50,000 requests; -n after it lifts the cap so the time decides.
    cmd = ["ab", "-q", "-r", "-c", str(concurrency), "-t", f"{seconds:g}", "-n", "10000000",
           *(a for h in headers for a in ("-H", h)), f"http://127.0.0.1:{port}{path}"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=False)
    out = done.stdout
    rate = _number(r"^Requests per second:\s+([\d.]+)", out) or 0.0
    complete = int(_number(r"^Complete requests:\s+(\d+)", out) or 0)
    failed = int(_number(r"^Failed requests:\s+(\d+)", out) or 0)
    non2xx = int(_number(r"^Non-2xx responses:\s+(\d+)", out) or 0)
    errors = []
    if done.returncode != 0:
        errors.append(f"exit {done.returncode}: {last_line(done.stderr or out)}")
    if failed:
        why = re.search(r"^Failed requests:.*\n\s*(\(.*\))", out, re.MULTILINE)  # (Connect: 0, Receive: 0, ...)
        errors.append(f"{failed} failed requests {why.group(1) if why else ''}".strip())
    if non2xx:
        errors.append(f"{non2xx} non-2xx responses")
    if not complete and not errors:
        errors.append("no request completed")
    return LoadResult("ab", rate, complete, not errors, "; ".join(errors))


class Service:
    """One server: started in __init__'s directory by start(), ready by wait_ready(), ended by stop()."""

    name: ClassVar[str]
    tool: ClassVar[str]  # its load tool, for the tables
    programs: ClassVar[tuple[str, ...]]  # what must be installed (absolute paths or names on PATH)
    users: ClassVar[tuple[str, ...]] = ()  # the users its package made, that it runs as
    roles_expected: ClassVar[tuple[str, ...]] = ("main",)  # a role per process once it is up, repeated for several
    transient_roles: ClassVar[tuple[str, ...]] = ()  # processes it starts and ends by itself, now and then

    def expected_roles(self) -> tuple[str, ...]:
        return self.roles_expected

    def __init__(self) -> None:
        # Under /tmp, not pytest's tmp_path: the service's own users (www-data, postgres...) must reach it, and
        # pytest's folders are root's alone.
        self.dir = Path(tempfile.mkdtemp(prefix=f"heapscope-{self.name}-"))
        self.dir.chmod(0o755)
        self.port = free_port()
        self.log = self.dir / f"{self.name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def missing(cls) -> list[str]:
        """What of its package is not installed (programs, users), for a skip's reason."""
        out = [p for p in cls.programs if shutil.which(p) is None]
        for user in cls.users:
            try:
                pwd.getpwnam(user)
            except KeyError:
                out.append(f"user {user}")
        return out

    # -- life ------------------------------------------------------------------------------------------------

    def command(self) -> list[str]:
        raise NotImplementedError

    def user(self) -> str | None:
        """The user the package's unit starts it as (None: root, the program drops its privileges itself)."""
        return None

    def start(self) -> Service:
        cmd = self.command()
        user = self.user()
        uid, gid = _ids(user) if user is not None else (None, None)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=self.dir, start_new_session=True, user=uid, group=gid,
                                         extra_groups=None if user is None else [])  # fmt: skip
        return self

    def __enter__(self) -> Service:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    @property
    def main_pid(self) -> int:
        assert self.proc is not None, f"{self.name} was not started"
        return self.proc.pid

    def pids(self) -> list[int]:
        """The main process and every descendant of it (workers, background processes, backends)."""
        try:
            main = psutil.Process(self.main_pid)
            return sorted([main.pid, *(c.pid for c in main.children(recursive=True))])
        except psutil.NoSuchProcess:
            return []

    def processes(self) -> dict[int, str]:
        return roles(self.pids())

    def minor_faults(self) -> int:
        """Minor page faults of its processes: the main process's own and its reaped children's (minflt, cminflt),
        and each live descendant's own (minflt). A process that ended in between is left out (once reaped, its
        parent's cminflt has it, if its parent is the main process)."""
        total = 0
        for pid in self.pids():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[7]) + (int(fields[8]) if pid == self.main_pid else 0)
        return total

    def steady_pids(self) -> list[int]:
        """Its processes but the ones that come and go by themselves (postgres's autovacuum workers)."""
        return sorted(p for p, r in self.processes().items() if r not in self.transient_roles)

    def _roles_ready(self) -> bool:
        have = sorted(self.processes().values())
        want = list(self.expected_roles())
        return all(have.count(r) >= want.count(r) for r in set(want))

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServiceError(f"{self.name} exited with {self.proc.returncode}: {self.log_tail()}")
            if self._roles_ready() and self.answers():
                return
            if time.monotonic() > deadline:
                raise ServiceError(f"{self.name} not ready in {timeout:.0f} s (processes {self.processes()}): "
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        try:
            return last_line(self.log.read_text(errors="replace"))
        except OSError:
            return "(no log)"

    def stop_signal(self) -> int:
        return signal.SIGTERM

    def stop(self) -> None:
        """Stop as the package's unit does (its stop signal, then SIGKILL to whatever is left), and remove the
        directory."""
        if self.proc is not None and self.proc.poll() is None:
            tree = []
            for pid in self.pids():
                with contextlib.suppress(psutil.NoSuchProcess):  # a short-lived child (a backend) just ended
                    tree.append(psutil.Process(pid))
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(self.stop_signal())
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            _, alive = psutil.wait_procs(tree, timeout=5)
            for p in alive:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- use -------------------------------------------------------------------------------------------------

    def answers(self) -> bool:
        raise NotImplementedError

    def load(self, seconds: float) -> LoadResult:
        raise NotImplementedError

    def settle(self) -> None:
        """Finish the background work the load leaves behind, before runs that are compared (default: none)."""

    @property
    def selector(self) -> str:
        """A regex for the main process's command line (with this instance's unique file or port)."""
        raise NotImplementedError

    def _write(self, name: str, text: str, mode: int = 0o644) -> Path:
        f = self.dir / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
        f.chmod(mode)
        return f

    def _docroot(self) -> Path:
        www = self.dir / "www"
        www.mkdir(exist_ok=True)
        www.chmod(0o755)
        self._write("www/index.html", PAGE)
        return www


class Nginx(Service):
    """nginx 1.22: a master (root) and two workers (www-data), serving a static page. `daemon off` keeps the
    master our child; otherwise the tree is the package's (Debian starts it with `daemon on` and a pid file)."""

    name = "nginx"
    tool = "ab"
    programs = ("/usr/sbin/nginx", "ab")
    users = ("www-data",)

    def __init__(self, workers: int = 2) -> None:
        super().__init__()
        self.workers = workers
        self.conf = self.dir / "nginx.conf"
        self.error_log = self.dir / "error.log"

    def expected_roles(self) -> tuple[str, ...]:
        return ("master process", *("worker process",) * self.workers)

    def config(self) -> str:
        www = self._docroot()
        temp = "\n".join(f"    {k}_temp_path {self.dir}/temp/{k};" for k in ("client_body", "proxy", "fastcgi",
                                                                              "uwsgi", "scgi"))
        return f"""user www-data;
worker_processes {self.workers};
pid {self.dir}/nginx.pid;
error_log {self.error_log};
daemon off;
events {{ worker_connections 768; }}
http {{
    sendfile on;
    tcp_nopush on;
    include /etc/nginx/mime.types;
    default_type application/octet-stream;
    access_log {self.dir}/access.log;
{temp}
    server {{
        listen 127.0.0.1:{self.port};
        root {www};
        index index.html;
    }}
}}
"""

    def command(self) -> list[str]:
        self.conf.write_text(self.config())
        (self.dir / "temp").mkdir(exist_ok=True)
        # -e: the error log before the configuration is read (else /var/log/nginx/error.log).
        return ["/usr/sbin/nginx", "-c", str(self.conf), "-e", str(self.error_log)]

    def log_tail(self) -> str:
        try:
            return last_line(self.error_log.read_text(errors="replace"))
        except OSError:
            return super().log_tail()

    def stop_signal(self) -> int:
        return signal.SIGQUIT  # graceful, as Debian's ExecStop (--retry QUIT/5)

    @property
    def selector(self) -> str:
        return f"^(nginx: master process )?/usr/sbin/nginx -c {re.escape(str(self.conf))} "

    def answers(self) -> bool:
        return _http_ok(self.port)

    def load(self, seconds: float) -> LoadResult:
        return run_ab(self.port, seconds)

    def workers_now(self) -> list[int]:
        return sorted(p for p, r in self.processes().items() if r == "worker process")

    def _await_new_workers(self, old: set[int], what: str) -> list[int]:
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            now = self.workers_now()
            if len(now) == self.workers and not old & set(now):
                return now
            if time.monotonic() > deadline:
                raise ServiceError(f"nginx: no new workers after {what} (workers {now}, old {sorted(old)}): "
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def reload(self) -> list[int]:
        """`nginx -s reload` as Debian's ExecReload: new workers replace the old ones. Returns the new workers."""
        old = set(self.workers_now())
        done = subprocess.run(["/usr/sbin/nginx", "-s", "reload", "-c", str(self.conf), "-e", str(self.error_log)],
                              capture_output=True, text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise ServiceError(f"nginx -s reload: exit {done.returncode}: {last_line(done.stderr)}")
        return self._await_new_workers(old, "nginx -s reload")

    def kill_worker(self) -> tuple[int, list[int]]:
        """SIGKILL a worker (a crash): the master forks a new one. Returns (the killed one, the workers now)."""
        workers = self.workers_now()
        if not workers:
            raise ServiceError("nginx has no worker to kill")
        victim = workers[0]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            now = self.workers_now()
            if len(now) == self.workers and victim not in now:
                return victim, now
            if time.monotonic() > deadline:
                raise ServiceError(f"nginx: worker {victim} killed, not replaced (workers {now})")
            time.sleep(0.1)


class Postgres(Service):
    """PostgreSQL 15: initdb into the directory as the postgres user, then the postmaster (as Debian's pg_ctlcluster
    runs it, in the foreground here) with its background processes, listening on 127.0.0.1 and with its socket in
    the directory; a psql held open on a pipe makes an idle backend. Load: pgbench (initialised once at start)."""

    name = "postgres"
    tool = "pgbench"
    programs = (str(PG_BIN / "postgres"), str(PG_BIN / "initdb"), str(PG_BIN / "pgbench"), str(PG_BIN / "psql"))
    users = ("postgres",)
    transient_roles = ("autovacuum worker", "starting")
    roles_expected = ("main", "checkpointer", "background writer", "walwriter", "autovacuum launcher",
                      "logical replication launcher")
    USER = "postgres"

    def __init__(self) -> None:
        super().__init__()
        uid, gid = _ids(self.USER)
        os.chown(self.dir, uid, gid)
        self.data = self.dir / "data"
        self.sockets = self.dir
        self.sessions: list[subprocess.Popen[str]] = []
        self.session_backends: list[int] = []

    def user(self) -> str:
        return self.USER

    def command(self) -> list[str]:
        if not (self.data / "PG_VERSION").exists():
            uid, gid = _ids(self.USER)
            done = subprocess.run(
                [str(PG_BIN / "initdb"), "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8",
                 "--locale=C.UTF-8", "--no-sync"],
                capture_output=True, text=True, cwd=self.dir, user=uid, group=gid, extra_groups=[], timeout=120,
                check=False,
            )  # fmt: skip
            if done.returncode != 0:
                raise ServiceError(f"initdb: exit {done.returncode}: {last_line(done.stderr)}")
        return [str(PG_BIN / "postgres"), "-D", str(self.data), "-c", "listen_addresses=127.0.0.1",
                "-c", f"port={self.port}", "-c", f"unix_socket_directories={self.sockets}"]  # fmt: skip

    def stop_signal(self) -> int:
        return signal.SIGINT  # fast shutdown: pg_ctl stop -m fast, as Debian's pg_ctlcluster stop

    def stop(self) -> None:
        for s in self.sessions:
            if s.poll() is None:
                s.kill()
                s.wait()
        super().stop()

    @property
    def selector(self) -> str:
        return f"^{re.escape(str(PG_BIN / 'postgres'))} -D {re.escape(str(self.data))} "

    def processes(self) -> dict[int, str]:
        out = {}
        for pid, role in super().processes().items():
            if re.search(r"\[local\]|\d\(\d+\)", role):
                role = "backend"  # its title: user, database, client, state ("postgres postgres [local] idle")
            elif role.startswith("autovacuum worker"):
                role = "autovacuum worker"  # with its database once connected: "autovacuum worker postgres"
            elif role == "main" and pid != self.main_pid:
                role = "starting"  # just forked (an autovacuum worker, a backend), still with the postmaster's title
            out[pid] = role
        return out

    def steady_pids(self) -> list[int]:
        # A load tool's backends end with its connections, a moment after the tool itself: only ours stay. One look
        # at the processes: in two, a backend seen in the first could be gone from the second, and taken as steady.
        return sorted(p for p, r in self.processes().items()
                      if r not in self.transient_roles and (r != "backend" or p in self.session_backends))

    def settle(self) -> None:
        """pgbench's updates leave dead rows and WAL: vacuumed and checkpointed now, not by the autovacuum worker
        and the checkpointer in the middle of the next runs (of this instance or, on shared cores, the other)."""
        subprocess.run(self._psql("-c", "VACUUM ANALYZE", "-c", "CHECKPOINT"), capture_output=True, timeout=300,
                       check=True)

    def _psql(self, *args: str) -> list[str]:
        return [str(PG_BIN / "psql"), "-X", "-q", "-At", "-h", str(self.sockets), "-p", str(self.port),
                "-U", "postgres", *args, "postgres"]  # fmt: skip

    def answers(self) -> bool:
        try:
            done = subprocess.run([*self._psql("-c", "SELECT 40 + 2")], capture_output=True, text=True,
                                  timeout=10, check=False)
        except subprocess.TimeoutExpired:
            return False
        return done.returncode == 0 and done.stdout.strip() == "42"

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> None:
        super().wait_ready(timeout)
        if not (self.dir / "pgbench.done").exists():
            done = subprocess.run(self._pgbench("-i", "-q", "-s", "1"), capture_output=True, text=True,
                                  timeout=120, check=False)
            if done.returncode != 0:
                raise ServiceError(f"pgbench -i: exit {done.returncode}: {last_line(done.stderr)}")
            (self.dir / "pgbench.done").touch()
        if not self.sessions:
            self.connect()

    def connect(self) -> int:
        """Open a connection that stays open (a psql reading a pipe): the pid of its backend."""
        s = subprocess.Popen(self._psql(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, bufsize=1)
        self.sessions.append(s)
        assert s.stdin is not None and s.stdout is not None
        s.stdin.write("SELECT pg_backend_pid();\n")
        s.stdin.flush()
        line = s.stdout.readline().strip()
        if not line.isdigit():
            raise ServiceError(f"psql: no backend pid ({line!r}, exit {s.poll()})")
        self.session_backends.append(int(line))
        return int(line)

    def _pgbench(self, *args: str) -> list[str]:
        return [str(PG_BIN / "pgbench"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", *args,
                "postgres"]  # fmt: skip

    def load(self, seconds: float) -> LoadResult:
        # TPC-B-like, four clients on two threads; -n: no vacuum before (it is no part of the load).
        done = subprocess.run(self._pgbench("-n", "-c", "4", "-j", "2", "-T", str(max(1, round(seconds)))),
                              capture_output=True, text=True, timeout=seconds + 120, check=False)
        out = done.stdout
        rate = _number(r"^tps = ([\d.]+) \(without initial connection time\)", out) or 0.0
        count = int(_number(r"^number of transactions actually processed: (\d+)", out) or 0)
        failed = int(_number(r"^number of failed transactions: (\d+)", out) or 0)
        errors = []
        if done.returncode != 0:
            errors.append(f"exit {done.returncode}: {last_line(done.stderr or out)}")
        if failed:
            errors.append(f"{failed} failed transactions")
        if not count and not errors:
            errors.append("no transaction processed")
        return LoadResult("pgbench", rate, count, not errors, "; ".join(errors))


class PythonHttp(Service):
    """Debian's python3 -m http.server (a thread per request), serving a static page."""

    name = "python-http"
    tool = "ab"
    programs = ("/usr/bin/python3", "ab")

    def command(self) -> list[str]:
        www = self._docroot()
        return ["/usr/bin/python3", "-m", "http.server", "--bind", "127.0.0.1", "--directory", str(www),
                str(self.port)]  # fmt: skip

    @property
    def selector(self) -> str:
        return f"^/usr/bin/python3 -m http.server --bind 127.0.0.1 --directory {re.escape(str(self.dir))}/www "

    def answers(self) -> bool:
        return _http_ok(self.port)

    def load(self, seconds: float) -> LoadResult:
        # socketserver's listen backlog is 5: more clients than that meet a full queue, not the server.
        return run_ab(self.port, seconds, concurrency=4)


class Memcached(Service):
    """memcached 1.6 with /etc/memcached.conf's options (64 MB, user memcache, 4 threads by default)."""

    name = "memcached"
    tool = "memcaslap"
    programs = ("memcached", "memcaslap")
    users = ("memcache",)

    def command(self) -> list[str]:
        return ["memcached", "-m", "64", "-p", str(self.port), "-U", "0", "-u", "memcache", "-l", "127.0.0.1",
                "-P", str(self.dir / "memcached.pid")]  # fmt: skip

    @property
    def selector(self) -> str:
        return f"^memcached .*-P {re.escape(str(self.dir))}/memcached\\.pid"

    def answers(self) -> bool:
        return _socket_exchange(self.port, b"version\r\n", b"VERSION ")

    def load(self, seconds: float) -> LoadResult:
        cmd = ["memcaslap", "-s", f"127.0.0.1:{self.port}", "-t", f"{max(1, round(seconds))}s", "-T", "2",
               "-c", "16"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=False)
        out = done.stdout + done.stderr
        m = re.search(r"Run time: [\d.]+s Ops: (\d+) TPS: (\d+)", out)
        errors = []
        if done.returncode != 0:
            errors.append(f"exit {done.returncode}: {last_line(out)}")
        if m is None and not errors:
            errors.append(f"no summary: {last_line(out)}")
        # memaslap reports lost connections and protocol errors on lines of their own.
        errors += [ln.strip() for ln in out.splitlines() if re.search(r"(?i)error|failed|reset", ln)][:1]
        return LoadResult("memcaslap", float(m.group(2)) if m else 0.0, int(m.group(1)) if m else 0, not errors,
                          "; ".join(errors))


class Redis(Service):
    """redis-server 7 as Debian's unit runs it (user redis, in the foreground), configured on the command line
    with no persistence."""

    name = "redis"
    tool = "redis-benchmark"
    programs = ("redis-server", "redis-benchmark")
    users = ("redis",)
    REQUESTS_PER_SECOND = 60000  # redis-benchmark counts requests, not time: about this many per second asked

    def __init__(self) -> None:
        super().__init__()
        uid, gid = _ids("redis")
        os.chown(self.dir, uid, gid)

    def user(self) -> str:
        return "redis"

    def command(self) -> list[str]:
        return ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--daemonize", "no", "--dir", str(self.dir), "--logfile", ""]  # fmt: skip

    @property
    def selector(self) -> str:
        return f"^redis-server 127\\.0\\.0\\.1:{self.port}$"  # redis sets its title: only the port tells it apart

    def answers(self) -> bool:
        return _socket_exchange(self.port, b"PING\r\n", b"+PONG")

    def load(self, seconds: float) -> LoadResult:
        n = max(1000, int(seconds * self.REQUESTS_PER_SECOND / 2))  # two tests
        cmd = ["redis-benchmark", "-p", str(self.port), "-t", "set,get", "-n", str(n), "-d", "100", "-r", "100000",
               "-c", "16", "--csv"]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120, check=False)
        rows = [ln.split(",") for ln in done.stdout.splitlines() if ln.startswith('"SET"') or ln.startswith('"GET"')]
        rates = [float(r[1].strip('"')) for r in rows]
        errors = []
        if done.returncode != 0:
            errors.append(f"exit {done.returncode}: {last_line(done.stderr or done.stdout)}")
        if len(rates) != 2 and not errors:
            errors.append(f"no results: {last_line(done.stderr or done.stdout)}")
        errors += [ln.strip() for ln in done.stderr.splitlines() if ln.strip()][:1]  # "Error from server", resets
        # Both tests' requests over both tests' time.
        rate = len(rates) / sum(1 / r for r in rates) if rates and all(rates) else 0.0
        return LoadResult("redis-benchmark", rate, n * len(rates), not errors, "; ".join(errors))


class Lighttpd(Service):
    """lighttpd 1.4 as Debian's unit runs it (-D, root dropping to www-data), serving a static page."""

    name = "lighttpd"
    tool = "ab"
    programs = ("/usr/sbin/lighttpd", "ab")
    users = ("www-data",)

    def command(self) -> list[str]:
        www = self._docroot()
        logs = self.dir / "log"  # lighttpd opens its logs as www-data, as in Debian's /var/log/lighttpd
        logs.mkdir(exist_ok=True)
        os.chown(logs, *_ids("www-data"))
        conf = self._write("lighttpd.conf", f"""server.modules = ("mod_indexfile", "mod_access", "mod_accesslog")
server.document-root = "{www}"
server.bind = "127.0.0.1"
server.port = {self.port}
server.username = "www-data"
server.groupname = "www-data"
server.pid-file = "{self.dir}/lighttpd.pid"
server.errorlog = "{logs}/error.log"
accesslog.filename = "{logs}/access.log"
index-file.names = ("index.html")
mimetype.assign = (".html" => "text/html")
""")
        return ["/usr/sbin/lighttpd", "-D", "-f", str(conf)]

    @property
    def selector(self) -> str:
        return f"^/usr/sbin/lighttpd -D -f {re.escape(str(self.dir))}/lighttpd\\.conf$"

    def answers(self) -> bool:
        return _http_ok(self.port)

    def load(self, seconds: float) -> LoadResult:
        return run_ab(self.port, seconds)


class Apache(Service):
    """Apache httpd 2.4 with the prefork MPM: a master (root) and a fixed pool of single-threaded workers (www-data)
    that each end after MaxConnectionsPerChild connections and are replaced by the master, serving a static page
    gzipped to clients that accept it (mod_deflate with Debian's deflate.conf; ab asks as browsers do). Without
    that a warm worker serves a static file out of APR's pools with no allocator call at all; zlib's state is
    malloc'd a request. Run as Debian's apachectl runs /usr/sbin/apache2, in the foreground (-DFOREGROUND) and with
    a configuration of its own instead of /etc/apache2's. The workers keep the master's command line, so the
    selector matches them too; the daemon profiles them either way."""

    name = "apache2"
    tool = "ab"
    programs = ("/usr/sbin/apache2", "ab")
    users = ("www-data",)
    MAX_CONNECTIONS_PER_CHILD = 10000  # a worker ends after this many and a new one takes its place
    MAINTENANCE_INTERVAL = 1.0  # seconds between the master's looks at its pool (prefork's idle server maintenance)

    def __init__(self, workers: int = 4) -> None:
        super().__init__()
        self.workers = workers
        self.conf = self.dir / "apache2.conf"

    def expected_roles(self) -> tuple[str, ...]:
        return ("master", *("worker",) * self.workers)

    def processes(self) -> dict[int, str]:
        # Apache sets no title: a worker is known from the master by its pid.
        return {p: "master" if p == self.main_pid else "worker" for p in self.pids()}

    def config(self) -> str:
        www = self._docroot()
        run = self.dir / "run"
        run.mkdir(exist_ok=True)
        modules = Path("/usr/lib/apache2/modules")
        return f"""ServerRoot /etc/apache2
ServerName 127.0.0.1
{self.mpm(modules)}
LoadModule authz_core_module {modules}/mod_authz_core.so
LoadModule mime_module {modules}/mod_mime.so
LoadModule filter_module {modules}/mod_filter.so
LoadModule deflate_module {modules}/mod_deflate.so
User www-data
Group www-data
PidFile {self.dir}/apache2.pid
DefaultRuntimeDir {run}
Mutex file:{run} default
ErrorLog {self.dir}/error.log
LogFormat "%h %l %u %t \\"%r\\" %>s %O" common
CustomLog {self.dir}/access.log common
Listen 127.0.0.1:{self.port}
TypesConfig /etc/mime.types
AddOutputFilterByType DEFLATE text/html text/plain text/xml text/css text/javascript
DocumentRoot {www}
<Directory />
    Require all denied
</Directory>
<Directory {www}>
    Require all granted
</Directory>
"""

    def mpm(self, modules: Path) -> str:
        # A fixed pool: as many workers to start, to keep spare and at most, so only MaxConnectionsPerChild (and a
        # crash) ends a worker, and the master replaces it at once.
        return f"""LoadModule mpm_prefork_module {modules}/mod_mpm_prefork.so
StartServers {self.workers}
MinSpareServers {self.workers}
MaxSpareServers {self.workers + 1}
ServerLimit {self.workers}
MaxRequestWorkers {self.workers}
MaxConnectionsPerChild {self.MAX_CONNECTIONS_PER_CHILD}"""

    def command(self) -> list[str]:
        self.conf.write_text(self.config())
        return ["/usr/sbin/apache2", "-f", str(self.conf), "-DFOREGROUND"]

    def log_tail(self) -> str:
        try:
            return last_line((self.dir / "error.log").read_text(errors="replace"))
        except OSError:
            return super().log_tail()

    def stop_signal(self) -> int:
        return signal.SIGWINCH  # graceful-stop, as Debian's ExecStop (apachectl graceful-stop)

    @property
    def selector(self) -> str:
        return f"^/usr/sbin/apache2 -f {re.escape(str(self.conf))} "

    def answers(self) -> bool:
        return _http_ok(self.port)

    def load(self, seconds: float) -> LoadResult:
        return run_ab(self.port, seconds, headers=["Accept-Encoding: gzip"])

    def workers_now(self) -> list[int]:
        return sorted(p for p, r in self.processes().items() if r == "worker")

    def settled_workers(self) -> list[int]:
        """The workers once the pool is whole and none is ending: a worker that served its last connection as a load
        ended exits a moment later, and the master replaces it at its next look. The same full pool in two looks of
        the master's apart."""
        deadline = time.monotonic() + READY_TIMEOUT
        before: list[int] = []
        while True:
            now = self.workers_now()
            if self.pool_whole(len(now)) and now == before:
                return now
            if time.monotonic() > deadline:
                raise ServiceError(f"apache2: the pool of {self.workers} workers did not settle (workers {now}): "
                                   f"{self.log_tail()}")
            before = now
            time.sleep(self.MAINTENANCE_INTERVAL * 1.5)

    def pool_whole(self, workers: int) -> bool:
        """Whether a pool of this many workers is the one the configuration keeps when idle."""
        return workers == self.workers

    def steady_pids(self) -> list[int]:
        return sorted([self.main_pid, *self.settled_workers()])

    def reload(self) -> list[int]:
        """`apachectl graceful`: new children, forked from the master, take the old ones' place. Returns them, once
        the pool has settled."""
        old = set(self.workers_now())
        os.kill(self.main_pid, signal.SIGUSR1)
        deadline = time.monotonic() + READY_TIMEOUT
        while old & set(self.workers_now()):
            if time.monotonic() > deadline:
                raise ServiceError(f"apache2: children {sorted(old & set(self.workers_now()))} still there after a "
                                   f"graceful restart: {self.log_tail()}")
            time.sleep(0.1)
        return self.settled_workers()

    def recycle_workers(self) -> list[int]:
        """Load until every worker has served its MaxConnectionsPerChild connections and been replaced by a new one
        (ab opens a connection a request). Returns the new workers, once the pool has settled."""
        if not self.MAX_CONNECTIONS_PER_CHILD:  # apache2-event: no worker ends for its count (reload() instead)
            raise ServiceError(f"{self.name}: MaxConnectionsPerChild 0 replaces no worker; reload() does")
        old = set(self.workers_now())
        deadline = time.monotonic() + READY_TIMEOUT
        while old & set(self.workers_now()):
            if time.monotonic() > deadline:
                raise ServiceError(f"apache2: workers {sorted(old & set(self.workers_now()))} not recycled after "
                                   f"{READY_TIMEOUT:.0f} s of load: {self.log_tail()}")
            got = self.load(1.0)
            if not got.ok:
                raise ServiceError(f"apache2: load while recycling workers: {got}")
        return self.settled_workers()


class ApacheEvent(Apache):
    """Apache as Debian's package sets it up: the event MPM (its default: `a2query -M`), each child a listener and
    ThreadsPerChild worker threads, with mods-available/mpm_event.conf's figures, MaxConnectionsPerChild 0 among
    them (no child is replaced for the connections it served). Two children under ab's 8 connections (spare threads
    stay between MinSpareThreads and MaxSpareThreads). A reload is Debian's `apachectl graceful` (SIGUSR1): the
    children finish and new ones are forked from the master."""

    name = "apache2-event"
    MAX_CONNECTIONS_PER_CHILD = 0

    def __init__(self) -> None:
        super().__init__(workers=2)

    def mpm(self, modules: Path) -> str:
        return f"""LoadModule mpm_event_module {modules}/mod_mpm_event.so
StartServers {self.workers}
MinSpareThreads 25
MaxSpareThreads 75
ThreadLimit 64
ThreadsPerChild 25
MaxRequestWorkers 150
MaxConnectionsPerChild {self.MAX_CONNECTIONS_PER_CHILD}"""


class ApachePrefork(Apache):
    """Apache with the prefork MPM as Debian's package sets it up when a site needs it (`a2dismod mpm_event;
    a2enmod mpm_prefork`, as mod_php does): mods-available/mpm_prefork.conf's figures. MaxConnectionsPerChild 0: no
    worker is replaced for the connections it served. The pool grows under ab's 8 connections (the master forks
    while fewer than MinSpareServers are idle) and is trimmed back to MaxSpareServers after it, one a second. A
    reload is `apachectl graceful`."""

    name = "apache2-prefork"
    MAX_CONNECTIONS_PER_CHILD = 0
    MIN_SPARE, MAX_SPARE = 5, 10

    def __init__(self) -> None:
        super().__init__(workers=self.MIN_SPARE)

    def mpm(self, modules: Path) -> str:
        return f"""LoadModule mpm_prefork_module {modules}/mod_mpm_prefork.so
StartServers {self.MIN_SPARE}
MinSpareServers {self.MIN_SPARE}
MaxSpareServers {self.MAX_SPARE}
MaxRequestWorkers 150
MaxConnectionsPerChild {self.MAX_CONNECTIONS_PER_CHILD}"""

    def pool_whole(self, workers: int) -> bool:
        return self.MIN_SPARE <= workers <= self.MAX_SPARE


class HAProxy(Service):
    """HAProxy 2.6 as Debian's unit runs it with Debian's haproxy.cfg's global settings (-Ws: a master and a worker;
    the worker chroots to /var/lib/haproxy and runs as haproxy), in front of a one-worker nginx of its own (the
    backend is not one of its processes). HAProxy's worker also forbids itself new processes, and with them new
    threads: RLIMIT_NPROC 0 and no_new_privs (unless `insecure-fork-wanted`), as it comes."""

    name = "haproxy"
    tool = "ab"
    programs = ("/usr/sbin/haproxy", "/usr/sbin/nginx", "ab")
    users = ("haproxy", "www-data")
    roles_expected = ("master", "worker")

    def processes(self) -> dict[int, str]:
        # -W: the master keeps the command line; the worker it forks has no title of its own.
        return {p: "master" if p == self.main_pid else "worker" for p in self.pids()}

    chroot = True

    def __init__(self) -> None:
        super().__init__()
        self.backend = Nginx(workers=1)

    def command(self) -> list[str]:
        chroot = "    chroot /var/lib/haproxy\n" if self.chroot else ""
        conf = self._write("haproxy.cfg", f"""global
{chroot}    stats socket {self.dir}/admin.sock mode 660 level admin
    stats timeout 30s
    user haproxy
    group haproxy

defaults
    mode http
    timeout connect 5000
    timeout client 50000
    timeout server 50000

frontend web
    bind 127.0.0.1:{self.port}
    default_backend app

backend app
    server app1 127.0.0.1:{self.backend.port}
""")
        return ["/usr/sbin/haproxy", "-Ws", "-f", str(conf), "-p", str(self.dir / "haproxy.pid"),
                "-S", str(self.dir / "master.sock")]  # fmt: skip

    def start(self) -> Service:
        self.backend.start()
        self.backend.wait_ready()
        return super().start()

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            self.backend.stop()

    @property
    def selector(self) -> str:
        return f"^/usr/sbin/haproxy -Ws -f {re.escape(str(self.dir))}/haproxy\\.cfg "

    def answers(self) -> bool:
        return _http_ok(self.port)

    def load(self, seconds: float) -> LoadResult:
        return run_ab(self.port, seconds)


class HAProxyNoChroot(HAProxy):
    """The same without the chroot: the worker's files are under /proc/PID/root; its limit on threads remains."""

    name = "haproxy-nochroot"
    chroot = False


SERVICES: dict[str, type[Service]] = {
    s.name: s
    for s in (Nginx, Postgres, PythonHttp, Memcached, Redis, Lighttpd, Apache, ApacheEvent, ApachePrefork, HAProxy,
              HAProxyNoChroot)
}
