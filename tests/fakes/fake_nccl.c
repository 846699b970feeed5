/*
 * A stand-in for libnccl.so.2, written for the tests: the C ABI of the functions
 * comfy/multidevice/comm/nccl.py binds, implemented over host memory so CPU tensors can be passed
 * as device buffers.
 *
 * The communicators made by one ncclCommInitAll call share a group. Every collective
 * call is an "operation"; outside ncclGroupStart/ncclGroupEnd it runs at once, inside a
 * group it is only recorded (per thread, like NCCL) and the whole batch runs at the
 * outermost ncclGroupEnd. Running a batch: each rank publishes its list of operations,
 * one rendezvous, every rank checks that all lists match (same kinds, counts, types,
 * roots, in the same order, as NCCL requires) and performs its part by reading the
 * peers' send buffers, a second rendezvous (everyone has read), then results computed
 * into scratch memory (all-reduce) are stored. So a rank thread that records W
 * broadcasts in one group never waits inside the group, and nothing can deadlock.
 *
 * Two collectives in flight at once on one device (from entry to return, across every
 * communicator of the process; the device is the init-all call's devlist entry) break NCCL's
 * thread-safety rule, but real NCCL returns no error there: it hangs or corrupts data. The fake
 * completes the call and records a violation, read (and cleared) with the fake's own
 * `int fakeNcclViolations(char *buf, int len)` (the count; the texts into buf); the tests'
 * conftest fails any test that leaves one. `int fakeNcclInFlight(int device)`: how many
 * collectives are in flight on a device now.
 *
 * Knobs (read on every call):
 *   FAKE_NCCL_FAIL=Name:code   the function Name returns code (on every rank, before any wait)
 *   FAKE_NCCL_TIMEOUT_MS=n     a rendezvous waits at most n ms (default 20000), then ncclTimeout
 *
 * Point-to-point (ncclSend / ncclRecv) operations take part in a batch too, but are not
 * matched position by position: the k-th receive of rank r from peer p pairs with the k-th
 * send of p to r, and a pair whose counts or types differ is ncclInvalidUsage. Build with
 * -DFAKE_NO_SENDRECV to leave them out (NCCL before 2.7).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fake_common.h"

typedef int ncclResult_t;
typedef void *ncclComm_t;
typedef void *cudaStream_t;

enum { ncclSuccess = 0, ncclUnhandledCudaError = 1, ncclSystemError = 2, ncclInternalError = 3,
       ncclInvalidArgument = 4, ncclInvalidUsage = 5, ncclRemoteError = 6, ncclInProgress = 7,
       ncclTimeout = 8 };
enum { T_INT8 = 0, T_UINT8 = 1, T_INT32 = 2, T_UINT32 = 3, T_INT64 = 4, T_UINT64 = 5,
       T_FP16 = 6, T_FP32 = 7, T_FP64 = 8, T_BF16 = 9 };
enum { R_SUM = 0, R_PROD = 1, R_MAX = 2, R_MIN = 3 };
typedef enum { K_BROADCAST, K_ALLGATHER, K_ALLREDUCE, K_SEND, K_RECV } Kind;

#define MAX_RANKS 64
#define MAX_GROUP_OPS 512

typedef struct {
    Kind kind;
    const void *send;
    void *recv;
    size_t count;
    int dtype;
    int redop;
    int root;            /* the peer, for K_SEND / K_RECV */
    void *scratch; /* all-reduce result until the second rendezvous */
} Op;

typedef struct {
    int size;
    int refs;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int arrived;
    unsigned long generation;
    Op *ops[MAX_RANKS];
    int nops[MAX_RANKS];
} Group;

typedef struct {
    Group *group;
    int rank;
    int device;
} Comm;

/* Per-thread group state, as in NCCL (group calls are thread-local). */
static __thread int group_depth;
static __thread Op pending[MAX_GROUP_OPS];
static __thread int npending;
static __thread Comm *pending_comm;
static __thread ncclResult_t pending_error;

static int fail_code(const char *name) { return fake_fail_code("FAKE_NCCL_FAIL", name); }

/* Rendezvous of all ranks of the group; ncclTimeout if some rank never comes. */
static ncclResult_t rendezvous(Group *g) {
    return fake_wait_all(&g->mu, &g->cv, g->size, &g->arrived, &g->generation, "FAKE_NCCL_TIMEOUT_MS")
               ? ncclTimeout : ncclSuccess;
}

