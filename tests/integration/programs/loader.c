/* dlopen of plugin.so: allocations from the loader, from the plugin's constructor and from its function. */
#include <dlfcn.h>
#include <stdlib.h>

void *volatile keep[4];

int main(int argc, char **argv)
{
    if (argc < 2)
        return 2;
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h)
        return 3;
    void *(*fn)(size_t) = (void *(*)(size_t))dlsym(h, "plugin_alloc");
    if (!fn)
        return 4;
    keep[0] = fn(4321);
    keep[1] = malloc(999);
    return 0;
}
