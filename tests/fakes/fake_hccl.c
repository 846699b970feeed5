/*
 * A stand-in for libhccl.so, written for the tests: the same C ABI for the functions
 * comfy/multidevice/comm/hccl.py binds, implemented over host memory. The communicators made
 * by one HcclCommInitAll call share a group; each collective is two rendezvous on that group
 * (publish the call and its buffers, then "everyone has copied"), so rank threads calling
 * concurrently behave like the real library, and CPU tensors can be passed as device buffers.
 *
 * As strict as CANN where it can be on CPU, and never by hanging: at the first rendezvous
 * every rank checks every rank's call, so all ranks of the communicator return the same error
 *   HCCL_E_FAKE_OVERLAP  a rank's call started while another collective was in flight on its
 *                        device (any communicator of the process): "one card cannot invoke
 *                        multiple collective operation APIs at a time" (CANN, HcclCommInitAll)
 *   HCCL_E_FAKE_ORDER    the ranks called different functions, or with other sizes, types,
 *                        roots or ops (every rank must issue the same collectives in order)
 *   HCCL_E_PARA          a rank's own arguments are wrong (a type, its count, the V sizes)
 *
 * Knobs (read on every call):
 *   FAKE_HCCL_FAIL=Name:code   the function Name returns code (on every rank, before any wait)
 *   FAKE_HCCL_TIMEOUT_MS=n     a rendezvous waits at most n ms (default 20000), then returns 9
 * Build with -DFAKE_NO_ALLGATHERV to leave HcclAllGatherV out (older CANN), and with
 * -DFAKE_NO_ALLTOALLV to leave HcclAlltoAllV out. fakeHcclInFlight(device) is the fake's own:
 * how many collectives are in flight on a device now.
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

/* The fake's own codes, outside CANN's HcclResult range so they cannot be mistaken for one. */
enum { HCCL_SUCCESS = 0, HCCL_E_PARA = 1, HCCL_E_NOT_SUPPORT = 5, HCCL_E_TIMEOUT = 9,
       HCCL_E_FAKE_OVERLAP = 1001, HCCL_E_FAKE_ORDER = 1002 };
enum { DT_INT8 = 0, DT_INT16 = 1, DT_INT32 = 2, DT_FP16 = 3, DT_FP32 = 4, DT_INT64 = 5,
       DT_UINT8 = 7, DT_FP64 = 10, DT_BF16 = 11 };
enum { OP_SUM = 0, OP_PROD = 1, OP_MAX = 2, OP_MIN = 3 };
typedef enum { K_ALLGATHERV, K_ALLTOALLV, K_ALLGATHER, K_BROADCAST, K_ALLREDUCE } Kind;

#define MAX_RANKS 64

/* What one rank called: compared across the ranks at the first rendezvous. */
typedef struct {
    Kind kind;
    uint64_t count;           /* elements: sendCount / count (0 for the V calls) */
    int dtype;
    int extra;                /* the root (HcclBroadcast) or the reduce op (HcclAllReduce) */
    const uint64_t *counts;   /* HcclAllGatherV: recvCounts; HcclAlltoAllV: sendCounts */
    const uint64_t *counts2;  /* HcclAlltoAllV: recvCounts */
    HcclResult own_error;     /* found on this rank before the rendezvous */
} Call;

typedef struct {
    int size;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    unsigned long generation;
    Call calls[MAX_RANKS];
    const void *send[MAX_RANKS];
    void *recv[MAX_RANKS];
    const uint64_t *send_displs[MAX_RANKS]; /* HcclAlltoAllV: each rank's send displacements */
    int refs;
} Group;

typedef struct {
    Group *group;
    int rank;
    int device;
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
    case HCCL_E_FAKE_OVERLAP:
        return "two collectives overlap on one device (fake hccl: CANN forbids it, one card cannot "
               "invoke multiple collective operation APIs at a time)";
    case HCCL_E_FAKE_ORDER:
        return "the ranks of one communicator called different collectives or sizes (fake hccl: "
               "every rank must issue the same collectives in the same order)";
    default: return "unknown error (fake hccl)";
    }
}

