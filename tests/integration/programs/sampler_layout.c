/* Prints the sampler's control-block layout and its weights, from the header and the library themselves.
 *
 *   sampler_layout LIBRARY RATE SIZE...
 *
 * "field NAME OFFSET" per field, "size N", "count NAME OFFSET" per field of struct hs_counts, "counts SIZE SLOTS",
 * "fn NAME VALUE" per enum hs_sample_fn member, then "weight SIZE W" per size (hs_weight from the library), and
 * "drawn SIZE W" per size (hs_drawn_weight: a countdown drawn at RATE, the rate in force since risen above SIZE). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../../../probes/sampler/hs_sampler.h"

#define F(name) printf("field %s %zu\n", #name, offsetof(struct hs_sampler_control, name))

int main(int argc, char **argv)
{
    if (argc < 3)
        return 2;
    F(magic); F(version); F(request_seq); F(request); F(sample_rate); F(ack_seq); F(result); F(state);
    F(lease_fd); F(lease_ino); F(disarm_reason); F(arm_count); F(slots_patched); F(slots_unwritable);
    F(objects_scanned); F(scans); F(samples); F(sampled_frees); F(set_full); F(realloc_failed_sampled);
    F(control_tid); F(hooks_resolved); F(lazy_skipped);
    F(counts_address); F(counts_used); F(forked_armed); F(max_samples); F(rate_in_force); F(rate_changes);
    printf("forked %d %d\n", HS_FORKED_ARMED, HS_FORKED_CLAIMED);
    printf("size %zu\n", sizeof(struct hs_sampler_control));
#define C(name) printf("count %s %zu\n", #name, offsetof(struct hs_counts, name))
    C(allocs); C(frees); C(alloc_bytes); C(callocs); C(reallocs); C(memaligns); C(posix_memaligns); C(vallocs);
    C(pvallocs); C(realloc_frees); C(tid);
    printf("counts %zu %d\n", sizeof(struct hs_counts), HS_COUNT_SLOTS);
#define FN(name) printf("fn %s %d\n", #name, HS_SAMPLE_##name)
    FN(MALLOC); FN(CALLOC); FN(REALLOC); FN(MEMALIGN); FN(POSIX_MEMALIGN); FN(VALLOC); FN(PVALLOC); FN(REALLOCARRAY);
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_NODELETE);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 3;
    }
    uint64_t (*weight)(uint64_t, uint64_t) = (uint64_t (*)(uint64_t, uint64_t))dlsym(lib, "hs_weight");
    uint64_t (*drawn)(uint64_t, uint64_t) = (uint64_t (*)(uint64_t, uint64_t))dlsym(lib, "hs_drawn_weight");
    uint64_t rate = strtoull(argv[2], NULL, 10);
    for (int i = 3; i < argc; i++) {
        uint64_t size = strtoull(argv[i], NULL, 10);
        printf("weight %llu %llu\n", (unsigned long long)size, (unsigned long long)weight(size, rate));
        printf("drawn %llu %llu\n", (unsigned long long)size, (unsigned long long)drawn(size, rate));
    }
    return 0;
}
