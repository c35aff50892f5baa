/* C: out-of-line calls, an always_inline chain, a plain inline function and libc allocators. */
#include <stdlib.h>
#include <string.h>
#include "record.h"

void *volatile sink[8];
void *volatile ra_in_middle;
void *volatile ra_in_main;

static inline __attribute__((always_inline)) void *level3(size_t n) { return malloc(n); }
static inline __attribute__((always_inline)) void *level2(size_t n) { return level3(n + 8); }
static inline void *level1(size_t n) { return level2(n * 2); }

__attribute__((noinline)) void *leaf(size_t n)
{
    ra_in_middle = __builtin_return_address(0);
    return malloc(n);
}

__attribute__((noinline)) void *middle(size_t n)
{
    ra_in_main = __builtin_return_address(0);
    void *p = leaf(n);
    sink[7] = p;
    return p;
}

int main(int argc, char **argv)
{
    sink[0] = middle(100);
    sink[1] = level1(200);
    sink[2] = strdup("a string that lives on the heap");
    sink[3] = calloc(4, 32);
    sink[4] = realloc(NULL, 48);
    if (argc > 1)
        copy_maps(argv[1]);
    if (argc > 2) {
        int fd = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC, 0644);
        put_hex(fd, "ra_in_middle", (unsigned long)ra_in_middle);
        put_hex(fd, "ra_in_main", (unsigned long)ra_in_main);
        put_hex(fd, "main", (unsigned long)&main);
        close(fd);
    }
    return 0;
}
