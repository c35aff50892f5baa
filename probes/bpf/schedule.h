/* schedule.h: Massif's snapshots in the kernel: the --time-unit=B clock, the peak, the snapshot schedule's
 * points (sched_points) and the snapshot log of the sites' values at each point (snap_log). */

/* sched_points: struct hs_sched_point, the snapshot schedule's points in time order; drained by user space */
BPF_RINGBUF_OUTPUT(sched_points, HS_SCHED_RING_PAGES);
BPF_ARRAY_OF_MAPS(sched_points_of, "sched_points", HS_TARGETS);
/* snap_log: struct hs_snap_record, a site's value before its first change after a point (site_touch); drained
 * by user space, which rebuilds the tree at each detailed point from it */
BPF_RINGBUF_OUTPUT(snap_log, HS_SNAP_RING_PAGES);
BPF_ARRAY_OF_MAPS(snap_log_of, "snap_log", HS_TARGETS);

/* The snapshot log's record of site `id` (struct hs_snap_record), submitted before the change it precedes: user
 * space reads the sites first and the log after, so every change its read saw has its record in the ring. The
 * record that fills the ring to half (and to three quarters) wakes user space, as page_exit does. */
static __always_inline void snap_log_site(void *ctx, struct hs_global *g, struct hs_site *s, u64 id, u64 epoch)
{
    struct hs_snap_record *r = t_reserve(snap_log_of.lookup(&g->slot), sizeof(struct hs_snap_record));
    if (!r) {
        __sync_fetch_and_add(&g->snap_lost, 1);
        return;
    }
    r->site = id;
    r->epoch = epoch;
    r->bytes = HS_ONCE(s->cur_bytes);
    r->extra = HS_ONCE(s->cur_extra);
    r->allocs = HS_ONCE(s->tot_blocks);
    bpf_ringbuf_submit(r, BPF_RB_NO_WAKEUP);
    u64 sent = __sync_fetch_and_add(&g->snap_records, 1) + 1;
    u64 *drained = control_ptr(g, HS_CTL_SNAP_DRAINED);
    u64 held = sent - (drained ? HS_ONCE(*drained) : 0);
    u64 room = (u64)HS_SNAP_RING_PAGES * 4096 / ((sizeof(struct hs_snap_record) + 8 + 7) & ~7ULL);
    if (held == room / 2 || held == room / 2 + room / 4) {
        send_event(ctx, g, HS_EV_SNAP_LOG);
    }
}

/* Before the live bytes of site `id` change: keep its value at the last peak (a lazy copy, so the exact peak's
 * tree needs no copy of every site at the peak); and at its first change after a schedule point, log its value
 * (snap_log_site), so the tree at every point can be rebuilt, each detailed snapshot's at its own instant
 * (docs/usage.md: "Snapshots: Massif's schedule"). One compare each when the site was touched since. */
static __always_inline void site_touch(void *ctx, struct hs_site *s, u64 id, struct hs_global *g)
{
    u64 gen = g->peak_gen;
    if (s->peak_gen != gen) {
        s->peak_bytes = s->cur_bytes;
        s->peak_extra = s->cur_extra;
        s->peak_gen = gen;
    }
    u64 epoch = HS_ONCE(g->sched_points);
    if (s->snap_epoch != epoch) {
        s->snap_epoch = epoch;
        snap_log_site(ctx, g, s, id, epoch);
    }
}

/* Massif's --time-unit=B clock moves by the change in heap + extra, whichever way. Returns the time after this
 * event's change (the atomic add hands back the time before it at no extra cost). */
static __always_inline u64 advance_time(struct hs_global *g, s64 delta)
{
    u64 step = delta < 0 ? -delta : delta;
    return __sync_fetch_and_add(&g->time_b, step) + step;
}

/* The time of a point in the snapshots' unit (B, or whole ms since HS_CTL_SCHED_ORIGIN), and the due time
 * `interval` of that unit after it (ms: the start of that millisecond, as Massif compares whole milliseconds). */
static __always_inline u64 schedule_next(struct hs_global *g, u64 t, u64 interval, u64 *unit_time)
{
    if (!HS_SCHED_NS) {
        *unit_time = t;
        return t + interval;
    }
    u64 origin = control_word(g, HS_CTL_SCHED_ORIGIN);
    *unit_time = (t > origin ? t - origin : 0) / 1000000;
    return origin + (*unit_time + interval) * 1000000;
}

