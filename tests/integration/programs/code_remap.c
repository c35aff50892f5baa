/* code_remap.c: allocates steadily through its own code, then maps its own file again (mmap, not the loader: no
 * dlopen event) and allocates through the copy of a function there, as a JIT or a hand-made loader would run code
 * from a mapping the profiler has not read yet.
 *
 * Usage: code_remap MS1 MS2. Prints "ready" and waits for "go"; allocates and frees a block a millisecond for MS1
 * ms; maps itself again, prints "remapped"; allocates for MS2 ms through the copy; prints "done", waits for "exit". */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef void *(*alloc_fn)(size_t);
typedef void (*free_fn)(void *);
typedef int (*through_fn)(alloc_fn, free_fn, size_t);

/* Position-independent without relocations: it reaches malloc and free only through its arguments (a call through
 * its PLT would read the copy's GOT, never relocated), so a copy of its bytes anywhere runs as it does. */
__attribute__((noinline)) int alloc_through(alloc_fn fn, free_fn release, size_t size)
{
    char *block = fn(size);
    if (!block)
        return -1;
    block[0] = 1;
    int got = block[0];
    release(block);
    return got;
}

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static int churn(through_fn through, double ms)
{
    double end = now_ms() + ms;
    while (now_ms() < end) {
        if (through(malloc, free, 96) != 1)
            return 1;
        usleep(1000);
    }
    return 0;
}

/* The start of this program's first mapping (its ELF header: file offset 0). */
static uintptr_t own_base(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    if (!f)
        return 0;
    char line[512];
    uintptr_t base = 0;
    while (!base && fgets(line, sizeof line, f)) {
        unsigned long start, offset;
        char path[256] = "";
        if (sscanf(line, "%lx-%*lx %*s %lx %*s %*s %255s", &start, &offset, path) == 3 && offset == 0 &&
            strstr(path, "code_remap"))
            base = start;
    }
    fclose(f);
    return base;
}

int main(int argc, char **argv)
{
    if (argc != 3)
        return 2;
    double first = atof(argv[1]), second = atof(argv[2]);
    char word[16];
    printf("ready\n");
    fflush(stdout);
    if (!fgets(word, sizeof word, stdin) || strcmp(word, "go\n"))
        return 2;
    if (churn(alloc_through, first))
        return 1;
    int fd = open("/proc/self/exe", O_RDONLY);
    struct stat st;
    uintptr_t base = own_base();
    if (fd < 0 || fstat(fd, &st) || !base)
        return 3;
    char *copy = mmap(NULL, st.st_size, PROT_READ | PROT_EXEC, MAP_PRIVATE, fd, 0);
    if (copy == MAP_FAILED)
        return 3;
    through_fn moved = (through_fn)(copy + ((uintptr_t)alloc_through - base));
    printf("remapped %p\n", (void *)moved);
    fflush(stdout);
    if (churn(moved, second))
        return 1;
    printf("done\n");
    fflush(stdout);
    if (!fgets(word, sizeof word, stdin) || strcmp(word, "exit\n"))
        return 2;
    return 0;
}
