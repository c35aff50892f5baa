/* Prints the sampler's control-block layout and its weights, from the header and the library themselves.
 *
 *   sampler_layout LIBRARY RATE SIZE...
 *
 * "field OFFSET" per field, "size N", then "weight SIZE W" per size (hs_weight from the library). */
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
    F(counts_address); F(counts_used);
    printf("size %zu\n", sizeof(struct hs_sampler_control));
    printf("counts %zu %zu %zu %zu %d\n", offsetof(struct hs_counts, allocs), offsetof(struct hs_counts, frees),
           offsetof(struct hs_counts, alloc_bytes), sizeof(struct hs_counts), HS_COUNT_SLOTS);
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_NODELETE);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 3;
    }
    uint64_t (*weight)(uint64_t, uint64_t) = (uint64_t (*)(uint64_t, uint64_t))dlsym(lib, "hs_weight");
    uint64_t rate = strtoull(argv[2], NULL, 10);
    for (int i = 3; i < argc; i++) {
        uint64_t size = strtoull(argv[i], NULL, 10);
        printf("weight %llu %llu\n", (unsigned long long)size, (unsigned long long)weight(size, rate));
    }
    return 0;
}
