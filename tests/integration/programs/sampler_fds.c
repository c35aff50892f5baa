/* A program that closes every descriptor it did not open itself and forks, while the sampler is armed.
 *
 *   sampler_fds LIBRARY
 *
 * dlopens LIBRARY, prints "ready", waits for "go". Then: forks a child that allocates and exits 0 (the
 * sampler is armed: the child inherits the hooks); closes descriptors 3..1023 (as daemons do), makes pipes
 * that take the numbers the sampler had, pushes data through all of them and checks it; allocates more;
 * prints "checked N" with N wrong results, waits for "exit". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv)
{
    if (argc < 2 || !dlopen(argv[1], RTLD_NOW | RTLD_NODELETE))
        return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    char line[32];
    if (!fgets(line, sizeof line, stdin) || strncmp(line, "go", 2) != 0)
        return 3;
    int wrong = 0;
    pid_t child = fork();
    if (child == 0) {
        for (int i = 0; i < 100000; i++)
            free(malloc(64 + i % 4096));
        _exit(0);
    }
    int status = 0;
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        wrong++;
    for (int fd = 3; fd < 1024; fd++)
        close(fd);
    int pipes[8][2];
    for (int i = 0; i < 8; i++)
        if (pipe(pipes[i]))
            return 4;
    usleep(300 * 1000); /* the sampler's control thread looks at its lease several times meanwhile */
    for (int i = 0; i < 8; i++) {
        char out[64], in[64] = {0};
        snprintf(out, sizeof out, "pipe %d", i);
        if (write(pipes[i][1], out, strlen(out)) != (ssize_t)strlen(out))
            wrong++;
        if (read(pipes[i][0], in, sizeof in - 1) != (ssize_t)strlen(out) || strcmp(in, out) != 0)
            wrong++;
    }
    for (int i = 0; i < 100000; i++)
        free(malloc(64 + i % 4096));
    printf("checked %d\n", wrong);
    if (!fgets(line, sizeof line, stdin))
        return 5;
    return 0;
}
