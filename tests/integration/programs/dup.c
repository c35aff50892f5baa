/* strdup allocates inside libc (built without frame pointers). */
#include <stdlib.h>
#include <string.h>

char *volatile keep[8];

__attribute__((noinline)) char *copy(const char *s)
{
    return strdup(s);
}

int main(void)
{
    keep[0] = copy("a string of some length, more than a few bytes anyway");
    keep[1] = strdup("short");
    keep[2] = malloc(500);
    free(keep[1]);
    return 0;
}
