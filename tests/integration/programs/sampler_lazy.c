/* Lazy binding beside a second definition of malloc.
 *
 *   sampler_lazy SAMPLER SECOND
 *
 * dlopens SAMPLER and SECOND (RTLD_LOCAL: a second object defining malloc), prints "ready", waits for "go".
 * The executable has not called malloc yet, so its malloc slot is still unbound. Then: malloc(1 MiB) (this
 * first call binds the slot), 1.5 s of sleep (the sampler looks at skipped lazy slots every second), and
 * malloc(1 MiB) again. Prints "first 0xADDR", "second 0xADDR", then waits for "exit". */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int main(int argc, char **argv)
{
    if (argc < 3 || !dlopen(argv[1], RTLD_NOW | RTLD_NODELETE) || !dlopen(argv[2], RTLD_LAZY | RTLD_LOCAL))
        return 2;
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    char line[32];
    if (!fgets(line, sizeof line, stdin) || strncmp(line, "go", 2) != 0)
        return 3;
    void *first = malloc(1 << 20);
    struct timespec ts = {1, 500 * 1000 * 1000};
    nanosleep(&ts, NULL);
    void *second = malloc(1 << 20);
    printf("first %p\nsecond %p\n", first, second);
    if (!fgets(line, sizeof line, stdin))
        return 4;
    free(first);
    free(second);
    return 0;
}
