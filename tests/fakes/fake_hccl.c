/*
 * A stand-in for libhccl.so, written for the tests: the same C ABI for the functions
 * comfy/multinpu.py binds, implemented over host memory. The communicators made by one
 * HcclCommInitAll call share a group; each collective is two rendezvous on that group
 * (publish buffers, then "everyone has copied"), so rank threads calling concurrently
 * behave like the real library, and CPU tensors can be passed as device buffers.
 *
 * Knobs (read on every call):
 *   FAKE_HCCL_FAIL=Name:code   the function Name returns code (on every rank, before any wait)
 *   FAKE_HCCL_TIMEOUT_MS=n     a rendezvous waits at most n ms (default 20000), then returns 9
 * Build with -DFAKE_NO_ALLGATHERV to leave HcclAllGatherV out (older CANN), and with
 * -DFAKE_NO_ALLTOALLV to leave HcclAlltoAllV out.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake_common.h"

typedef int HcclResult;
typedef void *HcclComm;
typedef void *aclrtStream;

enum { HCCL_SUCCESS = 0, HCCL_E_PARA = 1, HCCL_E_NOT_SUPPORT = 5, HCCL_E_TIMEOUT = 9 };
enum { DT_INT8 = 0, DT_INT16 = 1, DT_INT32 = 2, DT_FP16 = 3, DT_FP32 = 4, DT_INT64 = 5,
       DT_UINT8 = 7, DT_FP64 = 10, DT_BF16 = 11 };
enum { OP_SUM = 0, OP_PROD = 1, OP_MAX = 2, OP_MIN = 3 };

#define MAX_RANKS 64

typedef struct {
    int size;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    unsigned long generation;
    const void *send[MAX_RANKS];
    void *recv[MAX_RANKS];
    const uint64_t *send_counts[MAX_RANKS]; /* HcclAlltoAllV: each rank's per-destination sizes */
    const uint64_t *send_displs[MAX_RANKS];
    int refs;
} Group;

typedef struct {
    Group *group;
    int rank;
} Comm;

static int fail_code(const char *name) { return fake_fail_code("FAKE_HCCL_FAIL", name); }

/* Rendezvous of all ranks of the group; HCCL_E_TIMEOUT if some rank never comes. */
static HcclResult rendezvous(Group *g) {
    return fake_wait_all(&g->mu, &g->cv, g->size, &g->arrived, &g->generation, "FAKE_HCCL_TIMEOUT_MS")
               ? HCCL_E_TIMEOUT : HCCL_SUCCESS;
}

static size_t dtype_size(int dt) {
    switch (dt) {
    case DT_INT8: case DT_UINT8: return 1;
    case DT_INT16: case DT_FP16: case DT_BF16: return 2;
    case DT_INT32: case DT_FP32: return 4;
    case DT_INT64: case DT_FP64: return 8;
    default: return 0;
    }
}

const char *HcclGetErrorString(HcclResult code) {
    switch (code) {
    case HCCL_SUCCESS: return "no error";
    case HCCL_E_PARA: return "parameter error (fake hccl)";
    case 4: return "internal error (fake hccl)";
    case HCCL_E_NOT_SUPPORT: return "not supported (fake hccl)";
    case HCCL_E_TIMEOUT: return "timeout waiting for other ranks (fake hccl)";
    default: return "unknown error (fake hccl)";
    }
}

HcclResult HcclCommInitAll(uint32_t ndev, int32_t *devices, HcclComm *comms) {
    int code = fail_code("HcclCommInitAll");
    if (code) return code;
    if (ndev == 0 || ndev > MAX_RANKS || !devices || !comms) return HCCL_E_PARA;
    Group *g = calloc(1, sizeof(Group));
    g->size = (int)ndev;
    g->refs = (int)ndev;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    for (uint32_t i = 0; i < ndev; i++) {
        Comm *c = calloc(1, sizeof(Comm));
        c->group = g;
        c->rank = (int)i;
        comms[i] = c;
    }
    return HCCL_SUCCESS;
}

HcclResult HcclCommDestroy(HcclComm comm) {
    Comm *c = comm;
    if (!c) return HCCL_E_PARA;
    Group *g = c->group;
    free(c);
    if (fake_release_group(&g->mu, &g->cv, &g->refs)) free(g);
    return HCCL_SUCCESS;
}

#ifndef FAKE_NO_ALLGATHERV
HcclResult HcclAllGatherV(void *sendBuf, uint64_t sendCount, void *recvBuf, const void *recvCounts,
                          const void *recvDispls, int dataType, HcclComm comm, aclrtStream stream) {
    (void)stream;
    int code = fail_code("HcclAllGatherV");
    if (code) return code;
    Comm *c = comm;
    Group *g = c->group;
    size_t es = dtype_size(dataType);
    if (!es) return HCCL_E_PARA;
    const uint64_t *counts = recvCounts, *displs = recvDispls;
    if (counts[c->rank] != sendCount) return HCCL_E_PARA;
    g->send[c->rank] = sendBuf;
    HcclResult r = rendezvous(g);
    if (r) return r;
    for (int i = 0; i < g->size; i++)
        memcpy((char *)recvBuf + displs[i] * es, g->send[i], counts[i] * es);
    return rendezvous(g);
}
#endif

