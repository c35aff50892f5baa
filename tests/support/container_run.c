/*
 * container_run ROOT PROGRAM [ARGS...]: PROGRAM in ROOT as a container runtime starts one process: new mount
 * and PID namespaces, ROOT bind-mounted onto itself with a fresh /proc inside, pivot_root into it, the old root
 * unmounted, then exec. PROGRAM is PID 1 of its namespace; this process waits for it on the host's side and
 * exits with its status. With HS_CGROUP=DIR, both first join that cgroup. Built static, so that nothing of the
 * host is needed once inside.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void die(const char *what)
{
    fprintf(stderr, "container_run: %s: %s\n", what, strerror(errno));
    exit(125);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: container_run ROOT PROGRAM [ARGS...]\n");
        return 125;
    }
    const char *root = argv[1];
    const char *cgroup = getenv("HS_CGROUP"); /* a cgroup v2 directory to run in, as the kubelet would place it */
    if (cgroup) {
        char procs[4096];
        snprintf(procs, sizeof procs, "%s/cgroup.procs", cgroup);
        FILE *f = fopen(procs, "w");
        if (!f || fputs("0\n", f) < 0 || fclose(f) != 0)
            die("join the cgroup");
    }
    if (unshare(CLONE_NEWNS | CLONE_NEWPID) != 0)
        die("unshare");
    pid_t child = fork();
    if (child < 0)
        die("fork");
    if (child > 0) {
        int status;
        while (waitpid(child, &status, 0) < 0)
            if (errno != EINTR)
                die("waitpid");
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    }
    char proc[4096];
    snprintf(proc, sizeof proc, "%s/proc", root);
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0)
        die("make / private");
    if (mount(root, root, NULL, MS_BIND | MS_REC, NULL) != 0)
        die("bind the root");
    mkdir(proc, 0555);
    if (mount("proc", proc, "proc", 0, NULL) != 0)
        die("mount proc");
    if (chdir(root) != 0)
        die("chdir");
    mkdir(".hs-oldroot", 0700);
    if (syscall(SYS_pivot_root, ".", ".hs-oldroot") != 0)
        die("pivot_root");
    if (chdir("/") != 0)
        die("chdir /");
    if (umount2("/.hs-oldroot", MNT_DETACH) != 0)
        die("unmount the old root");
    rmdir("/.hs-oldroot");
    execv(argv[2], argv + 2);
    die(argv[2]);
}
