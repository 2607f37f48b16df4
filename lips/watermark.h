/* watermark.h: the red/green-list watermark of Kirchenbauer et al. (2023), shared by the
 * generator (watermark.c) and the detector (watermark_detect.c). For each previous token, a
 * keyed hash splits the vocabulary into a green fraction GAMMA and a red rest; the generator
 * adds DELTA to the green logits, the detector counts green tokens and reports a z-score. */
#ifndef WATERMARK_H
#define WATERMARK_H

#include <math.h>
#include <stdint.h>

#define WATERMARK_GAMMA 0.5

static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* Is `token` on the green list that follows `prev`, under `key`? */
static inline int is_green(uint64_t key, int32_t prev, int32_t token) {
    uint64_t h = splitmix64(splitmix64(key ^ (uint64_t)(uint32_t)prev) ^ (uint64_t)(uint32_t)token);
    return (double)(h >> 11) / (double)(1ull << 53) < WATERMARK_GAMMA;
}

/* z-score of `green` green tokens among `scored`: (green - gamma T) / sqrt(T gamma (1 - gamma)). */
static inline double watermark_z(int green, int scored) {
    if (scored <= 0) return 0.0;
    return (green - WATERMARK_GAMMA * scored) / sqrt(scored * WATERMARK_GAMMA * (1 - WATERMARK_GAMMA));
}

#endif /* WATERMARK_H */
