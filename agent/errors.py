"""The project's one error hierarchy. main() turns these into a message and an exit code."""


class HeapscopeError(Exception):
    """An error the user can act on: printed as one line, never as a traceback."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class UsageError(HeapscopeError):
    """Bad options or arguments."""

    exit_code = 2


class TargetError(HeapscopeError):
    """The target process does not exist, cannot be read, or went away."""

    exit_code = 3


class SamplingRefused(TargetError):
    """Sampled mode cannot be made safe for this target (ptrace forbidden, seccomp, an allocator its sampler
    cannot intercept, a sampler library the target cannot see); exact mode can profile it."""

    http_status = 409


class NoSafePoint(TargetError):
    """No thread of the target was found at a safe point for the injected call in the time given (each thread
    was inside the allocator, the loader, fork or a signal handler, as the message says thread by thread). A
    later try may find one: the daemon retries such a target."""

    http_status = 409


class EnvironmentProblem(HeapscopeError):
    """The machine lacks something: BPF, uprobes, kernel headers, permission."""

    exit_code = 4


# ---- the daemon's errors, with the HTTP status the API gives them ----------------------------------------


class NoSuchTarget(TargetError):
    """The daemon profiles no process with that PID (or none at all)."""

    http_status = 404


class TargetConflict(HeapscopeError):
    """The PID is already being profiled, or being attached; or what was asked is not kept for this target."""

    http_status = 409


class UnsafePath(UsageError):
    """A file name that would leave the output directory."""


class NotInHistory(HeapscopeError):
    """The stored history holds no snapshot at the moment, or in the range, asked for."""

    http_status = 404


class TargetRefused(HeapscopeError):
    """The daemon is at one of its limits (targets, sites, memory): the new target is refused, and counted."""

    http_status = 429
