/* Keeps a vCPU from halting without taking it from anyone: run under
 * SCHED_IDLE (`chrt --idle 0`), it gets the CPU only when nothing else
 * wants it, so the guest never halts the vCPU (issue 34: what the
 * halts cost, perf/2026-12-05-first-token-floor). */
int main(void) {
    volatile unsigned long x = 0;
    for (;;) x++;
}
