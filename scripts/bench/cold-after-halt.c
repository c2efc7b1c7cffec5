/* What a sleep costs the caches on this machine (issue 34): the same
 * pointer chase over KB of memory (one load per 64-byte line, in a random
 * order), timed right after the thread slept 14 ms (its vCPU halts, as a
 * router's shard does between requests on the real engine), right after
 * it spun for 14 ms (the vCPU kept running), and back to back (warm).
 * Medians of 150 per mode and size.
 * usage: cold-after-halt KB...
 * build: gcc -O2 -o /tmp/cold-after-halt scripts/bench/cold-after-halt.c */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "probe-clock.h"

/* One pointer per 64-byte line, linked in a random cycle. */
static void **build(size_t lines) {
    void **b = aligned_alloc(64, lines * 64);
    size_t *perm = malloc(lines * sizeof *perm);
    if (!b || !perm) exit(1);
    for (size_t i = 0; i < lines; i++) perm[i] = i;
    srand(7);
    for (size_t i = lines - 1; i > 0; i--) {
        size_t j = (size_t)rand() % (i + 1), t = perm[i];
        perm[i] = perm[j];
        perm[j] = t;
    }
    for (size_t i = 0; i < lines; i++) b[perm[i] * 8] = &b[perm[(i + 1) % lines] * 8];
    free(perm);
    return b;
}

static void *chase(void **p, size_t n) {
    for (size_t i = 0; i < n; i++) p = (void **)*p;
    return p;
}

int main(int argc, char **argv) {
    enum { N = 150 };
    static uint64_t s[3][N];
    void *volatile sink;
    for (int a = 1; a < argc; a++) {
        size_t kb = (size_t)atoi(argv[a]), lines = kb * 1024 / 64;
        if (lines == 0) continue;
        void **b = build(lines);
        for (int mode = 0; mode < 3; mode++) {
            for (int i = 0; i < N; i++) {
                if (mode == 0) {
                    struct timespec ts = {0, 14000000};
                    nanosleep(&ts, 0);
                } else if (mode == 1) {
                    uint64_t end = now_ns() + 14000000;
                    while (now_ns() < end) {}
                } else {
                    sink = chase(b, lines);
                }
                uint64_t t0 = now_ns();
                sink = chase(b, lines);
                s[mode][i] = now_ns() - t0;
            }
            qsort(s[mode], N, sizeof s[mode][0], cmp);
        }
        printf("%6zu KB: after sleep p50 %.1f us, after spin %.1f us, warm %.1f us  (sleep/warm %.2fx)\n", kb,
               s[0][N / 2] / 1e3, s[1][N / 2] / 1e3, s[2][N / 2] / 1e3, (double)s[0][N / 2] / (double)s[2][N / 2]);
        free(b);
    }
    (void)sink;
    return 0;
}
