/* Calls into the stripped shared library. */
#include <stddef.h>
#include "record.h"

void *exported(size_t n);
extern void *volatile ra_in_exported;
void *volatile got;

int main(int argc, char **argv)
{
    got = exported(64);
    got = exported(32);
    if (argc > 1)
        copy_maps(argv[1]);
    if (argc > 2) {
        int fd = open(argv[2], O_WRONLY | O_CREAT | O_TRUNC, 0644);
        put_hex(fd, "ra_in_exported", (unsigned long)ra_in_exported);
        put_hex(fd, "exported", (unsigned long)&exported);
        close(fd);
    }
    return 0;
}
