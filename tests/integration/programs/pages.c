/* pages.c: page syscalls at known call sites, for --pages-as-heap=yes (tests/integration/test_page_memory.py).
 *
 * Each phase is a noinline function named after what it does; the test finds it in the trees. No malloc is
 * called (output goes through write() from a static buffer), so the only page syscalls are these, the
 * loader's and libc's start-up. Expected bytes at each site, at the end, by Massif's rules (the peak is right
 * after big_map):
 *   grow_base 1 MiB (2 MiB mapped, the upper 1 MiB unmapped again)   grow_in_place 1 MiB (the new tail)
 *   move_base 1 page (1 MiB + 1 page mapped: guard_page maps over the last page with MAP_FIXED, so the first
 *   1 MiB cannot grow in place, and move_grow moves it away; Massif keeps the page mapped over)
 *   guard_page 4 KiB   move_grow 3 MiB (the moved range, growth included)
 *   brk_up 3 pages (5 up, 2 down by brk_down)   fixed_base 1 MiB (Massif keeps the 128 KiB fixed_over maps over)
 *   fixed_over 128 KiB
 *   big_map 64 MiB at the peak, 32 MiB at the end (big_unmap unmaps its upper half)
 * Before exiting it prints "mapped <bytes> stack <bytes> uprobes <bytes> vdso <bytes>": its mapped total as
 * /proc/self/maps gives it (all lines but [vsyscall]), the size of its [stack] mapping, which grows without a
 * system call, of the [uprobes] page, which the kernel maps for the probes themselves, and of the vDSO's
 * mappings, which Massif never counts (a program under Valgrind has none).
 * With an argument it first maps 2 MiB in before_attach(), then waits for a byte on stdin (the test attaches
 * meanwhile) before the phases.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define MiB (1024UL * 1024UL)
#define PAGE 4096UL

static char buf[1 << 16];

static void fail(const char *what)
{
    int n = snprintf(buf, sizeof buf, "pages: %s failed\n", what);
    write(2, buf, n);
    _exit(3);
}

static void *anon(void *at, size_t len, int extra_flags)
{
    void *p = mmap(at, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | extra_flags, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

__attribute__((noinline)) void *before_attach(void) { return anon(NULL, 2 * MiB, 0); }
__attribute__((noinline)) void *grow_base(void) { return anon(NULL, 2 * MiB, 0); }
__attribute__((noinline)) void *grow_in_place(void *p) { return mremap(p, 1 * MiB, 2 * MiB, 0); }
__attribute__((noinline)) void *move_base(void) { return anon(NULL, 1 * MiB + PAGE, 0); }
__attribute__((noinline)) void *guard_page(void *at) { return anon(at, PAGE, MAP_FIXED); }
__attribute__((noinline)) void *move_grow(void *p) { return mremap(p, 1 * MiB, 3 * MiB, MREMAP_MAYMOVE); }
__attribute__((noinline)) void *brk_up(void) { return sbrk(5 * PAGE); }
__attribute__((noinline)) void *brk_down(void) { return sbrk(-2 * (long)PAGE); }
__attribute__((noinline)) void *fixed_base(void) { return anon(NULL, 1 * MiB, 0); }
__attribute__((noinline)) void *fixed_over(void *at) { return anon(at, 128 * 1024, MAP_FIXED); }
__attribute__((noinline)) void *big_map(void) { return anon(NULL, 64 * MiB, 0); }
__attribute__((noinline)) int big_unmap(void *p) { return munmap((char *)p + 32 * MiB, 32 * MiB); }

/* Sum of the /proc/self/maps ranges but [vsyscall], and the [stack], [uprobes] and vDSO ranges; read without
 * malloc. */
static void mapped(unsigned long *total, unsigned long *stack, unsigned long *uprobes, unsigned long *vdso)
{
    int fd = open("/proc/self/maps", O_RDONLY);
    size_t len = 0;
    ssize_t n;
    if (fd < 0)
        fail("open maps");
    while ((n = read(fd, buf + len, sizeof buf - 1 - len)) > 0)
        len += n;
    close(fd);
    buf[len] = 0;
    *total = *stack = *uprobes = *vdso = 0;
    for (char *line = buf; line && *line; ) {
        char *end = strchr(line, '\n');
        if (end)
            *end = 0; /* one line at a time */
        unsigned long lo, hi;
        if (sscanf(line, "%lx-%lx", &lo, &hi) == 2 && !strstr(line, "[vsyscall]")) {
            *total += hi - lo;
            if (strstr(line, "[stack]"))
                *stack += hi - lo;
            if (strstr(line, "[uprobes]"))
                *uprobes += hi - lo;
            if (strstr(line, "[vdso]") || strstr(line, "[vvar"))
                *vdso += hi - lo;
        }
        line = end ? end + 1 : NULL;
    }
}

int main(int argc, char **argv)
{
    if (argc > 1) {
        if (!before_attach())
            fail("before_attach");
        char go;
        write(1, "ready\n", 6);
        if (read(0, &go, 1) != 1)
            fail("wait for the attach");
    }

    char *g = grow_base();
    if (!g || munmap(g + 1 * MiB, 1 * MiB))
        fail("grow_base");
    if (grow_in_place(g) != g) /* nothing else maps meanwhile: the hole is still free */
        fail("grow_in_place");

    char *m = move_base();
    if (!m || guard_page(m + 1 * MiB) != m + 1 * MiB) /* growing in place is now impossible */
        fail("move_base/guard_page");
    char *moved = move_grow(m);
    if (moved == MAP_FAILED || moved == m)
        fail("move_grow");

    if (brk_up() == (void *)-1 || brk_down() == (void *)-1)
        fail("brk");

    char *f = fixed_base();
    if (!f || fixed_over(f + 256 * 1024) != f + 256 * 1024)
        fail("fixed");

    char *big = big_map();
    if (!big || big_unmap(big))
        fail("big");

    unsigned long total, stack, uprobes, vdso;
    mapped(&total, &stack, &uprobes, &vdso);
    int n = snprintf(buf, sizeof buf, "mapped %lu stack %lu uprobes %lu vdso %lu\n", total, stack, uprobes, vdso);
    write(1, buf, n);
    return 0;
}