static __always_inline void send_point(struct hs_global *g, u64 t, u64 heap, u64 extra, u64 kind)
{
    struct hs_sched_point *p = t_reserve(sched_points_of.lookup(&g->slot), sizeof(struct hs_sched_point));
    if (!p) {
        __sync_fetch_and_add(&g->sched_lost, 1);
        return;
    }
    p->time = t;
    p->heap = heap;
    p->extra = extra;
    p->kind = kind;
    /* Numbered before it is submitted: a site changed from here on logs its value at this point (site_touch). */
    p->epoch = __sync_fetch_and_add(&g->sched_points, 1);
    bpf_ringbuf_submit(p, BPF_RB_NO_WAKEUP);
}

/* (Inlined, as every function here: bcc loads each program alone, without BPF-to-BPF calls.)
 * The interval for the due time after a point. User space owns it (it culls the series) and sets the due time
 * from the series when it has read the points. When the series culls (the point count reached
 * HS_CTL_SCHED_CULL_AT) user space is woken once (schedule_signal). Until it answers, the interval is guessed
 * as the time so far divided by --max-snapshots (about half the spacing a culling leaves), which keeps the
 * points bounded however long user space takes. */
static __always_inline u64 schedule_interval(struct hs_global *g, u64 unit_time)
{
    u64 interval = control_word(g, HS_CTL_SCHED_INTERVAL);
    u64 cull_at = control_word(g, HS_CTL_SCHED_CULL_AT);
    if (!cull_at || HS_ONCE(g->sched_points) + 1 < cull_at)
        return interval;
    u64 max = control_word(g, HS_CTL_SCHED_MAX);
    u64 guess = max ? unit_time / max : 0;
    /* ms: at least one; an interval of 0 (snapshots in the same millisecond, which Massif's culling keeps while
     * Valgrind runs slowly enough to make few of them) would send every event of a native run meanwhile */
    if (HS_SCHED_NS && guess == 0)
        guess = 1;
    return guess > interval ? guess : interval;
}

/* Sampled mode's points past the cull before the wake-up: HS_SCHED_SAMPLED_SLACK, or HS_SCHED_WAKE_PENDING less
 * --max-snapshots when that is fewer (256 up to --max-snapshots=744, none at 1,000). */
static __always_inline u64 sampled_slack(struct hs_global *g)
{
    u64 max = control_word(g, HS_CTL_SCHED_MAX);
    u64 room = max < HS_SCHED_WAKE_PENDING ? HS_SCHED_WAKE_PENDING - max : 0;
    return room < HS_SCHED_SAMPLED_SLACK ? room : HS_SCHED_SAMPLED_SLACK;
}

/* After a point was sent (never before: user space, woken on the other CPU, must find the point that made the
 * series cull in the ring when it drains it): when the point count reached HS_CTL_SCHED_CULL_AT, wake user
 * space once; with HS_STOP_EVENTS and time in B (time stands still while the target does) also stop the target
 * until user space has set the new interval and due time, so the points are exactly Massif's. Sampled mode never
 * stops a target (its points are estimates anyway, and production mode does not stop one), and wakes user space
 * only HS_SCHED_SAMPLED_SLACK points past the cull: its next look (a second away at most) drains and culls, the
 * guessed interval bridging the wait. A new worker's series culls some ten times in its first seconds; each
 * wake-up was a drain of its own. */
static __always_inline void schedule_signal(void *ctx, struct hs_global *g)
{
    u64 cull_at = control_word(g, HS_CTL_SCHED_CULL_AT);
    u64 wake_at = cull_at + (HS_SAMPLED ? sampled_slack(g) : 0);
    if (!cull_at || HS_ONCE(g->sched_points) < wake_at || HS_ONCE(g->sched_signalled) == cull_at)
        return;
    g->sched_signalled = cull_at;
    __sync_fetch_and_add(&g->sched_wakes, 1);
    if (HS_STOP_EVENTS && !HS_SCHED_NS && !HS_SAMPLED) {
        set_control(g, HS_CTL_STOPPED, HS_EV_SCHEDULE);
        bpf_send_signal(19 /* SIGSTOP */);
    }
    send_event(ctx, g, HS_EV_SCHEDULE);
}

/* HS_SCHED_NS: the clock costs ~50 ns a read here, jiffies (the tick count) a load. After setting the due
 * time `next` at `t`, say until which jiffy no event can reach it: jiffies move on once a jiffy, so while fewer
 * than the whole jiffies to `next`, less one, have passed, `next` is still ahead. */
