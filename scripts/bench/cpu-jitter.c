/* How steady this CPU is: the same fixed piece of work (~20 us), timed
 * back to back for a few seconds. On a quiet machine the percentiles are
 * close together; on a contended VM host the same work takes 2-5x longer
 * for tens of milliseconds at a time, and every latency percentile of a
 * benchmark run then measures the host, not the program.
 * usage: cpu-jitter [seconds]   (built and run by scripts/bench/send-lag.py) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "probe-clock.h"

int main(int argc, char **argv) {
    double secs = argc > 1 ? atof(argv[1]) : 3.0;
    size_t cap = 1 << 20, n = 0;
    uint64_t *d = malloc(cap * sizeof *d);
    if (!d) return 1;
    volatile uint64_t x = 0;
    uint64_t end = now_ns() + (uint64_t)(secs * 1e9);
    while (n < cap) {
        uint64_t a = now_ns();
        if (a >= end) break;
        for (int i = 0; i < 20000; i++) x += (uint64_t)i * (uint64_t)i;
        d[n++] = now_ns() - a;
    }
    if (n == 0) return 1;
    qsort(d, n, sizeof *d, cmp);
#define P(q) (d[(size_t)((double)(n - 1) * (q))] / 1000.0)
    printf("cpu-jitter: %zu chunks; chunk time p10 %.1f us, p50 %.1f, p90 %.1f, p99 %.1f, max %.1f; p90/p10 %.2f\n",
           n, P(0.10), P(0.50), P(0.90), P(0.99), P(1.0), P(0.90) / P(0.10));
    return 0;
}
