/* Page syscalls for Massif's --pages-as-heap=yes series (test_page_series.py). A 64 MiB mapping made and unmapped
 * first marks where the program's own calls start; then the break moves up and down (by pages, then by unaligned
 * amounts, where Massif 3.19's arithmetic keeps a page twice), pages are mapped and unmapped, shrunk and moved with
 * mremap, and mapped over with MAP_FIXED (Massif keeps the pages mapped over, under the new ones). */
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#define PAGE 4096L

static void *map(long pages)
{
    return mmap(NULL, pages * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
}

int main(int argc, char **argv)
{
    long rounds = argc > 1 ? atol(argv[1]) : 40;
    void *marker = map(16384);
    munmap(marker, 16384 * PAGE);
    for (long i = 0; i < rounds; i++) {
        long n = 1 + i % 5;
        sbrk(n * PAGE);
        char *p = map(n + 1);
        sbrk(-n * PAGE);
        p = mremap(p, (n + 1) * PAGE, PAGE, 0); /* shrunk in place */
        /* Moved where the test put it: whether a mapping can grow in place depends on the address space's layout,
         * which is Valgrind's under Valgrind. */
        char *to = map(n + 3);
        munmap(to, (n + 3) * PAGE);
        p = mremap(p, PAGE, (n + 3) * PAGE, MREMAP_MAYMOVE | MREMAP_FIXED, to);
        munmap(p, (n + 3) * PAGE);
    }
    sbrk(100);            /* the break off a page boundary from here on */
    sbrk(3 * PAGE + 50);
    sbrk(-(3 * PAGE + 150));
    char *base = map(8);
    mmap(base + 2 * PAGE, 3 * PAGE, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
    munmap(base, 8 * PAGE); /* the pages mapped over stay, in Massif */
    munmap(base, 8 * PAGE); /* and go now */
    return 0;
}
