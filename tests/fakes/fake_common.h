/*
 * What the fake collective libraries (fake_hccl.c, fake_nccl.c) share: error injection
 * from an environment variable, a timed rendezvous of the ranks of one communicator
 * group, the per-device count of collectives in flight (across every communicator of the
 * process), a log of rule violations, bf16 <-> float conversion and the element-wise reduce
 * ops. Header-only (static functions, so each library keeps its own state) so each fake
 * still builds from its one .c file; tests/fakes/build.py hashes this file too.
 */
#ifndef FAKE_COMMON_H
#define FAKE_COMMON_H

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
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

/* ---------------------------------------------------------------- one collective per device
 * HCCL: "one card cannot invoke multiple collective operation APIs at a time"; NCCL: it is not
 * safe to issue operations in parallel to independent communicators of one device from
 * several threads. So every communicator remembers its device (from the init-all call), and
 * a collective is in flight on that device from its entry to its return (the fakes are
 * host-synchronous), whichever communicator of the process it runs on. */
#define FAKE_MAX_DEVICES 64

static pthread_mutex_t fake_devices_mu = PTHREAD_MUTEX_INITIALIZER;
static int fake_in_flight[FAKE_MAX_DEVICES];

/* 0 when an init-all call's device ids are usable: each in [0, FAKE_MAX_DEVICES), none twice
 * (two communicators of one group on one device would always overlap). */
static int fake_check_devices(const int32_t *devices, int n) {
    for (int i = 0; i < n; i++) {
        if (devices[i] < 0 || devices[i] >= FAKE_MAX_DEVICES) return 1;
        for (int j = 0; j < i; j++)
            if (devices[j] == devices[i]) return 1;
    }
    return 0;
}

/* A collective starts on `device`: how many others were in flight there already (> 0: overlap).
 * FAKE_IN_FLIGHT_HOLD_MS keeps each call in flight that long, as a slow link would: a test that
 * shows an overlap being caught then does not depend on how the threads happen to be scheduled. */
static int fake_device_enter(int device) {
    pthread_mutex_lock(&fake_devices_mu);
    int before = fake_in_flight[device]++;
    pthread_mutex_unlock(&fake_devices_mu);
    const char *hold = getenv("FAKE_IN_FLIGHT_HOLD_MS");
    if (hold && atoi(hold) > 0) {
        struct timespec t = {atoi(hold) / 1000, (long)(atoi(hold) % 1000) * 1000000L};
        nanosleep(&t, NULL);
    }
    return before;
}

static void fake_device_leave(int device) {
    pthread_mutex_lock(&fake_devices_mu);
    --fake_in_flight[device];
    pthread_mutex_unlock(&fake_devices_mu);
}

/* How many collectives are in flight on `device` now (tests use it to line up an overlap). */
static int fake_device_in_flight(int device) {
    if (device < 0 || device >= FAKE_MAX_DEVICES) return -1;
    pthread_mutex_lock(&fake_devices_mu);
    int n = fake_in_flight[device];
    pthread_mutex_unlock(&fake_devices_mu);
    return n;
}

/* ---------------------------------------------------------------- violations
 * Where the real library would not return an error (NCCL hangs or corrupts data), the fake
 * completes the call and records what was wrong; a test reads (and clears) the record. */
#define FAKE_MAX_VIOLATIONS 16
#define FAKE_VIOLATION_LEN 240

static pthread_mutex_t fake_violations_mu = PTHREAD_MUTEX_INITIALIZER;
static char fake_violations[FAKE_MAX_VIOLATIONS][FAKE_VIOLATION_LEN];
static int fake_violation_count; /* since the last take; only the first FAKE_MAX_VIOLATIONS are kept */

__attribute__((unused)) static void fake_record_violation(const char *format, ...) {
    pthread_mutex_lock(&fake_violations_mu);
    if (fake_violation_count < FAKE_MAX_VIOLATIONS) {
        va_list args;
        va_start(args, format);
        vsnprintf(fake_violations[fake_violation_count], FAKE_VIOLATION_LEN, format, args);
        va_end(args);
    }
    fake_violation_count++;
    pthread_mutex_unlock(&fake_violations_mu);
}

/* The number of violations recorded since the last take, their texts (one a line, cut to
 * `len` bytes with the terminating NUL) in `buf` when it is not NULL; the record is cleared. */
__attribute__((unused)) static int fake_take_violations(char *buf, int len) {
    pthread_mutex_lock(&fake_violations_mu);
    int n = fake_violation_count;
    if (buf && len > 0) {
        int at = 0;
        buf[0] = 0;
        for (int i = 0; i < n && i < FAKE_MAX_VIOLATIONS && at < len - 1; i++)
            at += snprintf(buf + at, (size_t)(len - at), "%s\n", fake_violations[i]);
    }
    fake_violation_count = 0;
    pthread_mutex_unlock(&fake_violations_mu);
    return n;
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