#ifndef FAKE_NO_ALLTOALLV
/* Counts and displacements are host uint64 arrays, in elements, as in CANN's hccl.h. A rank
 * whose recvCounts disagree with what the senders send still joins both rendezvous (so no
 * other rank waits for it) and returns HCCL_E_PARA. */
HcclResult HcclAlltoAllV(const void *sendBuf, const void *sendCounts, const void *sdispls, int sendType,
                         const void *recvBuf, const void *recvCounts, const void *rdispls, int recvType,
                         HcclComm comm, aclrtStream stream) {
    (void)stream;
    int code = fail_code("HcclAlltoAllV");
    if (code) return code;
    Comm *c = comm;
    Group *g = c->group;
    size_t es = dtype_size(sendType);
    if (!es || sendType != recvType) return HCCL_E_PARA;
    g->send[c->rank] = sendBuf;
    g->send_counts[c->rank] = sendCounts;
    g->send_displs[c->rank] = sdispls;
    HcclResult r = rendezvous(g);
    if (r) return r;
    const uint64_t *rcounts = recvCounts, *rdisp = rdispls;
    int bad = 0;
    for (int i = 0; i < g->size; i++) {
        uint64_t n = g->send_counts[i][c->rank];
        if (n != rcounts[i]) { bad = 1; continue; }
        memcpy((char *)recvBuf + rdisp[i] * es,
               (const char *)g->send[i] + g->send_displs[i][c->rank] * es, n * es);
    }
    r = rendezvous(g);
    return r ? r : (bad ? HCCL_E_PARA : HCCL_SUCCESS);
}
#endif

HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, int dataType,
                         HcclComm comm, aclrtStream stream) {
    (void)stream;
    int code = fail_code("HcclAllGather");
    if (code) return code;
    Comm *c = comm;
    Group *g = c->group;
    size_t es = dtype_size(dataType);
    if (!es) return HCCL_E_PARA;
    g->send[c->rank] = sendBuf;
    HcclResult r = rendezvous(g);
    if (r) return r;
    for (int i = 0; i < g->size; i++)
        memcpy((char *)recvBuf + (size_t)i * sendCount * es, g->send[i], sendCount * es);
    return rendezvous(g);
}

HcclResult HcclBroadcast(void *buf, uint64_t count, int dataType, uint32_t root, HcclComm comm,
                         aclrtStream stream) {
    (void)stream;
    int code = fail_code("HcclBroadcast");
    if (code) return code;
    Comm *c = comm;
    Group *g = c->group;
    size_t es = dtype_size(dataType);
    if (!es || (int)root >= g->size) return HCCL_E_PARA;
    g->recv[c->rank] = buf;
    HcclResult r = rendezvous(g);
    if (r) return r;
    if (c->rank != (int)root) memcpy(buf, g->recv[root], count * es);
    return rendezvous(g);
}

static float load(const void *p, size_t i, int dt) {
    switch (dt) {
    case DT_FP32: return ((const float *)p)[i];
    case DT_FP16: return (float)((const _Float16 *)p)[i];
    case DT_BF16: return bf16_to_float(((const uint16_t *)p)[i]);
    default: return 0.0f;
    }
}

static void store(void *p, size_t i, int dt, float v) {
    switch (dt) {
    case DT_FP32: ((float *)p)[i] = v; break;
    case DT_FP16: ((_Float16 *)p)[i] = (_Float16)v; break;
    case DT_BF16: ((uint16_t *)p)[i] = float_to_bf16(v); break;
    default: break;
    }
}

/* Every rank reduces all ranks' inputs in rank order: identical results everywhere. */
HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, int dataType, int op,
                         HcclComm comm, aclrtStream stream) {
    (void)stream;
    int code = fail_code("HcclAllReduce");
    if (code) return code;
    if (dataType != DT_FP32 && dataType != DT_FP16 && dataType != DT_BF16 && dataType != DT_INT32)
        return HCCL_E_NOT_SUPPORT;
    if (op < OP_SUM || op > OP_MIN) return HCCL_E_PARA;
    Comm *c = comm;
    Group *g = c->group;
    g->send[c->rank] = sendBuf;
    HcclResult r = rendezvous(g);
    if (r) return r;
    for (uint64_t i = 0; i < count; i++) {
        if (dataType == DT_INT32) {
            int32_t acc = ((const int32_t *)g->send[0])[i];
            for (int k = 1; k < g->size; k++) acc = FAKE_COMBINE(acc, ((const int32_t *)g->send[k])[i], op);
            ((int32_t *)recvBuf)[i] = acc;
        } else {
            float acc = load(g->send[0], i, dataType);
            for (int k = 1; k < g->size; k++) acc = FAKE_COMBINE(acc, load(g->send[k], i, dataType), op);
            store(recvBuf, i, dataType, acc);
        }
    }
    return rendezvous(g);
}