static __always_inline void schedule_jiffies(struct hs_global *g, u64 t, u64 next)
{
    u64 jiffy_ns = control_word(g, HS_CTL_SCHED_JIFFY_NS);
    u64 *word = control_ptr(g, HS_CTL_SCHED_DUE_JIFFIES);
    if (!HS_SCHED_NS || !word)
        return;
    u64 ahead = jiffy_ns && next > t ? (next - t) / jiffy_ns : 0;
    HS_ONCE(*word) = ahead > 1 ? bpf_jiffies64() + ahead - 1 : 0;
}

/* The event at time t reached the due time: a point with the totals after it, and the next due time as
 * Massif's maybe_take_snapshot sets it (this one's time plus the minimum interval). */
static __always_inline void schedule_point(void *ctx, struct hs_global *g, u64 t, u64 *due_word, u64 due)
{
    u64 unit_time;
    schedule_next(g, t, 0, &unit_time);
    u64 next = schedule_next(g, t, schedule_interval(g, unit_time), &unit_time);
    if (__sync_val_compare_and_swap(due_word, due, next) != due)
        return; /* another CPU's event took this point, or user space has just set the due time */
    schedule_jiffies(g, t, next);
    send_point(g, t, HS_ONCE(g->heap), HS_ONCE(g->extra), HS_SCHED_NORMAL);
    schedule_signal(ctx, g);
}

/* After an event's accounting: one compare, unless the event reached the schedule's due time. `time_b` is the
 * event's B time; `now` its bpf_ktime_get_ns when the caller has read it, else 0. The due time sits in the
 * control map's first cache line, which is_armed() has just read; in ms, so does the jiffy before which the
 * clock need not be read. */
static __always_inline void schedule_check(void *ctx, struct hs_global *g, u64 time_b, u64 now)
{
    if (HS_SCHED_NS && !now) {
        u64 *due_jiffies = control_ptr(g, HS_CTL_SCHED_DUE_JIFFIES);
        if (due_jiffies && bpf_jiffies64() < HS_ONCE(*due_jiffies))
            return;
    }
    u64 t = HS_SCHED_NS ? (now ? now : bpf_ktime_get_ns()) : time_b;
    u64 *due_word = control_ptr(g, HS_CTL_SCHED_DUE);
    if (!due_word)
        return;
    u64 due = HS_ONCE(*due_word);
    if (t >= due)
        schedule_point(ctx, g, t, due_word, due);
}

/* Before a free, or a realloc that shrinks a block: Massif takes a peak snapshot when the total is above its
 * last peak snapshot's by more than --peak-inaccuracy, whatever the interval, and the next snapshot is due an
 * interval after it. One compare unless so. `now`: as in schedule_check. */
static __always_inline void schedule_peak_check(void *ctx, struct hs_global *g, u64 now)
{
    u64 *level = control_ptr(g, HS_CTL_SCHED_PEAK_LEVEL);
    u64 heap = HS_ONCE(g->heap), extra = HS_ONCE(g->extra);
    u64 total = heap + extra;
    if (!level || total <= HS_ONCE(*level))
        return;
    u64 ppm = control_word(g, HS_CTL_SCHED_PEAK_PPM);
    HS_ONCE(*level) = total + total * ppm / 1000000;
    u64 t = HS_SCHED_NS ? (now ? now : bpf_ktime_get_ns()) : HS_ONCE(g->time_b);
    u64 unit_time;
    schedule_next(g, t, 0, &unit_time);
    u64 next = schedule_next(g, t, schedule_interval(g, unit_time), &unit_time);
    u64 *due_word = control_ptr(g, HS_CTL_SCHED_DUE);
    if (due_word)
        HS_ONCE(*due_word) = next;
    schedule_jiffies(g, t, next);
    send_point(g, t, heap, extra, HS_SCHED_PEAK);
    schedule_signal(ctx, g);
}

/* After the totals grew: a new global peak marks the touched sites with their state at the peak. */
static __always_inline void check_peak(struct hs_global *g, struct hs_site *a, struct hs_site *b)
{
    u64 heap = g->heap, extra = g->extra;
    u64 total = heap + extra;
    if (total <= g->peak_total)
        return;
    g->peak_total = total;
    g->peak_heap = heap;
    g->peak_extra = extra;
    g->peak_time_b = g->time_b;
    g->peak_ns = bpf_ktime_get_ns();
    u64 gen = g->peak_gen + 1;
    g->peak_gen = gen;
    if (a) {
        a->peak_bytes = a->cur_bytes;
        a->peak_extra = a->cur_extra;
        a->peak_gen = gen;
    }
    if (b) {
        b->peak_bytes = b->cur_bytes;
        b->peak_extra = b->cur_extra;
        b->peak_gen = gen;
    }
}