static size_t dtype_size(int dt) {
    switch (dt) {
    case T_INT8: case T_UINT8: return 1;
    case T_FP16: case T_BF16: return 2;
    case T_INT32: case T_UINT32: case T_FP32: return 4;
    case T_INT64: case T_UINT64: case T_FP64: return 8;
    default: return 0;
    }
}

const char *ncclGetErrorString(ncclResult_t code) {
    switch (code) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (fake nccl)";
    case ncclSystemError: return "unhandled system error (fake nccl)";
    case ncclInternalError: return "internal error (fake nccl)";
    case ncclInvalidArgument: return "invalid argument (fake nccl)";
    case ncclInvalidUsage: return "invalid usage (fake nccl)";
    case ncclRemoteError: return "remote process exited or there was a network error (fake nccl)";
    case ncclInProgress: return "operation in progress (fake nccl)";
    case ncclTimeout: return "timeout waiting for other ranks (fake nccl)";
    default: return "unknown result code (fake nccl)";
    }
}

int fakeNcclViolations(char *buf, int len) { return fake_take_violations(buf, len); }

int fakeNcclInFlight(int device) { return fake_device_in_flight(device); }

ncclResult_t ncclCommInitAll(ncclComm_t *comms, int ndev, const int *devlist) {
    int code = fail_code("ncclCommInitAll");
    if (code) return code;
    if (ndev <= 0 || ndev > MAX_RANKS || !comms) return ncclInvalidArgument;
    int devices[MAX_RANKS];
    for (int i = 0; i < ndev; i++) devices[i] = devlist ? devlist[i] : i; /* NULL: 0..ndev-1 */
    if (fake_check_devices(devices, ndev)) return ncclInvalidUsage; /* as NCCL: a duplicate GPU */
    Group *g = calloc(1, sizeof(Group));
    if (!g) return ncclSystemError;
    g->size = ndev;
    g->refs = ndev;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    for (int i = 0; i < ndev; i++) {
        Comm *c = calloc(1, sizeof(Comm));
        c->group = g;
        c->rank = i;
        c->device = devices[i];
        comms[i] = c;
    }
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    int code = fail_code("ncclCommDestroy");
    if (code) return code;
    Comm *c = comm;
    if (!c) return ncclInvalidArgument;
    Group *g = c->group;
    free(c);
    if (fake_release_group(&g->mu, &g->cv, &g->refs)) free(g);
    return ncclSuccess;
}

/* ---------------------------------------------------------------- arithmetic */

/* Element i of every rank's send buffer, combined in rank order: identical on every rank.
 * 16/32-bit floats accumulate in float (fp32 sums equal torch's rank-order sum). */
static void reduce_element(Group *g, int idx, size_t i, const Op *op, void *out) {
    const Op *first = &g->ops[0][idx];
    switch (op->dtype) {
    case T_FP32: case T_FP16: case T_BF16: {
        float acc = 0.0f;
        for (int k = 0; k < g->size; k++) {
            const void *p = g->ops[k][idx].send;
            float v = op->dtype == T_FP32 ? ((const float *)p)[i]
                    : op->dtype == T_FP16 ? (float)((const _Float16 *)p)[i]
                    : bf16_to_float(((const uint16_t *)p)[i]);
            acc = k == 0 ? v : FAKE_COMBINE(acc, v, op->redop);
        }
        if (op->dtype == T_FP32) ((float *)out)[i] = acc;
        else if (op->dtype == T_FP16) ((_Float16 *)out)[i] = (_Float16)acc;
        else ((uint16_t *)out)[i] = float_to_bf16(acc);
        break;
    }
    case T_FP64: {
        double acc = ((const double *)first->send)[i];
        for (int k = 1; k < g->size; k++) acc = FAKE_COMBINE(acc, ((const double *)g->ops[k][idx].send)[i], op->redop);
        ((double *)out)[i] = acc;
        break;
    }
    case T_INT32: {
        int64_t acc = ((const int32_t *)first->send)[i];
        for (int k = 1; k < g->size; k++) acc = FAKE_COMBINE(acc, (int64_t)((const int32_t *)g->ops[k][idx].send)[i], op->redop);
        ((int32_t *)out)[i] = (int32_t)acc;
        break;
    }
    case T_INT64: {
        int64_t acc = ((const int64_t *)first->send)[i];
        for (int k = 1; k < g->size; k++) acc = FAKE_COMBINE(acc, ((const int64_t *)g->ops[k][idx].send)[i], op->redop);
        ((int64_t *)out)[i] = acc;
        break;
    }
    default: break;
    }
}

