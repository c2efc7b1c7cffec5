/* What waking a sleeping process costs on this machine (issue 34): a
 * writer sends its clock over a socket pair every 10 ms to a reader
 * blocked in read(); the reader stamps the return. The difference is one
 * hop's wake-up with no work in it (the floor under each of the four
 * process hops a first token crosses through router and agent).
 * `spin`: the reader polls with MSG_DONTWAIT instead of sleeping (its
 * vCPU never halts). Prints the median and p90 over 300 messages.
 * usage: wakeup [spin]
 * build: gcc -O2 -o /tmp/wakeup scripts/bench/wakeup.c */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "probe-clock.h"

int main(int argc, char **argv) {
    enum { N = 300 };
    int spin = argc > 1 && strcmp(argv[1], "spin") == 0;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) return 1;
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid == 0) {
        close(sv[1]);
        for (int i = 0; i < N + 10; i++) {
            struct timespec ts = {0, 10000000};
            nanosleep(&ts, 0);
            uint64_t t = now_ns();
            if (write(sv[0], &t, sizeof t) != sizeof t) _exit(1);
        }
        _exit(0);
    }
    close(sv[0]);
    static uint64_t d[N + 10];
    int n = 0;
    while (n < N + 10) {
        uint64_t t;
        ssize_t r = recv(sv[1], &t, sizeof t, spin ? MSG_DONTWAIT : 0);
        if (r == sizeof t) {
            d[n++] = now_ns() - t;
        } else if (r == 0 || (r < 0 && !spin)) {
            break;
        }
    }
    waitpid(pid, 0, 0);
    if (n <= 10) return 1;
    /* The first ten are the start-up's. */
    qsort(d + 10, (size_t)(n - 10), sizeof d[0], cmp);
    int m = n - 10;
    printf("wakeup%s: %d messages, p50 %.1f us, p90 %.1f us\n", spin ? " (reader spinning)" : "", m,
           d[10 + m / 2] / 1e3, d[10 + m * 9 / 10] / 1e3);
    return 0;
}
