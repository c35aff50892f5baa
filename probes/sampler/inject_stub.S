/* The code heapscope's injection runs in a target thread (agent/process/inject.py): call one function, then
 * put every register of the thread back and jump to where it was, by itself. heapscope detaches before the
 * call runs, so if heapscope dies meanwhile, even by SIGKILL, the thread still comes back exactly.
 *
 * One blob, one section: page 0 is code (made read+exec), pages 1-5 data (read+write). heapscope fills the
 * data (labels below, found by name in the assembled object; local, so the assembler resolves every
 * reference itself) and sets %rip = stub_entry and %rsp to a
 * 16-byte aligned spot below the thread's red zone. Everything is %rip-relative: no relocation.
 *
 * Signals are blocked around the call (the thread's own mask is put back before the context), so a
 * handler never runs inside the loader on our account.
 */
    .text
stub_entry:
    mov     $14, %eax               /* rt_sigprocmask(SIG_SETMASK, &all_mask, &old_mask, 8) */
    mov     $2, %edi
    lea     all_mask(%rip), %rsi
    lea     old_mask(%rip), %rdx
    mov     $8, %r10d
    syscall
    mov     thread_create(%rip), %rax
    test    %rax, %rax
    jnz     2f
    call    call_function           /* on this thread */
    jmp     1f
2:  /* On a thread of its own, this one waiting for it: what the call allocates comes from that thread's heap
     * (glibc gives a new thread a new arena), not from the one this thread shares with the program. On a stack
     * heapscope mapped: glibc then frees the thread's TLS vector at the join (it would keep it, allocated from
     * the program's heap, with a stack of its own making), and the stack is unmapped here after it. */
    lea     thread_attr(%rip), %rdi /* pthread_attr_init(&thread_attr) */
    call    *thread_attr_init(%rip)
    lea     thread_attr(%rip), %rdi /* pthread_attr_setstack(&thread_attr, thread_stack, thread_stack_size) */
    mov     thread_stack(%rip), %rsi
    mov     thread_stack_size(%rip), %rdx
    call    *thread_attr_setstack(%rip)
    lea     thread(%rip), %rdi      /* pthread_create(&thread, &thread_attr, call_function, NULL) */
    lea     thread_attr(%rip), %rsi
    lea     thread_function(%rip), %rdx
    xor     %ecx, %ecx
    call    *thread_create(%rip)
    mov     %rax, create_error(%rip)
    test    %eax, %eax
    jnz     3f                      /* no thread (a thread limit): heapscope calls again without one */
    mov     thread(%rip), %rdi      /* pthread_join(thread, NULL) */
    xor     %esi, %esi
    call    *thread_join(%rip)
    /* The program was single-threaded and the library loaded kept it so (its mark set: no control thread
     * started): with the call's thread joined it is single-threaded again, and glibc's flags say so once more
     * (pthread_create cleared them for good). This thread runs here, not in the program's code, and no other
     * thread is left: nothing reads them meanwhile. */
    mov     single_flag(%rip), %rax /* &__libc_single_threaded, 0: not asked */
    test    %rax, %rax
    jz      3f
    mov     result(%rip), %rcx      /* dlopen's handle, a link_map: its first word is the library's base */
    test    %rcx, %rcx
    jz      3f
    mov     (%rcx), %rcx
    add     single_mark(%rip), %rcx /* the library's hs_kept_single_threaded */
    cmpl    $0, (%rcx)
    je      3f
    movb    $1, (%rax)
    movl    $0, %fs:0x18            /* x86-64 glibc's tcbhead_t.multiple_threads (its atomics' lock prefix) */
3:
    mov     $11, %eax               /* munmap(thread_stack, thread_stack_size) */
    mov     thread_stack(%rip), %rdi
    mov     thread_stack_size(%rip), %rsi
    syscall
