/* A program whose thread holds live AMX tile data (Intel's largest XSAVE component, 8 KiB) while it waits in
 * read(): an injected call must put it back to the byte. Prints "noamx" where the CPU or kernel gives no AMX,
 * else "ready"; then, for each line read, "ok" if tile 0 still holds what was loaded, "bad" if not.
 * Built without -mamx-tile: the instructions are written out, so any gcc builds it. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64)));

static uint8_t loaded[16 * 64] __attribute__((aligned(64)));
static uint8_t stored[16 * 64] __attribute__((aligned(64)));

int main(void)
{
    setvbuf(stdout, NULL, _IOLBF, 0);
    unsigned eax, ebx, ecx, edx;
    __asm__ volatile("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    if (!(edx & (1u << 24)) || syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
        puts("noamx");
        return 0;
    }
    struct tile_config cfg = {.palette = 1};
    cfg.colsb[0] = 64;
    cfg.rows[0] = 16;
    for (unsigned i = 0; i < sizeof loaded; i++)
        loaded[i] = (uint8_t)(i * 7 + 3);
    const uint8_t *src = loaded;
    long stride = 64;
    __asm__ volatile("ldtilecfg (%0)" : : "r"(&cfg) : "memory");
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm0" : : "r"(src), "r"(stride) : "memory");
    puts("ready");
    char line[64];
    while (fgets(line, sizeof line, stdin)) { /* blocks in read(): where the injected call comes */
        if (strncmp(line, "exit", 4) == 0)
            break;
        uint8_t *dst = stored;
        memset(stored, 0, sizeof stored);
        __asm__ volatile("tilestored %%tmm0, (%0,%1,1)" : : "r"(dst), "r"(stride) : "memory");
        puts(memcmp(loaded, stored, sizeof loaded) == 0 ? "ok" : "bad");
    }
    __asm__ volatile("tilerelease" ::: "memory");
    return 0;
}
