/* The clock and the sort order the C probes of scripts/bench share. */
#ifndef PROBE_CLOCK_H
#define PROBE_CLOCK_H
#include <stdint.h>
#include <time.h>

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

/* qsort order of uint64_t. */
static int cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}
#endif