1:
    mov     $14, %eax               /* rt_sigprocmask(SIG_SETMASK, &old_mask, NULL, 8) */
    mov     $2, %edi
    lea     old_mask(%rip), %rsi
    xor     %edx, %edx
    mov     $8, %r10d
    syscall
    mov     $-1, %eax               /* every component the saved area holds */
    mov     $-1, %edx
    xrstor64 xsave_area(%rip)
    movq    $1, done(%rip)
    mov     saved_rax(%rip), %rax
    mov     saved_rbx(%rip), %rbx
    mov     saved_rcx(%rip), %rcx
    mov     saved_rdx(%rip), %rdx
    mov     saved_rsi(%rip), %rsi
    mov     saved_rdi(%rip), %rdi
    mov     saved_rbp(%rip), %rbp
    mov     saved_r8(%rip), %r8
    mov     saved_r9(%rip), %r9
    mov     saved_r10(%rip), %r10
    mov     saved_r11(%rip), %r11
    mov     saved_r12(%rip), %r12
    mov     saved_r13(%rip), %r13
    mov     saved_r14(%rip), %r14
    mov     saved_r15(%rip), %r15
    lea     saved_rflags(%rip), %rsp /* lea and mov leave the flags alone: popfq is the last to set them */
    popfq
    mov     saved_rsp(%rip), %rsp
    jmp     *saved_rip(%rip)

/* The call's own thread: named first, so that the library it loads knows heapscope's injection made it
 * (hs_sampler.c single_threaded_program), then the call. */
thread_function:
    mov     $157, %eax              /* prctl(PR_SET_NAME, thread_name) */
    mov     $15, %edi
    lea     thread_name(%rip), %rsi
    syscall
    jmp     call_function

/* function(arg0, arg1), and dlerror() in the same thread if it returned NULL; called with a 16-byte aligned
 * stack plus the return address, as pthread_create's start routine is. */
call_function:
    sub     $8, %rsp
    mov     arg0(%rip), %rdi
    mov     arg1(%rip), %rsi
    call    *function(%rip)
    mov     %rax, result(%rip)
    test    %rax, %rax
    jnz     1f
    mov     error_function(%rip), %rax
    test    %rax, %rax
    jz      1f
    call    *%rax                   /* dlerror(): its message, for heapscope to read */
    mov     %rax, error(%rip)
1:
    add     $8, %rsp
    xor     %eax, %eax
    ret

    .org    4096
data_start:
function:       .quad 0
arg0:           .quad 0
arg1:           .quad 0
error_function: .quad 0
result:         .quad 0
error:          .quad 0
done:           .quad 0
thread_create:  .quad 0             /* pthread_create, to make the call on a new thread; 0: on this one */
thread_join:    .quad 0
thread_attr_init: .quad 0
thread_attr_setstack: .quad 0
thread_stack:   .quad 0
thread_stack_size: .quad 0
thread:         .quad 0
create_error:   .quad 0             /* pthread_create's answer */
single_flag:    .quad 0             /* &__libc_single_threaded where the program was single-threaded, else 0 */
single_mark:    .quad 0             /* hs_kept_single_threaded's offset in the library dlopen'ed */
thread_name:    .ascii "hs-load\0"  /* the call's thread's name (hs_sampler.c HS_LOAD_THREAD) */
    .balign 16
thread_attr:    .space 64           /* a pthread_attr_t (56 bytes on x86-64) */
all_mask:       .quad -1
old_mask:       .quad 0
saved_rax:      .quad 0
saved_rbx:      .quad 0
saved_rcx:      .quad 0
saved_rdx:      .quad 0
saved_rsi:      .quad 0
saved_rdi:      .quad 0
saved_rbp:      .quad 0
saved_rsp:      .quad 0
saved_r8:       .quad 0
saved_r9:       .quad 0
saved_r10:      .quad 0
saved_r11:      .quad 0
saved_r12:      .quad 0
saved_r13:      .quad 0
saved_r14:      .quad 0
saved_r15:      .quad 0
saved_rflags:   .quad 0
saved_rip:      .quad 0
    .org    8192                    /* XRSTOR wants 64-byte alignment */
xsave_area:                         /* four pages: AMX's tile data alone is 8 KiB (11,008 bytes in all with it) */
    .org    8192 + 16384
blob_end:
