/* Built as a shared library, then stripped: only .dynsym names remain, so `hidden` is unknown. */
#include <stdlib.h>
void *volatile lib_sink;
void *volatile ra_in_exported;

__attribute__((noinline)) static void *hidden(size_t n)
{
    ra_in_exported = __builtin_return_address(0);
    void *p = malloc(n);
    lib_sink = p;
    return p;
}

__attribute__((noinline)) void *exported(size_t n)
{
    void *p = hidden(n);
    lib_sink = p;
    return p;
}
