/* Prints "ready" and waits for a line on stdin (a target for the refusal tests; built static for one). */
#include <stdio.h>

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    printf("ready\n");
    char line[16];
    return fgets(line, sizeof line, stdin) ? 0 : 1;
}
