// C++ operators and a library loaded after arming, under the in-process sampler.
//
//   sampler_cxx LIBRARY PLUGIN
//
// dlopens LIBRARY (the sampler), prints "ready", waits for "go"; then: 1 MiB through each of new, new[],
// aligned new and nothrow new (all at or above the test's rate, so always sampled), a bad_alloc thrown
// through the operator-new hook and caught, 1 MiB again through new (the thread must still be sampling),
// then dlopens PLUGIN, waits 300 ms (the sampler patches new objects within its 50 ms poll) and allocates
// 1 MiB through the plugin. Prints each block's address as "NAME 0xADDR", then "done"; waits for "exit".
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include <new>
#include <string>

int main(int argc, char **argv)
{
    if (argc < 3 || !dlopen(argv[1], RTLD_NOW | RTLD_NODELETE))
        return 2;
    setvbuf(stdout, nullptr, _IOLBF, 0);
    printf("ready\n");
    char line[32];
    if (!fgets(line, sizeof line, stdin) || strncmp(line, "go", 2) != 0)
        return 3;
    const size_t mib = 1 << 20;
    char *a = new char[mib];
    auto *b = static_cast<char *>(::operator new(mib));
    auto *c = static_cast<char *>(::operator new(mib, std::align_val_t(64)));
    auto *d = static_cast<char *>(::operator new(mib, std::nothrow));
    printf("new[] %p\nnew %p\naligned_new %p\nnothrow_new %p\n", (void *)a, (void *)b, (void *)c, (void *)d);
    bool threw = false;
    try {
        volatile size_t huge = (size_t)1 << 62;
        char *e = new char[huge];
        printf("huge %p\n", (void *)e);
    } catch (const std::bad_alloc &) {
        threw = true;
    }
    printf("threw %d\n", threw ? 1 : 0);
    auto *f = static_cast<char *>(::operator new(mib));
    printf("after_throw %p\n", (void *)f);
    void *plugin = dlopen(argv[2], RTLD_NOW);
    if (!plugin)
        return 4;
    struct timespec ts = {0, 300 * 1000 * 1000};
    nanosleep(&ts, nullptr);
    auto plugin_alloc = reinterpret_cast<void *(*)(size_t)>(dlsym(plugin, "plugin_alloc"));
    printf("plugin %p\n", plugin_alloc(mib));
    printf("done\n");
    if (!fgets(line, sizeof line, stdin))
        return 5;
    delete[] a;
    ::operator delete(b);
    ::operator delete(c, std::align_val_t(64));
    ::operator delete(d);
    ::operator delete(f, mib);
    return 0;
}
