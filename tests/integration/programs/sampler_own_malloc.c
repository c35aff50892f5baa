/* A program whose executable defines malloc and company itself (forwarding to glibc's internal entry
 * points): its allocator is linked into the executable, whose own calls never go through a GOT. */
#include <stddef.h>
#include <stdio.h>

extern void *__libc_malloc(size_t);
extern void __libc_free(void *);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

void *malloc(size_t n) { return __libc_malloc(n); }
void free(void *p) { __libc_free(p); }
void *calloc(size_t n, size_t m) { return __libc_calloc(n, m); }
void *realloc(void *p, size_t n) { return __libc_realloc(p, n); }

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    char line[16];
    return fgets(line, sizeof line, stdin) ? 0 : 1;
}
