/* fork_ring.c: CHILDREN forked workers of one program pass a token round a ring of pipes, as a prefork server's
 * workers take turns at requests: each, holding the token, allocates and frees one block through a chain of
 * DEPTH calls, then hands the token on. Every worker walks the same return addresses, one after another on the
 * same CPUs (the kernel's rule cache: probes/bpf/unwind.h).
 *
 * Protocol: prints "ready PID PID ..." (the workers), waits for "go", prints "done" once every worker has made
 * ROUNDS turns and exited, and exits 0 (1 if a worker failed). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define CHILDREN 3
#define ROUNDS 3000
#define DEPTH 10

static int pipes[CHILDREN][2];

__attribute__((noinline)) static int chain(int depth, int who)
{
    if (depth > 0)
        return chain(depth - 1, who) + 1; /* not a tail call: each level keeps its frame */
    char *block = malloc(64 + who);
    if (!block)
        return -1000;
    memset(block, who, 64);
    int sum = block[1];
    free(block);
    return sum - who;
}

static int worker(int who)
{
    char token;
    for (int round = 0; round < ROUNDS; round++) {
        if (read(pipes[who][0], &token, 1) != 1)
            return 1;
        if (chain(DEPTH, who) != DEPTH)
            return 1;
        if (write(pipes[(who + 1) % CHILDREN][1], &token, 1) != 1)
            return 1;
    }
    return 0;
}

int main(void)
{
    pid_t pids[CHILDREN];
    for (int i = 0; i < CHILDREN; i++)
        if (pipe(pipes[i]))
            return 2;
    for (int i = 0; i < CHILDREN; i++) {
        pids[i] = fork();
        if (pids[i] < 0)
            return 2;
        if (pids[i] == 0)
            _exit(worker(i)); /* the parent keeps every end open: the last writes never meet a closed pipe */
    }
    printf("ready");
    for (int i = 0; i < CHILDREN; i++)
        printf(" %d", (int)pids[i]);
    printf("\n");
    fflush(stdout);
    char word[16];
    if (!fgets(word, sizeof word, stdin) || strcmp(word, "go\n"))
        return 2;
    if (write(pipes[0][1], "t", 1) != 1)
        return 2;
    int failed = 0;
    for (int i = 0; i < CHILDREN; i++) {
        int status;
        if (waitpid(pids[i], &status, 0) != pids[i] || !WIFEXITED(status) || WEXITSTATUS(status))
            failed = 1;
    }
    printf("done\n");
    fflush(stdout);
    return failed;
}
