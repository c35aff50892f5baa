/* Installs an allow-everything seccomp filter, then waits on stdin: a target heapscope must refuse to inject
 * into (it cannot tell what a filter would do to the calls the sampler makes). */
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stdio.h>
#include <sys/prctl.h>

int main(void)
{
    struct sock_filter allow[] = {BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW)};
    struct sock_fprog prog = {1, allow};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog))
        return 3;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    char line[16];
    return fgets(line, sizeof line, stdin) ? 0 : 1;
}