/* ---------------------------------------------------------------- batches */

static int is_p2p(const Op *op) { return op->kind == K_SEND || op->kind == K_RECV; }

/* The index in rank k's list of its n-th collective (non point-to-point) operation, or -1. */
static int nth_collective(Group *g, int k, int n) {
    for (int i = 0; i < g->nops[k]; i++)
        if (!is_p2p(&g->ops[k][i]) && n-- == 0) return i;
    return -1;
}

/* Every rank checks every rank's list the same way, so all return the same verdict.
 * Collective operations must match in order; point-to-point ones are paired in perform(). */
static ncclResult_t lists_match(Group *g) {
    for (int n = 0;; n++) {
        int first = nth_collective(g, 0, n);
        for (int k = 1; k < g->size; k++) {
            int i = nth_collective(g, k, n);
            /* same position too: perform() reads the peers' collective at the same index */
            if (i != first) return ncclInvalidUsage;
            if (i < 0) continue;
            const Op *a = &g->ops[0][first], *b = &g->ops[k][i];
            if (a->kind != b->kind || a->count != b->count || a->dtype != b->dtype ||
                a->root != b->root || a->redop != b->redop)
                return ncclInvalidUsage;
        }
        if (first < 0) return ncclSuccess;
    }
}

/* The send of rank `from` to rank `to` that pairs with `to`'s receive at index idx. */
static const Op *matching_send(Group *g, int to, int idx) {
    const Op *recv = &g->ops[to][idx];
    int from = recv->root, nth = 0;
    for (int i = 0; i < idx; i++)
        if (g->ops[to][i].kind == K_RECV && g->ops[to][i].root == from) nth++;
    for (int i = 0; i < g->nops[from]; i++) {
        const Op *op = &g->ops[from][i];
        if (op->kind == K_SEND && op->root == to && nth-- == 0) return op;
    }
    return NULL;
}

static ncclResult_t perform(Group *g, int rank, int idx) {
    Op *op = &g->ops[rank][idx];
    size_t es = dtype_size(op->dtype), bytes = op->count * es;
    switch (op->kind) {
    case K_BROADCAST:
        if (rank != op->root) memcpy(op->recv, g->ops[op->root][idx].send, bytes);
        else if (op->recv != op->send) memmove(op->recv, op->send, bytes);
        return ncclSuccess;
    case K_ALLGATHER:
        for (int k = 0; k < g->size; k++) {
            char *dst = (char *)op->recv + (size_t)k * bytes;
            if (dst != g->ops[k][idx].send) memmove(dst, g->ops[k][idx].send, bytes);
        }
        return ncclSuccess;
    case K_ALLREDUCE:
        op->scratch = malloc(bytes ? bytes : 1);
        if (!op->scratch) return ncclSystemError;
        for (size_t i = 0; i < op->count; i++) reduce_element(g, idx, i, op, op->scratch);
        return ncclSuccess;
    case K_SEND:
        return ncclSuccess; /* the receiver copies */
    case K_RECV: {
        const Op *send = matching_send(g, rank, idx);
        if (!send || send->count != op->count || send->dtype != op->dtype) return ncclInvalidUsage;
        memcpy(op->recv, send->send, bytes);
        return ncclSuccess;
    }
    }
    return ncclInternalError;
}

static ncclResult_t run_batch_on_device(Comm *c, Op *ops, int n) {
    Group *g = c->group;
    g->ops[c->rank] = ops;
    g->nops[c->rank] = n;
    ncclResult_t r = rendezvous(g);
    if (r) return r;
    ncclResult_t result = lists_match(g);
    for (int i = 0; i < n && result == ncclSuccess; i++) result = perform(g, c->rank, i);
    ncclResult_t r2 = rendezvous(g); /* nobody reads our send buffers after this */
    for (int i = 0; i < n; i++) {
        if (ops[i].scratch) {
            if (result == ncclSuccess && r2 == ncclSuccess)
                memcpy(ops[i].recv, ops[i].scratch, ops[i].count * dtype_size(ops[i].dtype));
            free(ops[i].scratch);
            ops[i].scratch = NULL;
        }
    }
    return result ? result : r2;
}

static const char *kind_name(Kind kind) {
    static const char *names[] = {"ncclBroadcast", "ncclAllGather", "ncclAllReduce", "ncclSend", "ncclRecv"};
    return names[kind];
}

