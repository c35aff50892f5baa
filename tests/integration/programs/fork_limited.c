/* A parent that forks, on request, a child that may start no thread (it drops to nobody with RLIMIT_NPROC 0, as
 * haproxy's worker does): a forked child that inherits a sampler loaded in its parent. One word a line: the parent
 * prints "ready"; on "fork" it forks the child and prints "child PID"; on "alloc" the child allocates BLOCKS
 * blocks of BLOCK bytes at site_block and keeps them ("allocated"); on "exit" the child ends and the parent exits
 * with status 7. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#define BLOCKS 20000
#define BLOCK 1000
#define NOBODY 65534

static void *blocks[BLOCKS];

__attribute__((noinline)) void *site_block(size_t n)
{
    return malloc(n);
}

static void child(int from_parent)
{
    struct rlimit none = {0, 0};
    if (setgid(NOBODY) != 0 || setuid(NOBODY) != 0 || setrlimit(RLIMIT_NPROC, &none) != 0)
        _exit(2);
    char word;
    while (read(from_parent, &word, 1) == 1) {
        if (word == 'a') {
            for (int i = 0; i < BLOCKS; i++)
                blocks[i] = site_block(BLOCK);
            printf("allocated\n");
        } else {
            break;
        }
    }
    _exit(0);
}

int main(void)
{
    char word[64];
    int to_child[2] = {-1, -1};
    pid_t pid = -1;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    while (fgets(word, sizeof word, stdin)) {
        if (strcmp(word, "fork\n") == 0 && pid < 0) {
            if (pipe(to_child) != 0)
                return 1;
            pid = fork();
            if (pid == 0) {
                close(to_child[1]);
                child(to_child[0]);
            }
            close(to_child[0]);
            printf("child %d\n", (int)pid);
        } else if (strcmp(word, "alloc\n") == 0 && pid > 0) {
            if (write(to_child[1], "a", 1) != 1)
                return 1;
        } else if (strcmp(word, "exit\n") == 0) {
            if (pid > 0) {
                if (write(to_child[1], "x", 1) != 1)
                    kill(pid, SIGKILL);
                waitpid(pid, NULL, 0);
            }
            return 7;
        }
    }
    return 1;
}