int fakeHcclInFlight(int device) { return fake_device_in_flight(device); }

HcclResult HcclCommInitAll(uint32_t ndev, int32_t *devices, HcclComm *comms) {
    int code = fail_code("HcclCommInitAll");
    if (code) return code;
    if (ndev == 0 || ndev > MAX_RANKS || !devices || !comms) return HCCL_E_PARA;
    if (fake_check_devices(devices, (int)ndev)) return HCCL_E_PARA;
    Group *g = calloc(1, sizeof(Group));
    g->size = (int)ndev;
    g->refs = (int)ndev;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    for (uint32_t i = 0; i < ndev; i++) {
        Comm *c = calloc(1, sizeof(Comm));
        c->group = g;
        c->rank = (int)i;
        c->device = devices[i];
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

/* ---------------------------------------------------------------- one call, all ranks */

static int same_counts(const uint64_t *a, const uint64_t *b, int n) {
    for (int i = 0; i < n; i++)
        if (a[i] != b[i]) return 0;
    return 1;
}

/* Whether rank k's call agrees with rank 0's (the V calls' size arrays too). */
static int agrees(Group *g, int k) {
    const Call *a = &g->calls[0], *b = &g->calls[k];
    if (a->kind != b->kind || a->count != b->count || a->dtype != b->dtype || a->extra != b->extra)
        return 0;
    if (a->kind == K_ALLGATHERV) return same_counts(a->counts, b->counts, g->size);
    if (a->kind == K_ALLTOALLV) /* what k sends to j is what j expects from k */
        for (int j = 0; j < g->size; j++)
            if (b->counts[j] != g->calls[j].counts2[k]) return 0;
    return 1;
}

/* The verdict of the first rendezvous, computed alike on every rank from what all published. */
static HcclResult verdict(Group *g) {
    for (int k = 0; k < g->size; k++)
        if (g->calls[k].own_error == HCCL_E_FAKE_OVERLAP) return HCCL_E_FAKE_OVERLAP;
    for (int k = 0; k < g->size; k++)
        if (g->calls[k].kind != g->calls[0].kind) return HCCL_E_FAKE_ORDER;
    for (int k = 0; k < g->size; k++)
        if (g->calls[k].own_error) return g->calls[k].own_error;
    for (int k = 0; k < g->size; k++)
        if (!agrees(g, k)) return g->calls[0].kind == K_ALLTOALLV ? HCCL_E_PARA : HCCL_E_FAKE_ORDER;
    return HCCL_SUCCESS;
}

/* Start rank c's call on its device and meet the other ranks. HCCL_SUCCESS: copy, then
 * finish(). Otherwise the result of the call, after finish(): the same error on every rank,
 * or a timeout of this rank alone. */
static HcclResult meet(Comm *c, Call call, const void *send, void *recv) {
    Group *g = c->group;
    if (fake_device_enter(c->device)) call.own_error = HCCL_E_FAKE_OVERLAP;
    g->calls[c->rank] = call;
    g->send[c->rank] = send;
    g->recv[c->rank] = recv;
    HcclResult r = rendezvous(g);
    return r ? r : verdict(g);
}

/* The second rendezvous (nobody reads a peer's buffers after it); the call leaves its device. */
static HcclResult finish(Comm *c, HcclResult result) {
    if (result != HCCL_E_TIMEOUT) { /* after a timeout the others are not in step */
        HcclResult r = rendezvous(c->group);
        if (!result) result = r;
    }
    fake_device_leave(c->device);
    return result;
}

/* ---------------------------------------------------------------- collectives */

#ifndef FAKE_NO_ALLGATHERV
HcclResult HcclAllGatherV(void *sendBuf, uint64_t sendCount, void *recvBuf, const void *recvCounts,
                          const void *recvDispls, int dataType, HcclComm comm, aclrtStream stream) {
    (void)stream;
    int code = fail_code("HcclAllGatherV");
    if (code) return code;
    Comm *c = comm;
    Group *g = c->group;
    size_t es = dtype_size(dataType);
    const uint64_t *counts = recvCounts, *displs = recvDispls;
    Call call = {K_ALLGATHERV, 0, dataType, 0, counts, NULL,
                 !es || counts[c->rank] != sendCount ? HCCL_E_PARA : HCCL_SUCCESS};
    HcclResult r = meet(c, call, sendBuf, recvBuf);
    if (!r)
        for (int i = 0; i < g->size; i++)
            memcpy((char *)recvBuf + displs[i] * es, g->send[i], counts[i] * es);
    return finish(c, r);
}
#endif

#ifndef FAKE_NO_ALLTOALLV
/* Counts and displacements are host uint64 arrays, in elements, as in CANN's hccl.h. When what
 * a rank sends another disagrees with what that one expects to receive, every rank returns
 * HCCL_E_PARA (and nobody waits). */
HcclResult HcclAlltoAllV(const void *sendBuf, const void *sendCounts, const void *sdispls, int sendType,
                         const void *recvBuf, const void *recvCounts, const void *rdispls, int recvType,
                         HcclComm comm, aclrtStream stream) {
    (void)stream;
    int code = fail_code("HcclAlltoAllV");
    if (code) return code;
    Comm *c = comm;
    Group *g = c->group;
    size_t es = dtype_size(sendType);
    g->send_displs[c->rank] = sdispls;
    Call call = {K_ALLTOALLV, 0, sendType, 0, sendCounts, recvCounts,
                 !es || sendType != recvType ? HCCL_E_PARA : HCCL_SUCCESS};
    HcclResult r = meet(c, call, sendBuf, (void *)recvBuf);
    if (!r) {
        const uint64_t *rdisp = rdispls;
        for (int i = 0; i < g->size; i++) {
            uint64_t n = g->calls[i].counts[c->rank];
            memcpy((char *)recvBuf + rdisp[i] * es,
                   (const char *)g->send[i] + g->send_displs[i][c->rank] * es, n * es);
        }
    }
    return finish(c, r);
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
    Call call = {K_ALLGATHER, sendCount, dataType, 0, NULL, NULL, es ? HCCL_SUCCESS : HCCL_E_PARA};
    HcclResult r = meet(c, call, sendBuf, recvBuf);
    if (!r)
        for (int i = 0; i < g->size; i++)
            memcpy((char *)recvBuf + (size_t)i * sendCount * es, g->send[i], sendCount * es);
    return finish(c, r);
}

HcclResult HcclBroadcast(void *buf, uint64_t count, int dataType, uint32_t root, HcclComm comm,
                         aclrtStream stream) {
    (void)stream;
    int code = fail_code("HcclBroadcast");
    if (code) return code;
    Comm *c = comm;
    Group *g = c->group;
    size_t es = dtype_size(dataType);
    Call call = {K_BROADCAST, count, dataType, (int)root, NULL, NULL,
                 !es || (int)root >= g->size ? HCCL_E_PARA : HCCL_SUCCESS};
    HcclResult r = meet(c, call, buf, buf);
    if (!r && c->rank != (int)root) memcpy(buf, g->recv[root], count * es);
    return finish(c, r);
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
    Comm *c = comm;
    Group *g = c->group;
    HcclResult own = HCCL_SUCCESS;
    if (dataType != DT_FP32 && dataType != DT_FP16 && dataType != DT_BF16 && dataType != DT_INT32)
        own = HCCL_E_NOT_SUPPORT;
    else if (op < OP_SUM || op > OP_MIN)
        own = HCCL_E_PARA;
    Call call = {K_ALLREDUCE, count, dataType, op, NULL, NULL, own};
    HcclResult r = meet(c, call, sendBuf, recvBuf);
    if (r) return finish(c, r);
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
    return finish(c, r);
}
