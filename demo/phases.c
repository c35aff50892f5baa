/*
 * phases: a heap that changes shape over about ten seconds, for `make demo`.
 *
 *   ticks   0- 59  grow        records (malloc x2 per record) and a string table (realloc + malloc)
 *   ticks  60- 99  plateau     records replaced one for one: same bytes, many calls
 *   ticks 100-119  free half   every other record is freed
 *   ticks 120-179  grow again  index blocks (calloc, three levels of calls) and more records
 *   ticks 180-199  hold        nothing changes; then everything is freed and the program exits
 *
 * Usage: phases [SECONDS]   (default 10; the 200 ticks are spread over that time)
 *
 * No stdio: Valgrind runs __libc_freeres at exit, and stdio buffers would add
 * allocations that have nothing to do with the phases.
 * Built with -O1 -fno-omit-frame-pointer; noinline keeps the call levels visible in the trees.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define NOINLINE __attribute__((noinline))

enum { TICKS = 200, GROW_END = 60, PLATEAU_END = 100, HALF_END = 120, REGROW_END = 180 };
enum { RECORDS_PER_TICK = 100, RECORD_PAYLOAD = 2000, STRINGS_PER_TICK = 50, STRING_LEN = 500 };
enum { BLOCKS_PER_TICK = 40, BLOCK_SIZE = 4096, MAX_RECORDS = 16384, MAX_BLOCKS = 4096 };

struct record {
    size_t len;
    char *payload;
};

static struct record *records[MAX_RECORDS];
static int n_records;

static char **strings; /* the table itself grows with realloc */
static size_t n_strings, cap_strings;

static void *blocks[MAX_BLOCKS];
static int n_blocks;

/* --- records: make_record -> alloc_payload -> malloc ------------------------------------ */

static NOINLINE char *alloc_payload(size_t len)
{
    char *p = malloc(len);
    memset(p, 'r', len);
    return p;
}

static NOINLINE struct record *make_record(size_t len)
{
    struct record *r = malloc(sizeof *r);
    r->len = len;
    r->payload = alloc_payload(len);
    return r;
}

static NOINLINE void free_record(struct record *r)
{
    if (r) {
        free(r->payload);
        free(r);
    }
}

static NOINLINE void load_records(int count, size_t len)
{
    for (int i = 0; i < count && n_records < MAX_RECORDS; i++)
        records[n_records++] = make_record(len);
}

/* --- string table: intern_string -> grow_table (realloc) and copy_string (malloc) -------- */

static NOINLINE void grow_table(void)
{
    cap_strings = cap_strings ? cap_strings * 2 : 64;
    strings = realloc(strings, cap_strings * sizeof *strings);
}

static NOINLINE char *copy_string(size_t len)
{
    char *s = malloc(len + 1);
    memset(s, 's', len);
    s[len] = '\0';
    return s;
}

static NOINLINE void intern_string(size_t len)
{
    if (n_strings == cap_strings)
        grow_table();
    strings[n_strings++] = copy_string(len);
}

/* --- index: build_index -> add_level -> alloc_block (calloc) ------------------------------ */

static NOINLINE void *alloc_block(size_t size)
{
    return calloc(1, size);
}

static NOINLINE void add_level(int count)
{
    for (int i = 0; i < count && n_blocks < MAX_BLOCKS; i++)
        blocks[n_blocks++] = alloc_block(BLOCK_SIZE);
}

static NOINLINE void build_index(int count)
{
    add_level(count / 2);
    add_level(count - count / 2);
}

/* --- phases ------------------------------------------------------------------------------ */

static NOINLINE void phase_grow(void)
{
    load_records(RECORDS_PER_TICK, RECORD_PAYLOAD);
    for (int i = 0; i < STRINGS_PER_TICK; i++)
        intern_string(STRING_LEN);
}

static NOINLINE void phase_plateau(int tick)
{
    /* Replace a rolling window of records with records of the same size: the total stays flat. */
    int start = (tick - GROW_END) * RECORDS_PER_TICK % n_records;
    for (int i = 0; i < RECORDS_PER_TICK; i++) {
        int k = (start + i) % n_records;
        free_record(records[k]);
        records[k] = make_record(RECORD_PAYLOAD);
    }
}

static NOINLINE void phase_free_half(int tick)
{
    /* Over the phase's ticks, free every record with an odd index. */
    int per_tick = (n_records + (HALF_END - PLATEAU_END) - 1) / (HALF_END - PLATEAU_END);
    int from = (tick - PLATEAU_END) * per_tick;
    for (int k = from; k < from + per_tick && k < n_records; k++) {
        if (k % 2 == 1) {
            free_record(records[k]);
            records[k] = NULL;
        }
    }
}

static NOINLINE void phase_regrow(void)
{
    build_index(BLOCKS_PER_TICK);
    load_records(RECORDS_PER_TICK / 4, RECORD_PAYLOAD);
}

static NOINLINE void free_everything(void)
{
    for (int k = 0; k < n_records; k++)
        free_record(records[k]);
    for (size_t i = 0; i < n_strings; i++)
        free(strings[i]);
    free(strings);
    for (int i = 0; i < n_blocks; i++)
        free(blocks[i]);
}

static void sleep_ns(long ns)
{
    struct timespec ts = { ns / 1000000000L, ns % 1000000000L };
    while (nanosleep(&ts, &ts) != 0)
        ;
}

int main(int argc, char **argv)
{
    double seconds = argc > 1 ? atof(argv[1]) : 10.0;
    if (seconds <= 0)
        seconds = 10.0;
    long tick_ns = (long)(seconds * 1e9 / TICKS);

    for (int tick = 0; tick < TICKS; tick++) {
        if (tick < GROW_END)
            phase_grow();
        else if (tick < PLATEAU_END)
            phase_plateau(tick);
        else if (tick < HALF_END)
            phase_free_half(tick);
        else if (tick < REGROW_END)
            phase_regrow();
        sleep_ns(tick_ns);
    }
    free_everything();
    return 0;
}
