/* fleet_service.c: a small service for the daemon's fleet tests and bench/fleet_soak.py.
 *
 *   fleet_service WORKERS [WORKER_NAME]     a parent that forks WORKERS children (prefork); 0: none
 *   fleet_service --worker                  one worker, as a worker's exec of itself starts it
 *
 * Every process, parent and workers alike, allocates one 1000-byte block every 20 ms at ring_alloc into a ring of
 * RING slots, freeing the slot's previous block first: its live heap at ring_alloc is always a multiple of 1000
 * bytes and at most RING * 1000, whenever a profiler attached to it. Every tick it writes its tick count to
 * $FLEET_DIR/PID (if set), so a test can tell it still runs. With FLEET_QUIET_WORKERS=1 in its environment, the
 * workers tick without allocating (a process whose sampler takes no sample).
 *
 * Workers name themselves WORKER_NAME (prctl; default "fleet-worker"), so that a selector on the parent's name
 * does not match them by itself. Signals: SIGTERM ends a process (the parent ends its workers first); a worker's
 * SIGUSR1 makes it exit, and the parent forks a new one (a restart); a worker's SIGUSR2 makes it exec this
 * program again as `--worker` (through /proc/self/exe, so its name is then "exe"); SIGHUP makes it exec another
 * program, `sleep 600`.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define RING 8
#define MAX_WORKERS 64

static volatile sig_atomic_t stop, quit_worker, reexec, exec_other, child_exited;
static void *ring[RING];
static int tick_fd = -1;
static int quiet; /* allocates nothing (a quiet worker) */

static void on_signal(int sig)
{
    if (sig == SIGTERM || sig == SIGINT)
        stop = 1;
    else if (sig == SIGUSR1)
        quit_worker = 1;
    else if (sig == SIGUSR2)
        reexec = 1;
    else if (sig == SIGCHLD)
        child_exited = 1;
    else if (sig == SIGHUP)
        exec_other = 1;
}

__attribute__((noinline)) static void *ring_alloc(void)
{
    return malloc(1000);
}

static void open_tick_file(void)
{
    const char *dir = getenv("FLEET_DIR");
    char path[4096];
    if (tick_fd >= 0)
        close(tick_fd);
    tick_fd = -1;
    if (dir && snprintf(path, sizeof path, "%s/%d", dir, (int)getpid()) < (int)sizeof path)
        tick_fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
}

static void tick(unsigned long n)
{
    int slot = (int)(n % RING);
    if (!quiet) {
        free(ring[slot]);
        ring[slot] = ring_alloc();
        memset(ring[slot], (int)n, 1000);
    }
    if (tick_fd >= 0) {
        char text[32];
        int len = snprintf(text, sizeof text, "%lu\n", n);
        if (pwrite(tick_fd, text, (size_t)len, 0) < 0)
            _exit(3);
    }
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
}

static void install(void)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    int sigs[] = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGCHLD, SIGHUP};
    for (unsigned i = 0; i < sizeof sigs / sizeof sigs[0]; i++)
        sigaction(sigs[i], &sa, NULL);
}

static int worker(const char *self, const char *name)
{
    if (name)
        prctl(PR_SET_NAME, name, 0, 0, 0);
    const char *q = getenv("FLEET_QUIET_WORKERS");
    quiet = q && strcmp(q, "1") == 0;
    open_tick_file();
    for (unsigned long n = 0; !stop && !quit_worker; n++) {
        tick(n);
        if (reexec) {
            char *argv[] = {(char *)self, "--worker", NULL};
            execv("/proc/self/exe", argv);
            return 4;
        }
        if (exec_other) {
            execlp("sleep", "sleep", "600", (char *)NULL);
            return 5;
        }
    }
    return 0;
}

static pid_t spawn(const char *self, const char *name)
{
    pid_t pid = fork();
    if (pid == 0) {
        signal(SIGCHLD, SIG_DFL);
        _exit(worker(self, name));
    }
    return pid;
}

int main(int argc, char **argv)
{
    install();
    if (argc >= 2 && strcmp(argv[1], "--worker") == 0)
        return worker(argv[0], NULL);
    int n = argc >= 2 ? atoi(argv[1]) : 0;
    const char *name = argc >= 3 ? argv[2] : "fleet-worker";
    if (n < 0 || n > MAX_WORKERS) {
        fprintf(stderr, "usage: fleet_service WORKERS [WORKER_NAME] | --worker\n");
        return 2;
    }
    pid_t workers[MAX_WORKERS];
    for (int i = 0; i < n; i++)
        workers[i] = spawn(argv[0], name);
    open_tick_file();
    for (unsigned long t = 0; !stop; t++) {
        tick(t);
        if (child_exited) {
            child_exited = 0;
            int status;
            pid_t done;
            while ((done = waitpid(-1, &status, WNOHANG)) > 0) {
                /* A worker asked to end (SIGUSR1, SIGTERM) exits with 0: anything else is a crash, said. */
                if (WIFSIGNALED(status) || WEXITSTATUS(status) != 0)
                    fprintf(stderr, "fleet_service: worker %d crashed: %s %d\n", (int)done,
                            WIFSIGNALED(status) ? "signal" : "exit status",
                            WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
                for (int i = 0; i < n; i++)
                    if (workers[i] == done && !stop)
                        workers[i] = spawn(argv[0], name); /* a restart */
            }
        }
    }
    for (int i = 0; i < n; i++)
        kill(workers[i], SIGTERM);
    while (wait(NULL) > 0 || errno == EINTR)
        ;
    return 0;
}