/* The batch is in flight on c's device from here to its return: any other collective there
 * (another communicator, another thread) at the same time is a violation, recorded. */
static void enter_device(Comm *c, const Op *first, int n) {
    if (fake_device_enter(c->device))
        fake_record_violation(
            "device %d: %s%s (rank %d of %d) started while another collective was in flight on the "
            "device (NCCL: not safe to issue operations in parallel to independent communicators "
            "on one device from several threads)",
            c->device, kind_name(first->kind), n > 1 ? " and more in one group" : "", c->rank, c->group->size);
}

static ncclResult_t run_batch(Comm *c, Op *ops, int n) {
    enter_device(c, ops, n);
    ncclResult_t result = run_batch_on_device(c, ops, n);
    fake_device_leave(c->device);
    return result;
}

/* Run now, or record in this thread's open group. */
static ncclResult_t submit(Comm *c, Op op) {
    if (group_depth == 0) return run_batch(c, &op, 1);
    if (pending_error) return pending_error;
    if ((pending_comm && pending_comm != c) || npending == MAX_GROUP_OPS) {
        /* The fake serves one communicator per thread and group: the pattern of
         * comfy/multidevice/comm/nccl.py, where each rank thread drives its own GPU. */
        pending_error = ncclInvalidUsage;
        return pending_error;
    }
    pending_comm = c;
    pending[npending++] = op;
    return ncclSuccess;
}

/* Argument errors are returned by the call itself and also fail the open group. */
static ncclResult_t reject(ncclResult_t code) {
    if (group_depth > 0 && !pending_error) pending_error = code;
    return code;
}

ncclResult_t ncclGroupStart(void) {
    int code = fail_code("ncclGroupStart");
    if (code) return code;
    group_depth++;
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd(void) {
    if (group_depth == 0) return ncclInvalidUsage;
    if (--group_depth > 0) return ncclSuccess;
    Comm *c = pending_comm;
    int n = npending;
    ncclResult_t error = pending_error;
    pending_comm = NULL;
    npending = 0;
    pending_error = ncclSuccess;
    int code = fail_code("ncclGroupEnd");
    if (code) return code;
    if (error) return error;
    if (n == 0) return ncclSuccess;
    return run_batch(c, pending, n);
}

ncclResult_t ncclBroadcast(const void *sendbuff, void *recvbuff, size_t count, int datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    (void)stream;
    int code = fail_code("ncclBroadcast");
    if (code) return reject(code);
    Comm *c = comm;
    if (!c || !dtype_size(datatype) || root < 0 || root >= c->group->size) return reject(ncclInvalidArgument);
    Op op = {K_BROADCAST, sendbuff, recvbuff, count, datatype, 0, root, NULL};
    return submit(c, op);
}

ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t sendcount, int datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    (void)stream;
    int code = fail_code("ncclAllGather");
    if (code) return reject(code);
    Comm *c = comm;
    if (!c || !dtype_size(datatype)) return reject(ncclInvalidArgument);
    Op op = {K_ALLGATHER, sendbuff, recvbuff, sendcount, datatype, 0, 0, NULL};
    return submit(c, op);
}

ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int redop,
                           ncclComm_t comm, cudaStream_t stream) {
    (void)stream;
    int code = fail_code("ncclAllReduce");
    if (code) return reject(code);
    Comm *c = comm;
    if (!c || redop < R_SUM || redop > R_MIN) return reject(ncclInvalidArgument);
    if (datatype != T_FP32 && datatype != T_FP16 && datatype != T_BF16 && datatype != T_FP64 &&
        datatype != T_INT32 && datatype != T_INT64)
        return reject(ncclInvalidArgument);
    Op op = {K_ALLREDUCE, sendbuff, recvbuff, count, datatype, redop, 0, NULL};
    return submit(c, op);
}

#ifndef FAKE_NO_SENDRECV
/* ncclSend(sendbuff, count, datatype, peer, comm, stream) / ncclRecv(recvbuff, ...): nccl.h. */
static ncclResult_t point_to_point(Kind kind, const char *name, const void *sendbuff, void *recvbuff,
                                   size_t count, int datatype, int peer, ncclComm_t comm) {
    int code = fail_code(name);
    if (code) return reject(code);
    Comm *c = comm;
    if (!c || !dtype_size(datatype) || peer < 0 || peer >= c->group->size) return reject(ncclInvalidArgument);
    Op op = {kind, sendbuff, recvbuff, count, datatype, 0, peer, NULL};
    return submit(c, op);
}

