/* Aligned allocations named on the command line, so that a test knows every block the program holds.
 * Each argument is FN:ALIGN:SIZE, FN one of memalign, posix_memalign, aligned_alloc, valloc (ALIGN unused)
 * and malloc (ALIGN unused), or free:N, which frees the block of the Nth argument (from 0). */
#define _GNU_SOURCE
#include <malloc.h>
#include <stdlib.h>
#include <string.h>

void *volatile keep[64];

int main(int argc, char **argv)
{
    for (int i = 1; i < argc && i <= 64; i++) {
        char fn[32];
        unsigned long align = 0, size = 0;
        char *colon = strchr(argv[i], ':');
        if (!colon || (size_t)(colon - argv[i]) >= sizeof fn)
            return 2;
        memcpy(fn, argv[i], colon - argv[i]);
        fn[colon - argv[i]] = 0;
        char *rest = colon + 1;
        align = strtoul(rest, &rest, 10);
        if (!strcmp(fn, "free")) {
            free(keep[align]);
            continue;
        }
        if (*rest++ != ':')
            return 2;
        size = strtoul(rest, 0, 10);
        void *p = 0;
        if (!strcmp(fn, "memalign"))
            p = memalign(align, size);
        else if (!strcmp(fn, "posix_memalign")) {
            if (posix_memalign(&p, align, size))
                return 3;
        } else if (!strcmp(fn, "aligned_alloc"))
            p = aligned_alloc(align, size);
        else if (!strcmp(fn, "valloc"))
            p = valloc(size);
        else if (!strcmp(fn, "malloc"))
            p = malloc(size);
        else
            return 2;
        if (!p)
            return 3;
        keep[i - 1] = p;
    }
    return 0;
}
