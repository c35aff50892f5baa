/* Allocations on a stack with nothing readable above it: a ucontext coroutine whose stack ends right below a
 * PROT_NONE page. The stack walk's long reads from near that end fail, and it must read again up to the page
 * end instead of losing the stack. coroutine() keeps 10 blocks of 100..109 bytes: 1045 bytes. */
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>

#define NOINLINE __attribute__((noinline))
#define PAGE 4096

static ucontext_t main_ctx, co_ctx;
void *volatile keep[10];

NOINLINE void *leaf(size_t n)
{
    return malloc(n);
}

NOINLINE void coroutine(void)
{
    for (int i = 0; i < 10; i++)
        keep[i] = leaf(100 + (size_t)i);
}

int main(void)
{
    size_t size = 16 * PAGE;
    char *stack = mmap(NULL, size + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (stack == MAP_FAILED || mprotect(stack + size, PAGE, PROT_NONE))
        return 1;
    if (getcontext(&co_ctx))
        return 1;
    co_ctx.uc_stack.ss_sp = stack;
    co_ctx.uc_stack.ss_size = size;
    co_ctx.uc_link = &main_ctx;
    makecontext(&co_ctx, coroutine, 0);
    if (swapcontext(&main_ctx, &co_ctx))
        return 1;
    return 0;
}
