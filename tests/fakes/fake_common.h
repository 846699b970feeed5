/*
 * What the fake collective libraries (fake_hccl.c, fake_nccl.c) share: error injection
 * from an environment variable, a timed rendezvous of the ranks of one communicator
 * group, bf16 <-> float conversion and the element-wise reduce ops. Header-only (static functions) so each fake
 * still builds from its one .c file; tests/fakes/build.py hashes this file too.
 */
#ifndef FAKE_COMMON_H
#define FAKE_COMMON_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* `env` holds "Name:code": the function Name returns code. 0 when it names another function. */
static int fake_fail_code(const char *env, const char *name) {
    const char *spec = getenv(env);
    if (!spec) return 0;
    size_t n = strlen(name);
    if (strncmp(spec, name, n) == 0 && spec[n] == ':') return atoi(spec + n + 1);
    return 0;
}

/* Wait until `size` threads have arrived (a reusable barrier). Returns 0, or 1 when the
 * others did not all come within the milliseconds in `timeout_env` (default 20000). */
static int fake_wait_all(pthread_mutex_t *mu, pthread_cond_t *cv, int size, int *arrived,
                         unsigned long *generation, const char *timeout_env) {
    const char *v = getenv(timeout_env);
    long ms = v ? atol(v) : 20000;
    struct timespec deadline;
    clock_gettime(CLOCK_REALTIME, &deadline);
    deadline.tv_sec += ms / 1000;
    deadline.tv_nsec += (ms % 1000) * 1000000L;
    if (deadline.tv_nsec >= 1000000000L) { deadline.tv_sec += 1; deadline.tv_nsec -= 1000000000L; }

    pthread_mutex_lock(mu);
    unsigned long gen = *generation;
    if (++*arrived == size) {
        *arrived = 0;
        ++*generation;
        pthread_cond_broadcast(cv);
        pthread_mutex_unlock(mu);
        return 0;
    }
    while (gen == *generation) {
        if (pthread_cond_timedwait(cv, mu, &deadline) == ETIMEDOUT && gen == *generation) {
            --*arrived;
            pthread_mutex_unlock(mu);
            return 1;
        }
    }
    pthread_mutex_unlock(mu);
    return 0;
}

/* Drop one communicator's reference to its group; 1 (and the lock and condition destroyed)
 * when it was the last one, so the caller frees the group. */
static int fake_release_group(pthread_mutex_t *mu, pthread_cond_t *cv, int *refs) {
    pthread_mutex_lock(mu);
    int last = --*refs == 0;
    pthread_mutex_unlock(mu);
    if (last) {
        pthread_mutex_destroy(mu);
        pthread_cond_destroy(cv);
    }
    return last;
}

static float bf16_to_float(uint16_t v) {
    uint32_t bits = (uint32_t)v << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t float_to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40); /* NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(bits >> 16);
}

/* a (op) b for the reduce ops both libraries number alike: 0 sum, 1 prod, 2 max, 3 min.
 * A macro so that each type computes in its own arithmetic (fp32 sums stay fp32). */
#define FAKE_COMBINE(a, b, op) \
    ((op) == 0 ? (a) + (b) : (op) == 1 ? (a) * (b) : (op) == 2 ? ((a) > (b) ? (a) : (b)) : ((a) < (b) ? (a) : (b)))

#endif
