/* Reads float32 arrays from recv (one per message) and sends back sym_argmax of each as text. */
#include <stdio.h>
#include "symphony.h"

static float values[1 << 16];

int main(void) {
    char line[32];
    for (;;) {
        int n = sym_recv((char *)values, sizeof values);
        if (n < 0) return 0;
        int len = snprintf(line, sizeof line, "%d\n", (int)sym_argmax(values, n / 4));
        sym_send(line, len);
    }
}
