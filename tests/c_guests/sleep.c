/* Sleeps through wasi-libc (nanosleep, then usleep), then sends "slept N ms" measured on the
 * monotonic clock, or "failed E" with the errno. */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include "symphony.h"

static long long now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int main(void) {
    char line[64];
    long long start = now_ms();
    struct timespec nap = {0, 150 * 1000 * 1000};
    if (nanosleep(&nap, NULL) != 0 || usleep(150 * 1000) != 0) {
        int len = snprintf(line, sizeof line, "failed %d", errno);
        sym_send(line, len);
        return 1;
    }
    int len = snprintf(line, sizeof line, "slept %lld ms", now_ms() - start);
    sym_send(line, len);
    return 0;
}
