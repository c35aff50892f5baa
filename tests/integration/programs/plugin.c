/* A small shared object that allocates in its constructor and in a function. */
#include <stdlib.h>

void *volatile plugin_keep[4];

__attribute__((constructor)) static void plugin_init(void)
{
    plugin_keep[0] = malloc(1234);
}

void *plugin_alloc(size_t n)
{
    plugin_keep[1] = malloc(n);
    return plugin_keep[1];
}
