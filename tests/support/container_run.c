/*
 * container_run ROOT PROGRAM [ARGS...]: PROGRAM in ROOT as a container runtime starts one process: new mount
 * and PID namespaces, ROOT bind-mounted onto itself with a fresh /proc inside, pivot_root into it, the old root
 * unmounted, then exec. PROGRAM is PID 1 of its namespace; this process waits for it on the host's side and
 * exits with its status. With HS_CGROUP=DIR, both first join that cgroup. Built static, so that nothing of the
 * host is needed once inside.
 *
 * For a container that looks at the host, as a monitoring agent's does (docker run --pid=host, a pod with hostPID
 * and hostPath volumes), more settings in the environment:
 *   HS_HOST_PID=1            keep the host's PID namespace: the /proc inside shows the host's processes
 *   HS_CGROUPNS=1            a cgroup namespace of its own (after joining HS_CGROUP), as containerd gives on cgroup v2
 *   HS_SYSFS=1 or ro         a sysfs at /sys, as runtimes mount it (read-only for an unprivileged container)
 *   HS_BINDS="SRC:DST[:ro] ..."  host paths bind-mounted inside (after /sys: DST may be below it), made if missing
 *   HS_CAPS="N ..."          the capabilities kept (their numbers), all others dropped from the bounding set just
 *                            before exec: root's program then gets only these (securityContext.capabilities)
 * The HS_ settings are taken out of the environment PROGRAM gets.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define ROOTED(buf, root, path) snprintf(buf, sizeof buf, "%s/%s", root, (path)[0] == '/' ? (path) + 1 : (path))

static void die(const char *what)
{
    fprintf(stderr, "container_run: %s: %s\n", what, strerror(errno));
    exit(125);
}

static int setting(const char *name)
{
    const char *v = getenv(name);
    return v && strcmp(v, "1") == 0;
}

/* mkdir -p of a mount point: a directory, or an empty file where the source is not one. */
static void mount_point(char *path, int directory)
{
    for (char *p = path + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(path, 0755);
            *p = '/';
        }
    if (directory) {
        mkdir(path, 0755);
    } else {
        FILE *f = fopen(path, "a");
        if (f)
            fclose(f);
    }
}

/* HS_BINDS: "SRC:DST[:ro]" separated by spaces, each bound (with what is mounted below it) under ROOT. */
static void bind_all(const char *root, const char *binds)
{
    char *list = strdup(binds), *save = NULL;
    for (char *item = strtok_r(list, " \n", &save); item; item = strtok_r(NULL, " \n", &save)) {
        char *dst = strchr(item, ':');
        if (!dst) {
            errno = EINVAL;
            die(item);
        }
        *dst++ = 0;
        char *opt = strchr(dst, ':');
        if (opt)
            *opt++ = 0;
        char target[4096];
        struct stat st;
        ROOTED(target, root, dst);
        if (stat(item, &st) != 0)
            die(item);
        mount_point(target, S_ISDIR(st.st_mode));
        if (mount(item, target, NULL, MS_BIND | MS_REC, NULL) != 0)
            die(item);
        if (opt && strcmp(opt, "ro") == 0 && mount(NULL, target, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY, NULL) != 0)
            die("remount read-only");
    }
    free(list);
}

/* HS_CAPS: every capability not in the list leaves the bounding set. */
static void keep_caps(const char *caps)
{
    char keep[64] = {0};
    char *list = strdup(caps), *save = NULL;
    for (char *item = strtok_r(list, " ", &save); item; item = strtok_r(NULL, " ", &save)) {
        int n = atoi(item);
        if (n >= 0 && n < 64)
            keep[n] = 1;
    }
    free(list);
    for (int n = 0; n < 64 && prctl(PR_CAPBSET_READ, n) >= 0; n++)
        if (!keep[n] && prctl(PR_CAPBSET_DROP, n) != 0)
            die("drop a capability");
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
    int host_pid = setting("HS_HOST_PID");
    const char *sysfs = getenv("HS_SYSFS"), *binds = getenv("HS_BINDS"), *caps = getenv("HS_CAPS");
    if (unshare(CLONE_NEWNS | (host_pid ? 0 : CLONE_NEWPID) | (setting("HS_CGROUPNS") ? CLONE_NEWCGROUP : 0)) != 0)
        die("unshare");
    char *binds_copy = binds ? strdup(binds) : NULL, *caps_copy = caps ? strdup(caps) : NULL;
    int sysfs_ro = sysfs && strcmp(sysfs, "ro") == 0, with_sysfs = sysfs_ro || (sysfs && strcmp(sysfs, "1") == 0);
    const char *settings[] = {"HS_CGROUP", "HS_HOST_PID", "HS_CGROUPNS", "HS_SYSFS", "HS_BINDS", "HS_CAPS"};
    for (size_t i = 0; i < sizeof settings / sizeof *settings; i++)
        unsetenv(settings[i]);
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
    if (with_sysfs) {
        char sys[4096];
        ROOTED(sys, root, "/sys");
        mkdir(sys, 0555);
        if (mount("sysfs", sys, "sysfs", sysfs_ro ? MS_RDONLY : 0, NULL) != 0)
            die("mount sysfs");
    }
    if (binds_copy)
        bind_all(root, binds_copy);
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
    if (caps_copy)
        keep_caps(caps_copy);
    execv(argv[2], argv + 2);
    die(argv[2]);
}