ncclResult_t ncclSend(const void *sendbuff, size_t count, int datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    (void)stream;
    return point_to_point(K_SEND, "ncclSend", sendbuff, NULL, count, datatype, peer, comm);
}

ncclResult_t ncclRecv(void *recvbuff, size_t count, int datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    (void)stream;
    return point_to_point(K_RECV, "ncclRecv", NULL, recvbuff, count, datatype, peer, comm);
}
#endif

/* ---------------------------------------------------------------- abort and async errors
 *
 * ncclCommAbort(comm): every rank of comm's group that waits in a rendezvous returns at once
 * with an error, and every rendezvous of the group from then on completes alone. The fake
 * frees nothing (a rank may still be inside a call on the group when it is aborted), and a
 * call issued on an aborted communicator afterwards is the caller's bug, as in NCCL, where
 * the abort frees the communicator. Without touching the rendezvous above, the abort works
 * through the group's state:
 *   - run_batch goes through exactly two rendezvous, so an even generation means the
 *     pending one is a batch's first: nobody is reading the peers' operations yet. Then
 *     every rank's list is replaced by `aborted_ops`, whose kind is no operation, so a
 *     waiter's perform() fails with ncclInternalError before it reads any peer's buffer.
 *   - at an odd generation the pending rendezvous is a batch's second: the waiters have
 *     performed their part already, and keep their (correct) results.
 *   - the group's size becomes 1 and the waiters are woken, so they and every later
 *     rendezvous of the group complete alone instead of waiting for the timeout.
 * fakeNcclAbortCount() counts the communicators aborted in this process, fakeNcclWaiting(comm)
 * the ranks of comm's group waiting in a rendezvous now (tests read them).
 *
 * ncclCommGetAsyncError(comm, &error): error is ncclSuccess, or the code in
 * FAKE_NCCL_ASYNC_ERROR=code (read on every call) for every communicator: a link that failed
 * while a collective was in flight, as NCCL's proxy thread reports it.
 */
#define ABORTED_KIND 99 /* no Kind: perform() returns ncclInternalError for it */

static Op aborted_ops[MAX_GROUP_OPS];
static int aborted_ops_ready;
static Group *aborted_groups[4096];
static int n_aborted_groups;
static int n_aborted_comms;
static pthread_mutex_t abort_mu = PTHREAD_MUTEX_INITIALIZER;

static int group_was_aborted(Group *g) {
    for (int i = 0; i < n_aborted_groups; i++)
        if (aborted_groups[i] == g) return 1;
    return 0;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    int code = fail_code("ncclCommAbort");
    if (code) return code;
    Comm *c = comm;
    if (!c) return ncclInvalidArgument;
    Group *g = c->group;
    pthread_mutex_lock(&abort_mu);
    n_aborted_comms++;
    if (!aborted_ops_ready) {
        for (int i = 0; i < MAX_GROUP_OPS; i++) aborted_ops[i].kind = (Kind)ABORTED_KIND;
        aborted_ops_ready = 1;
    }
    int first = !group_was_aborted(g);
    if (first && n_aborted_groups < (int)(sizeof aborted_groups / sizeof aborted_groups[0]))
        aborted_groups[n_aborted_groups++] = g;
    pthread_mutex_unlock(&abort_mu);
    if (!first) return ncclSuccess;
    pthread_mutex_lock(&g->mu);
    if (g->generation % 2 == 0) {
        for (int k = 0; k < MAX_RANKS; k++) {
            g->ops[k] = aborted_ops;
            g->nops[k] = 0;
        }
    }
    g->size = 1;
    g->arrived = 0;
    g->generation += 2; /* wakes the waiters and keeps the parity */
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *asyncError) {
    int code = fail_code("ncclCommGetAsyncError");
    if (code) return code;
    if (!comm || !asyncError) return ncclInvalidArgument;
    const char *spec = getenv("FAKE_NCCL_ASYNC_ERROR");
    *asyncError = spec ? atoi(spec) : ncclSuccess;
    return ncclSuccess;
}

int fakeNcclAbortCount(void) {
    pthread_mutex_lock(&abort_mu);
    int n = n_aborted_comms;
    pthread_mutex_unlock(&abort_mu);
    return n;
}

int fakeNcclWaiting(ncclComm_t comm) {
    Group *g = ((Comm *)comm)->group;
    pthread_mutex_lock(&g->mu);
    int n = g->arrived;
    pthread_mutex_unlock(&g->mu);
    return n;
}
