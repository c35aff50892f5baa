/* A library that defines malloc and free of its own and is loaded RTLD_LOCAL, never called: it makes "which
 * object would the loader bind a lazy slot to" ambiguous, as jemalloc or tcmalloc beside libc do. */
#include <stdlib.h>

void *malloc(size_t n)
{
    (void)n;
    abort();
}

void free(void *p)
{
    (void)p;
    abort();
}
