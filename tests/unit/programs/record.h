/* Helpers for symbolizer test programs: no stdio and no heap, so Massif sees only the test's own blocks. */
#include <fcntl.h>
#include <unistd.h>

/* Copy /proc/self/maps to a file: under Valgrind this is the layout Valgrind chose for the client. */
static void copy_maps(const char *out)
{
    char buf[4096];
    ssize_t n;
    int in = open("/proc/self/maps", O_RDONLY);
    int fd = open(out, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    while ((n = read(in, buf, sizeof buf)) > 0)
        if (write(fd, buf, (size_t)n) != n)
            break;
    close(in);
    close(fd);
}

/* Append "tag 0xHEX\n" to fd. */
static void put_hex(int fd, const char *tag, unsigned long v)
{
    char buf[64];
    int i = 0, j;
    char digits[17];
    int nd = 0;
    while (tag[i]) { buf[i] = tag[i]; i++; }
    buf[i++] = ' '; buf[i++] = '0'; buf[i++] = 'x';
    do { digits[nd++] = "0123456789abcdef"[v & 15]; v >>= 4; } while (v);
    for (j = nd - 1; j >= 0; j--) buf[i++] = digits[j];
    buf[i++] = '\n';
    if (write(fd, buf, (size_t)i) != i)
        return;
}
