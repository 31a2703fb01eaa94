/* The C ABI on a GPU: a buffer the caller allocated and registered itself,
 * wrapped in a group's pool, and a range of it at a byte offset used as
 * dispatch's recv_tokens (written in place) and then, identity experts, as
 * combine's expert_out (read in place by every rank). Built and run by
 * capi/tests/capi.rs against libmoe_ep.so; without a GPU it prints
 * "SKIP: c_window_dispatch_at_an_offset: no GPU (...)" and exits 0.
 *
 * World 2, one thread per rank. With 2 GPUs and libnccl.so.2
 * (MOE_EP_NCCL_LIBRARY names another), an NCCL communicator this test makes
 * itself (borrowed with moe_ep_comm_borrow_nccl) and an NCCL window it
 * registers over ncclMemAlloc memory, wrapped with moe_ep_pool_wrap_window;
 * with one GPU, two virtual ranks on it (moe_ep_comm_create_virtual) and a
 * cuMemAlloc buffer wrapped with moe_ep_pool_wrap_device, the virtual
 * counterpart. The CUDA driver and NCCL are loaded at run time, as the
 * library loads them: nothing here needs their headers.
 *
 * Routing: 4 experts, 2 a rank, every token to experts 0 and 2, so every
 * rank receives every token of both ranks, rank-major: row s * T + t is
 * token t of rank s. Token values are small integers (exact in bf16), so
 * combine's sum over the two ranks is exactly 2 x.
 *
 * Then the ABI 5 calls on the same ranks: the host counts' max_recv_rows
 * and dropped_rows, the memory footprint and a handle's bytes, an fp8
 * dispatch (e4m3 codes with e8m0 scales per 32 values) into pool buffers,
 * every code and scale checked at its row; and a second group of
 * recv_capacity 12 with MOE_EP_OVERFLOW_DROP, where each rank needs 16 rows
 * (8 tokens from each source): water-filling keeps every source's first 6
 * tokens on each rank, so tokens 6 and 7 of every rank are dropped on both
 * ranks (4 rows a rank), their slots say so, the kept routing has -1 there,
 * dispatch delivers row s * 6 + t = token t < 6 of rank s, and combine gives
 * 2 x for t < 6 and zeros for the dropped tokens.
 *
 * Last, refusals of the C ABI's own checks on one rank, on the first
 * group: rank 1's dispatch has x NULL with a length, then its layout an
 * unknown layout code, then (after a dispatch on both) its combine
 * expert_out NULL with a length; rank 0's calls are correct. Each time
 * rank 1 gets MOE_EP_ERR_INVALID_ARGUMENT naming the argument, and its
 * refusal is published: rank 0's op stops at once, and its
 * moe_ep_group_check gets MOE_EP_ERR_PEER_FAILED naming rank 1 and the
 * argument within 2 s of the op (the timeout is 10 s), rank 1's
 * MOE_EP_ERR_INVALID_STATE naming its refusal; then a new layout's
 * dispatch and combine on both ranks give 2 x again. The same for a
 * low-latency dispatch (x NULL with a length on rank 1, a group of
 * MOE_EP_MODE_LOW_LATENCY), then a batch's round trip.
 */
#define _POSIX_C_SOURCE 200809L
#include "moe_ep.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define TEST "c_window_dispatch_at_an_offset"
enum { WORLD = 2, T = 8, HIDDEN = 256, EXPERTS = 4, TOPK = 2 };
/* The drop group: capacity 12 of the 16 rows each rank needs; 6 kept per source. */
enum { DROP_CAP = 12, KEPT = 6 };
/* The range starts 3 rows and 128 bytes into the window (16-byte aligned). */
#define OFFSET ((uint64_t)(3 * HIDDEN * 2 + 128))
#define WINDOW_BYTES ((size_t)2 << 20)
#define FILLER 0x7f7fu

/* ---- the CUDA driver and NCCL, loaded at run time ---------------------- */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

static struct {
  CUresult (*init)(unsigned);
  CUresult (*device_get_count)(int *);
  CUresult (*device_get)(CUdevice *, int);
  CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
  CUresult (*ctx_set_current)(CUcontext);
  CUresult (*stream_create)(moe_ep_stream_t *, unsigned);
  CUresult (*stream_destroy)(moe_ep_stream_t);
  CUresult (*stream_synchronize)(moe_ep_stream_t);
  CUresult (*mem_alloc)(CUdeviceptr *, size_t);
  CUresult (*mem_free)(CUdeviceptr);
  CUresult (*htod)(CUdeviceptr, const void *, size_t, moe_ep_stream_t);
  CUresult (*dtoh)(void *, CUdeviceptr, size_t, moe_ep_stream_t);
} cu;

typedef struct {
  char internal[128];
} nccl_id_t;

static struct {
  int (*get_unique_id)(nccl_id_t *);
  int (*comm_init_rank)(struct ncclComm **, int, nccl_id_t, int);
  int (*comm_destroy)(struct ncclComm *);
  int (*mem_alloc)(void **, size_t);
  int (*mem_free)(void *);
  int (*window_register)(struct ncclComm *, void *, size_t, struct ncclWindow_vidmem **, int);
  int (*window_deregister)(struct ncclComm *, struct ncclWindow_vidmem *);
} nccl;

/* dlsym into the function pointer at `field` (copied: -pedantic refuses
 * the object-to-function cast); 0 when the symbol is missing. */
static int load(void *lib, void *field, const char *name) {
  void *sym = dlsym(lib, name);
  memcpy(field, &sym, sizeof sym);
  return sym != NULL;
}
#define LOAD(lib, field, name) load((lib), &(field), (name))

static int load_cuda(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) return 0;
  int ok = LOAD(lib, cu.init, "cuInit") && LOAD(lib, cu.device_get_count, "cuDeviceGetCount") &&
           LOAD(lib, cu.device_get, "cuDeviceGet") &&
           LOAD(lib, cu.primary_ctx_retain, "cuDevicePrimaryCtxRetain") &&
           LOAD(lib, cu.ctx_set_current, "cuCtxSetCurrent") &&
           LOAD(lib, cu.stream_create, "cuStreamCreate") &&
           LOAD(lib, cu.stream_destroy, "cuStreamDestroy_v2") &&
           LOAD(lib, cu.stream_synchronize, "cuStreamSynchronize") &&
           LOAD(lib, cu.mem_alloc, "cuMemAlloc_v2") && LOAD(lib, cu.mem_free, "cuMemFree_v2") &&
           LOAD(lib, cu.htod, "cuMemcpyHtoDAsync_v2") &&
           LOAD(lib, cu.dtoh, "cuMemcpyDtoHAsync_v2");
  return ok && cu.init(0) == 0;
}

static int load_nccl(void) {
  const char *path = getenv("MOE_EP_NCCL_LIBRARY");
  void *lib = dlopen(path && *path ? path : "libnccl.so.2", RTLD_NOW | RTLD_GLOBAL);
  if (!lib) return 0;
  return LOAD(lib, nccl.get_unique_id, "ncclGetUniqueId") &&
         LOAD(lib, nccl.comm_init_rank, "ncclCommInitRank") &&
         LOAD(lib, nccl.comm_destroy, "ncclCommDestroy") &&
         LOAD(lib, nccl.mem_alloc, "ncclMemAlloc") && LOAD(lib, nccl.mem_free, "ncclMemFree") &&
         LOAD(lib, nccl.window_register, "ncclCommWindowRegister") &&
         LOAD(lib, nccl.window_deregister, "ncclCommWindowDeregister");
}

/* ---- checks ------------------------------------------------------------ */

static pthread_mutex_t print_lock = PTHREAD_MUTEX_INITIALIZER;
static int failures = 0;

static void report(int rank, const char *what, int ok, const char *detail) {
  pthread_mutex_lock(&print_lock);
  printf("%s rank %d: %s%s%s\n", ok ? "ok  " : "FAIL", rank, what, detail ? ": " : "",
         detail ? detail : "");
  failures += !ok;
  pthread_mutex_unlock(&print_lock);
}

/* `got` must be `want`, with a message containing `word` (unless NULL). */
static int expect(int rank, const char *what, moe_ep_status_t got, moe_ep_status_t want,
                  const char *word) {
  const char *msg = got == MOE_EP_OK ? "" : moe_ep_last_error();
  int ok = got == want && (!word || strstr(msg, word));
  char detail[1024];
  snprintf(detail, sizeof detail, "%s%s%s", moe_ep_status_name(got), *msg ? ": " : "", msg);
  report(rank, what, ok, detail);
  return ok;
}

static int cu_ok(int rank, const char *what, CUresult rc) {
  if (rc != 0) {
    char detail[64];
    snprintf(detail, sizeof detail, "CUresult %d", rc);
    report(rank, what, 0, detail);
  }
  return rc == 0;
}

static uint16_t bf16(float f) { /* exact for the small integers used here */
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)(u >> 16);
}

static float token(int rank, int t, int h) { return (float)(rank * 32 + t + 1 + h % 3); }

/* fp8 rows: any bytes (dispatch moves them as they are). */
static uint8_t code(int rank, int t, int h) { return (uint8_t)(rank * 97 + t * 13 + h * 7 + 1); }
static uint8_t scale(int rank, int t, int j) { return (uint8_t)(100 + rank * 40 + t * 3 + j); }

/* ---- one rank ----------------------------------------------------------- */

struct rank_args {
  int rank;
  int nccl;                /* 1: NCCL ranks on GPUs 0 and 1; 0: virtual ranks on GPU 0 */
  nccl_id_t id;            /* NCCL ranks: the communicator's id */
  moe_ep_comm_t *comm;     /* virtual ranks: made by main */
  pthread_barrier_t *line; /* all ranks meet here between phases */
};

#define CHECK(call, what) \
  if (!expect(r, (what), (call), MOE_EP_OK, NULL)) goto out

static double since(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (double)(t1.tv_sec - t0->tv_sec) + (t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

/* A refusal of the C ABI's own checks on rank 1 only (`what`, naming
 * `arg`): rank 1's op returned `got` MOE_EP_ERR_INVALID_ARGUMENT, rank 0's
 * MOE_EP_OK; then the check on both, within 2 s of t0 on rank 0 (the
 * timeout is 10 s): rank 0's MOE_EP_ERR_PEER_FAILED naming rank 1 and
 * `arg`, rank 1's MOE_EP_ERR_INVALID_STATE naming `arg`. */
static void expect_published(int r, moe_ep_group_t *group, const char *what,
                             moe_ep_status_t got, const char *arg,
                             const struct timespec *t0) {
  char line[160];
  snprintf(line, sizeof line, "%s on rank %d", what, r);
  expect(r, line, got, r == 1 ? MOE_EP_ERR_INVALID_ARGUMENT : MOE_EP_OK, r == 1 ? arg : NULL);
  moe_ep_status_t c = moe_ep_group_check(group);
  const double took = since(t0);
  snprintf(line, sizeof line, "%s: check", what);
  if (r == 1) {
    expect(r, line, c, MOE_EP_ERR_INVALID_STATE, arg);
    return;
  }
  int named = c != MOE_EP_OK && strstr(moe_ep_last_error(), "rank 1") != NULL;
  expect(r, line, c, MOE_EP_ERR_PEER_FAILED, arg);
  snprintf(line, sizeof line, "%s: check names rank 1", what);
  report(r, line, named, NULL);
  char detail[64];
  snprintf(detail, sizeof detail, "%.3f s", took);
  snprintf(line, sizeof line, "%s: op and check within 2 s (the timeout is 10 s)", what);
  report(r, line, took < 2.0, detail);
}

/* A new layout's dispatch into the group's buffers and combine into `out`:
 * 2 x on every rank, then a clean check. Returns 0 where a call failed. */
static int round_trip_2x(int r, moe_ep_group_t *group, moe_ep_stream_t stream,
                         const moe_ep_layout_args_t *la, const moe_ep_dispatch_args_t *da,
                         CUdeviceptr out, const char *what) {
  moe_ep_handle_t *h = NULL;
  moe_ep_dispatched_t *d = NULL;
  int ok = 0;
  char line[160];
  snprintf(line, sizeof line, "layout %s", what);
  if (!expect(r, line, moe_ep_layout(group, stream, la, &h), MOE_EP_OK, NULL)) goto done;
  moe_ep_dispatch_args_t ga = MOE_EP_DISPATCH_ARGS_INIT;
  ga.x = da->x;
  ga.topk_weights = da->topk_weights;
  snprintf(line, sizeof line, "dispatch %s", what);
  if (!expect(r, line, moe_ep_dispatch(group, stream, h, &ga, &d), MOE_EP_OK, NULL)) goto done;
  moe_ep_recv_buffers_t gb = MOE_EP_RECV_BUFFERS_INIT;
  snprintf(line, sizeof line, "dispatched_buffers %s", what);
  if (!expect(r, line, moe_ep_dispatched_buffers(d, &gb), MOE_EP_OK, NULL)) goto done;
  moe_ep_combine_args_t gc = MOE_EP_COMBINE_ARGS_INIT;
  gc.expert_out = (moe_ep_buf_t){gb.tokens.ptr, gb.tokens.len};
  gc.out = (moe_ep_buf_mut_t){(void *)(uintptr_t)out, T * HIDDEN};
  snprintf(line, sizeof line, "combine %s", what);
  if (!expect(r, line, moe_ep_combine(group, stream, h, &gc), MOE_EP_OK, NULL)) goto done;
  static uint16_t sum[WORLD][T * HIDDEN];
  if (!cu_ok(r, "sync", cu.stream_synchronize(stream)) ||
      !cu_ok(r, "download out", cu.dtoh(sum[r], out, sizeof sum[r], stream)) ||
      !cu_ok(r, "sync", cu.stream_synchronize(stream)))
    goto done;
  int same = 1;
  for (int i = 0; i < T * HIDDEN; i++)
    same &= sum[r][i] == bf16(2.0f * token(r, i / HIDDEN, i % HIDDEN));
  snprintf(line, sizeof line, "the round trip %s is 2 x", what);
  report(r, line, same, NULL);
  snprintf(line, sizeof line, "group_check %s", what);
  ok = expect(r, line, moe_ep_group_check(group), MOE_EP_OK, NULL) && same;
done:
  moe_ep_dispatched_destroy(d);
  moe_ep_handle_destroy(h);
  return ok;
}

static void *run_rank(void *p) {
  struct rank_args *a = p;
  const int r = a->rank;
  const int device = a->nccl ? r : 0;
  CUdevice dev;
  CUcontext ctx;
  if (!cu_ok(r, "cuDeviceGet", cu.device_get(&dev, device)) ||
      !cu_ok(r, "cuDevicePrimaryCtxRetain", cu.primary_ctx_retain(&ctx, dev)) ||
      !cu_ok(r, "cuCtxSetCurrent", cu.ctx_set_current(ctx)))
    return NULL;
  moe_ep_stream_t stream = NULL;
  struct ncclComm *nc = NULL;
  struct ncclWindow_vidmem *win = NULL;
  moe_ep_comm_t *comm = a->comm;
  moe_ep_group_t *group = NULL;
  moe_ep_buffer_t *window = NULL;
  moe_ep_handle_t *handle = NULL;
  moe_ep_dispatched_t *dispatched = NULL, *fp8 = NULL, *dropped = NULL;
  moe_ep_group_t *drop_group = NULL;
  moe_ep_handle_t *drop_handle = NULL;
  moe_ep_handle_t *again = NULL; /* the layouts of the refusals (9) */
  moe_ep_dispatched_t *refused = NULL, *redone = NULL;
  moe_ep_group_t *ll_group = NULL;
  moe_ep_ll_handle_t *ll_refused = NULL;
  CUdeviceptr base = 0, x = 0, w = 0, idx = 0, out = 0, codes = 0, scales = 0;
  void *nccl_mem = NULL;
  uint16_t *host = malloc(WINDOW_BYTES);
  /* 1 (NCCL ranks): the communicator and the window, collective. */
  if (a->nccl) {
    if (nccl.comm_init_rank(&nc, WORLD, a->id, r) != 0) {
      report(r, "ncclCommInitRank", 0, NULL);
      goto out;
    }
    CHECK(moe_ep_comm_borrow_nccl(device, nc, &comm), "moe_ep_comm_borrow_nccl");
    if (nccl.mem_alloc(&nccl_mem, WINDOW_BYTES) != 0 ||
        nccl.window_register(nc, nccl_mem, WINDOW_BYTES, &win, 1 /* COLL_SYMMETRIC */) != 0) {
      report(r, "ncclMemAlloc + ncclCommWindowRegister", 0, NULL);
      goto out;
    }
    base = (CUdeviceptr)(uintptr_t)nccl_mem;
  }
  /* 2: every allocation before any kernel runs (on virtual ranks a
   * cuMemAlloc can wait for the GPU, where a sibling's kernels wait). */
  if (!cu_ok(r, "cuStreamCreate", cu.stream_create(&stream, 1 /* NON_BLOCKING */)) ||
      (!a->nccl && !cu_ok(r, "cuMemAlloc window", cu.mem_alloc(&base, WINDOW_BYTES))) ||
      !cu_ok(r, "cuMemAlloc x", cu.mem_alloc(&x, T * HIDDEN * 2)) ||
      !cu_ok(r, "cuMemAlloc w", cu.mem_alloc(&w, T * TOPK * 4)) ||
      !cu_ok(r, "cuMemAlloc idx", cu.mem_alloc(&idx, T * TOPK * 8)) ||
      !cu_ok(r, "cuMemAlloc out", cu.mem_alloc(&out, T * HIDDEN * 2)) ||
      !cu_ok(r, "cuMemAlloc codes", cu.mem_alloc(&codes, T * HIDDEN)) ||
      !cu_ok(r, "cuMemAlloc scales", cu.mem_alloc(&scales, T * HIDDEN / 32)))
    goto out;
  {
    static uint8_t hc[WORLD][T * HIDDEN], hs[WORLD][T * HIDDEN / 32];
    for (int t = 0; t < T; t++) {
      for (int h = 0; h < HIDDEN; h++) hc[r][t * HIDDEN + h] = code(r, t, h);
      for (int j = 0; j < HIDDEN / 32; j++) hs[r][t * HIDDEN / 32 + j] = scale(r, t, j);
    }
    if (!cu_ok(r, "upload codes", cu.htod(codes, hc[r], sizeof hc[r], stream)) ||
        !cu_ok(r, "upload scales", cu.htod(scales, hs[r], sizeof hs[r], stream)))
      goto out;
  }
  {
    static uint16_t hx[WORLD][T * HIDDEN];
    static float hw[WORLD][T * TOPK];
    static int64_t hi[WORLD][T * TOPK];
    for (int t = 0; t < T; t++) {
      for (int h = 0; h < HIDDEN; h++) hx[r][t * HIDDEN + h] = bf16(token(r, t, h));
      for (int k = 0; k < TOPK; k++) {
        hw[r][t * TOPK + k] = 1.0f;
        hi[r][t * TOPK + k] = 2 * k; /* experts 0 (rank 0) and 2 (rank 1) */
      }
    }
    for (size_t i = 0; i < WINDOW_BYTES / 2; i++) host[i] = FILLER;
    if (!cu_ok(r, "upload x", cu.htod(x, hx[r], sizeof hx[r], stream)) ||
        !cu_ok(r, "upload w", cu.htod(w, hw[r], sizeof hw[r], stream)) ||
        !cu_ok(r, "upload idx", cu.htod(idx, hi[r], sizeof hi[r], stream)) ||
        !cu_ok(r, "fill the window", cu.htod(base, host, WINDOW_BYTES, stream)) ||
        !cu_ok(r, "sync", cu.stream_synchronize(stream)))
      goto out;
  }
  pthread_barrier_wait(a->line);

  /* 3: the group, the window wrapped, the range at OFFSET. */
  moe_ep_group_config_t cfg = MOE_EP_GROUP_CONFIG_INIT;
  cfg.num_experts = EXPERTS;
  cfg.hidden = HIDDEN;
  cfg.max_tokens_per_rank = T;
  uint32_t sms = 0;
  CHECK(moe_ep_comm_max_sms(comm, EXPERTS, &sms), "max_sms");
  cfg.num_sms = sms < 8 ? sms : 8;
  CHECK(moe_ep_group_create(comm, &cfg, &group), "group_create");
  /* The drop group (ABI 5), made before any kernel runs. */
  moe_ep_group_config_t drop_cfg = cfg;
  drop_cfg.recv_capacity = DROP_CAP;
  drop_cfg.overflow = MOE_EP_OVERFLOW_DROP;
  drop_cfg.padding = MOE_EP_PADDING_UNTOUCHED;
  CHECK(moe_ep_group_create(comm, &drop_cfg, &drop_group), "group_create (overflow drop)");
  /* ABI 6: the host collectives' bound (NCCL: 600 s, settable; virtual
   * ranks: their creation's 60 s, not settable). */
  {
    uint64_t ms = 0;
    CHECK(moe_ep_comm_host_timeout(comm, &ms), "comm_host_timeout");
    report(r, "host timeout: 600000 ms on NCCL, 60000 on virtual ranks",
           ms == (a->nccl ? 600000u : 60000u), NULL);
    if (a->nccl) {
      CHECK(moe_ep_comm_set_host_timeout(comm, 120000), "comm_set_host_timeout");
    } else {
      expect(r, "set_host_timeout on a virtual rank refused",
             moe_ep_comm_set_host_timeout(comm, 120000), MOE_EP_ERR_INVALID_ARGUMENT, "`timeout`");
    }
    expect(r, "host timeout 0 refused", moe_ep_comm_set_host_timeout(comm, 0),
           MOE_EP_ERR_INVALID_ARGUMENT, "`timeout`");
  }
  /* The low-latency group (10), made before any kernel runs. */
  moe_ep_group_config_t ll_cfg = cfg;
  ll_cfg.mode = MOE_EP_MODE_LOW_LATENCY;
  CHECK(moe_ep_group_create(comm, &ll_cfg, &ll_group), "group_create (low latency)");
  if (a->nccl) {
    expect(r, "wrap_device on NCCL ranks refused", moe_ep_pool_wrap_device(group, (void *)(uintptr_t)base, WINDOW_BYTES, &window),
           MOE_EP_ERR_INVALID_ARGUMENT, "`group`");
    CHECK(moe_ep_pool_wrap_window(group, win, (void *)(uintptr_t)base, WINDOW_BYTES, &window),
          "pool_wrap_window");
  } else {
    expect(r, "wrap_window on virtual ranks refused", moe_ep_pool_wrap_window(group, NULL, (void *)(uintptr_t)base, WINDOW_BYTES, &window),
           MOE_EP_ERR_INVALID_ARGUMENT, "moe_ep_pool_wrap_device");
    CHECK(moe_ep_pool_wrap_device(group, (void *)(uintptr_t)base, WINDOW_BYTES, &window),
          "pool_wrap_device");
  }
  moe_ep_buf_mut_t whole;
  CHECK(moe_ep_buffer_get(window, &whole), "buffer_get");
  report(r, "the wrapped buffer is the window", whole.ptr == (void *)(uintptr_t)base &&
                                                    whole.len == WINDOW_BYTES, NULL);
  uint64_t cap = 0;
  CHECK(moe_ep_group_recv_capacity(group, &cap), "recv_capacity");
  moe_ep_buf_mut_t recv, bad;
  expect(r, "range at an odd byte offset refused",
         moe_ep_buffer_range(window, OFFSET + 1, MOE_EP_DTYPE_BF16, 4, &bad),
         MOE_EP_ERR_INVALID_ARGUMENT, "`byte_offset`");
  expect(r, "range past the end refused",
         moe_ep_buffer_range(window, OFFSET, MOE_EP_DTYPE_BF16, WINDOW_BYTES / 2, &bad),
         MOE_EP_ERR_INVALID_ARGUMENT, "`len`");
  expect(r, "range of dtype 0 refused", moe_ep_buffer_range(window, 0, 0, 1, &bad),
         MOE_EP_ERR_INVALID_ARGUMENT, "`dtype`");
  CHECK(moe_ep_buffer_range(window, OFFSET, MOE_EP_DTYPE_BF16, cap * HIDDEN, &recv),
        "buffer_range");
  int symm = 0;
  CHECK(moe_ep_is_symm_backed(group, recv.ptr, recv.len * 2, &symm), "is_symm_backed");
  report(r, "the range is symmetric memory", symm == 1 && recv.ptr == (char *)whole.ptr + OFFSET,
         NULL);

  /* 4: layout, dispatch into the range. */
  moe_ep_layout_args_t la = MOE_EP_LAYOUT_ARGS_INIT;
  la.topk_idx = (moe_ep_buf_t){(const void *)(uintptr_t)idx, T * TOPK};
  la.topk_idx_dtype = MOE_EP_DTYPE_I64;
  la.topk = TOPK;
  la.layout = MOE_EP_LAYOUT_RANK_MAJOR;
  CHECK(moe_ep_layout(group, stream, &la, &handle), "layout");
  moe_ep_dispatch_args_t da = MOE_EP_DISPATCH_ARGS_INIT;
  da.x = (moe_ep_buf_t){(const void *)(uintptr_t)x, T * HIDDEN};
  da.topk_weights = (moe_ep_buf_t){(const void *)(uintptr_t)w, T * TOPK};
  da.recv_tokens = recv;
  CHECK(moe_ep_dispatch(group, stream, handle, &da, &dispatched), "dispatch into the range");
  moe_ep_recv_buffers_t rb = MOE_EP_RECV_BUFFERS_INIT;
  CHECK(moe_ep_dispatched_buffers(dispatched, &rb), "dispatched_buffers");
  report(r, "recv_tokens used in place", rb.tokens.ptr == recv.ptr, NULL);
  if (!cu_ok(r, "sync after dispatch", cu.stream_synchronize(stream)) ||
      !cu_ok(r, "download the window", cu.dtoh(host, base, WINDOW_BYTES, stream)) ||
      !cu_ok(r, "sync", cu.stream_synchronize(stream)))
    goto out;
  {
    int before = 1, rows = 1, after = 1;
    const size_t at = OFFSET / 2, n = (size_t)WORLD * T * HIDDEN;
    for (size_t i = 0; i < at; i++) before &= host[i] == FILLER;
    for (size_t i = 0; i < n; i++) {
      int s = (int)(i / (T * HIDDEN)), t = (int)(i / HIDDEN % T), h = (int)(i % HIDDEN);
      rows &= host[at + i] == bf16(token(s, t, h));
    }
    for (size_t i = at + (size_t)cap * HIDDEN; i < at + (size_t)cap * HIDDEN + HIDDEN; i++)
      after &= host[i] == FILLER;
    report(r, "the window before the offset untouched", before, NULL);
    report(r, "every rank's rows at the offset (row s * T + t: token t of rank s)", rows, NULL);
    report(r, "the window past the range untouched", after, NULL);
  }

  /* 5: the same range as combine's expert_out (identity experts). */
  moe_ep_combine_args_t ca = MOE_EP_COMBINE_ARGS_INIT;
  ca.expert_out = (moe_ep_buf_t){recv.ptr, recv.len};
  ca.out = (moe_ep_buf_mut_t){(void *)(uintptr_t)out, T * HIDDEN};
  CHECK(moe_ep_combine(group, stream, handle, &ca), "combine of the range");
  {
    static uint16_t got[WORLD][T * HIDDEN];
    if (!cu_ok(r, "sync after combine", cu.stream_synchronize(stream)) ||
        !cu_ok(r, "download out", cu.dtoh(got[r], out, sizeof got[r], stream)) ||
        !cu_ok(r, "sync", cu.stream_synchronize(stream)))
      goto out;
    int ok = 1;
    for (int i = 0; i < T * HIDDEN; i++)
      ok &= got[r][i] == bf16(2.0f * token(r, i / HIDDEN, i % HIDDEN));
    report(r, "combine of the window's rows is 2 x (each token reached both ranks)", ok, NULL);
  }
  CHECK(moe_ep_group_check(group), "group_check");

  /* 6 (ABI 5): eager sizes, the footprint, the fp8 dispatch. */
  {
    moe_ep_handle_counts_t hc = MOE_EP_HANDLE_COUNTS_INIT;
    CHECK(moe_ep_handle_counts(handle, stream, &hc), "handle_counts");
    report(r, "counts: WORLD * T rows here and at most on any rank, none dropped",
           hc.recv_rows == WORLD * T && hc.max_recv_rows == WORLD * T && hc.dropped_rows == 0,
           NULL);
    report(r, "a bf16 dispatch has no scales",
           rb.scale_kind == MOE_EP_FP8_SCALES_NONE && rb.scales.ptr == NULL && rb.scales.len == 0,
           NULL);
    moe_ep_memory_footprint_t fp = MOE_EP_MEMORY_FOOTPRINT_INIT;
    CHECK(moe_ep_group_memory_footprint(group, &fp), "group_memory_footprint");
    report(r, "footprint: a workspace, no low-latency or two-level bytes, the total their sum",
           fp.workspace > 0 && fp.low_latency == 0 && fp.two_level == 0 &&
               fp.pool_free <= fp.pool_other &&
               fp.device_total == fp.workspace + fp.low_latency + fp.pool_other + fp.two_level,
           NULL);
    uint64_t hbytes = 0;
    CHECK(moe_ep_handle_device_bytes(handle, &hbytes), "handle_device_bytes");
    report(r, "the handle holds device bytes", hbytes > 0, NULL);

    moe_ep_dispatch_fp8_args_t fa = MOE_EP_DISPATCH_FP8_ARGS_INIT;
    fa.codes = (moe_ep_buf_t){(const void *)(uintptr_t)codes, T * HIDDEN};
    fa.scales = (moe_ep_buf_t){(const void *)(uintptr_t)scales, T * HIDDEN / 32};
    fa.topk_weights = da.topk_weights;
    expect(r, "fp8 dispatch without a scale kind refused",
           moe_ep_dispatch_fp8(group, stream, handle, &fa, &fp8), MOE_EP_ERR_INVALID_ARGUMENT,
           "`scale_kind`");
    fa.scale_kind = MOE_EP_FP8_SCALES_E8M0_PER_32;
    CHECK(moe_ep_dispatch_fp8(group, stream, handle, &fa, &fp8), "dispatch_fp8 (e8m0 per 32)");
    moe_ep_recv_buffers_t fb = MOE_EP_RECV_BUFFERS_INIT;
    CHECK(moe_ep_dispatched_buffers(fp8, &fb), "dispatched_buffers of the fp8 dispatch");
    report(r, "fp8 buffers: codes [cap, H] u8, e8m0 scales [cap, H / 32]",
           fb.scale_kind == MOE_EP_FP8_SCALES_E8M0_PER_32 && fb.tokens.len == cap * HIDDEN &&
               fb.scales.len == cap * HIDDEN / 32 && fb.scales.ptr != NULL,
           NULL);
    static uint8_t gc[WORLD][WORLD * T * HIDDEN], gs[WORLD][WORLD * T * HIDDEN / 32];
    if (!cu_ok(r, "sync after dispatch_fp8", cu.stream_synchronize(stream)) ||
        !cu_ok(r, "download codes", cu.dtoh(gc[r], (CUdeviceptr)(uintptr_t)fb.tokens.ptr,
                                            sizeof gc[r], stream)) ||
        !cu_ok(r, "download scales", cu.dtoh(gs[r], (CUdeviceptr)(uintptr_t)fb.scales.ptr,
                                             sizeof gs[r], stream)) ||
        !cu_ok(r, "sync", cu.stream_synchronize(stream)))
      goto out;
    int ok_c = 1, ok_s = 1;
    for (int s = 0; s < WORLD; s++)
      for (int t = 0; t < T; t++) {
        for (int h = 0; h < HIDDEN; h++) ok_c &= gc[r][(s * T + t) * HIDDEN + h] == code(s, t, h);
        for (int j = 0; j < HIDDEN / 32; j++)
          ok_s &= gs[r][(s * T + t) * (HIDDEN / 32) + j] == scale(s, t, j);
      }
    report(r, "fp8 codes at row s * T + t, bit for bit", ok_c, NULL);
    report(r, "e8m0 scales beside their rows, bit for bit", ok_s, NULL);
  }
  CHECK(moe_ep_group_check(group), "group_check after dispatch_fp8");

  /* 7 (ABI 5): the drop policy. */
  CHECK(moe_ep_layout(drop_group, stream, &la, &drop_handle), "layout (overflow drop)");
  {
    moe_ep_handle_counts_t hc = MOE_EP_HANDLE_COUNTS_INIT;
    CHECK(moe_ep_handle_counts(drop_handle, stream, &hc), "handle_counts (overflow drop)");
    report(r, "drop counts: 12 rows here and at most, 8 dropped in all",
           hc.recv_rows == DROP_CAP && hc.max_recv_rows == DROP_CAP &&
               hc.dropped_rows == WORLD * (T - KEPT) * WORLD,
           NULL);
    uint64_t per[WORLD + 1] = {0};
    expect(r, "dropped_rows into a short array refused",
           moe_ep_handle_dropped_rows(drop_handle, stream, per, WORLD - 1),
           MOE_EP_ERR_INVALID_ARGUMENT, "`len`");
    CHECK(moe_ep_handle_dropped_rows(drop_handle, stream, per, WORLD + 1), "handle_dropped_rows");
    int ok = per[WORLD] == 0;
    for (int d = 0; d < WORLD; d++) ok &= per[d] == WORLD * (T - KEPT);
    report(r, "each rank dropped the last 2 tokens of each source", ok, NULL);
    uint8_t slots[T * TOPK];
    expect(r, "dropped_slots into a short array refused",
           moe_ep_handle_dropped_slots(drop_handle, stream, slots, T * TOPK - 1),
           MOE_EP_ERR_INVALID_ARGUMENT, "`len`");
    CHECK(moe_ep_handle_dropped_slots(drop_handle, stream, slots, T * TOPK), "dropped_slots");
    moe_ep_buf_t kept;
    CHECK(moe_ep_handle_kept_topk_idx(drop_handle, &kept), "kept_topk_idx");
    int32_t hk[T * TOPK];
    if (!cu_ok(r, "download the kept routing",
               cu.dtoh(hk, (CUdeviceptr)(uintptr_t)kept.ptr, sizeof hk, stream)) ||
        !cu_ok(r, "sync", cu.stream_synchronize(stream)))
      goto out;
    int ok_slots = kept.len == T * TOPK, ok_kept = ok_slots;
    for (int t = 0; t < T; t++)
      for (int k = 0; k < TOPK; k++) {
        ok_slots &= slots[t * TOPK + k] == (t >= KEPT);
        ok_kept &= hk[t * TOPK + k] == (t >= KEPT ? -1 : 2 * k);
      }
    report(r, "dropped slots: tokens 6 and 7, both experts", ok_slots, NULL);
    report(r, "kept routing: -1 on the dropped slots, the experts elsewhere", ok_kept, NULL);
  }
  /* The group's own receive buffers ([recv_capacity, H]), not the window `da` names. */
  moe_ep_dispatch_args_t dd = MOE_EP_DISPATCH_ARGS_INIT;
  dd.x = da.x;
  dd.topk_weights = da.topk_weights;
  CHECK(moe_ep_dispatch(drop_group, stream, drop_handle, &dd, &dropped), "dispatch (overflow drop)");
  {
    moe_ep_recv_buffers_t db = MOE_EP_RECV_BUFFERS_INIT;
    CHECK(moe_ep_dispatched_buffers(dropped, &db), "dispatched_buffers (overflow drop)");
    static uint16_t got[WORLD][DROP_CAP * HIDDEN];
    if (!cu_ok(r, "sync", cu.stream_synchronize(stream)) ||
        !cu_ok(r, "download the kept rows",
               cu.dtoh(got[r], (CUdeviceptr)(uintptr_t)db.tokens.ptr, sizeof got[r], stream)) ||
        !cu_ok(r, "sync", cu.stream_synchronize(stream)))
      goto out;
    int ok = db.tokens.len == DROP_CAP * HIDDEN;
    char why[256];
    snprintf(why, sizeof why, "tokens.len %zu (want %d)", (size_t)db.tokens.len,
             DROP_CAP * HIDDEN);
    for (int s = 0; s < WORLD; s++)
      for (int t = 0; t < KEPT; t++)
        for (int h = 0; h < HIDDEN; h++) {
          const uint16_t g = got[r][(s * KEPT + t) * HIDDEN + h], w = bf16(token(s, t, h));
          if (g != w && ok)
            snprintf(why, sizeof why, "row %d (source %d, token %d) value %d: 0x%04x, want 0x%04x",
                     s * KEPT + t, s, t, h, g, w);
          ok &= g == w;
        }
    report(r, "kept rows: row s * 6 + t is token t < 6 of rank s", ok, ok ? NULL : why);
    moe_ep_combine_args_t dc = MOE_EP_COMBINE_ARGS_INIT;
    dc.expert_out = (moe_ep_buf_t){db.tokens.ptr, db.tokens.len};
    dc.out = (moe_ep_buf_mut_t){(void *)(uintptr_t)out, T * HIDDEN};
    CHECK(moe_ep_combine(drop_group, stream, drop_handle, &dc), "combine (overflow drop)");
    static uint16_t sum[WORLD][T * HIDDEN];
    if (!cu_ok(r, "sync", cu.stream_synchronize(stream)) ||
        !cu_ok(r, "download out", cu.dtoh(sum[r], out, sizeof sum[r], stream)) ||
        !cu_ok(r, "sync", cu.stream_synchronize(stream)))
      goto out;
    ok = 1;
    for (int i = 0; i < T * HIDDEN; i++) {
      int t = i / HIDDEN;
      ok &= sum[r][i] == (t < KEPT ? bf16(2.0f * token(r, t, i % HIDDEN)) : 0);
    }
    report(r, "combine: 2 x for kept tokens, zeros for dropped ones", ok, NULL);
  }
  CHECK(moe_ep_group_check(drop_group), "group_check (overflow drop)");

  /* 8: the C ABI's own check refuses rank 1's dispatch (x NULL with a
   * length); the refusal is published, so rank 0 does not wait for it.
   * Handles made before the error are refused: then a new layout's round
   * trip, into the group's own buffers. */
  pthread_barrier_wait(a->line);
  {
    moe_ep_dispatch_args_t ra = MOE_EP_DISPATCH_ARGS_INIT;
    ra.x = da.x;
    ra.topk_weights = da.topk_weights;
    if (r == 1) ra.x.ptr = NULL;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    moe_ep_status_t d = moe_ep_dispatch(group, stream, handle, &ra, &refused);
    expect_published(r, group, "dispatch with x NULL", d, "`x`", &t0);
    moe_ep_dispatched_destroy(refused);
    refused = NULL;
  }
  if (!round_trip_2x(r, group, stream, &la, &da, out, "after the refused dispatch")) goto out;

  /* 9: the same for a layout (an unknown layout code on rank 1) and for a
   * combine (expert_out NULL with a length on rank 1, after a dispatch that
   * ran on both), each followed by a round trip. */
  pthread_barrier_wait(a->line);
  {
    moe_ep_layout_args_t rl = la;
    if (r == 1) rl.layout = 7;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    moe_ep_status_t l = moe_ep_layout(group, stream, &rl, &again);
    expect_published(r, group, "layout with layout code 7", l, "`layout`", &t0);
    moe_ep_handle_destroy(again);
    again = NULL;
  }
  if (!round_trip_2x(r, group, stream, &la, &da, out, "after the refused layout")) goto out;
  pthread_barrier_wait(a->line);
  CHECK(moe_ep_layout(group, stream, &la, &again), "layout before the refused combine");
  {
    moe_ep_dispatch_args_t ga = MOE_EP_DISPATCH_ARGS_INIT;
    ga.x = da.x;
    ga.topk_weights = da.topk_weights;
    CHECK(moe_ep_dispatch(group, stream, again, &ga, &redone), "dispatch before the refused combine");
    moe_ep_recv_buffers_t gb = MOE_EP_RECV_BUFFERS_INIT;
    CHECK(moe_ep_dispatched_buffers(redone, &gb), "dispatched_buffers before the refused combine");
    moe_ep_combine_args_t rc = MOE_EP_COMBINE_ARGS_INIT;
    rc.expert_out = (moe_ep_buf_t){r == 1 ? NULL : gb.tokens.ptr, gb.tokens.len};
    rc.out = (moe_ep_buf_mut_t){(void *)(uintptr_t)out, T * HIDDEN};
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    moe_ep_status_t c = moe_ep_combine(group, stream, again, &rc);
    expect_published(r, group, "combine with expert_out NULL", c, "`expert_out`", &t0);
  }
  if (!round_trip_2x(r, group, stream, &la, &da, out, "after the refused combine")) goto out;

  /* 10: a low-latency dispatch refused by the C ABI's own check on rank 1
   * (x NULL with a length): its send tells every home, rank 0's dispatch
   * stops, the checks name it; then a batch round trip (rank-major,
   * identity experts of weight 1: each rank's received rows are its
   * expert's outputs, summed home to 2 x). */
  pthread_barrier_wait(a->line);
  {
    moe_ep_ll_dispatch_args_t lr = MOE_EP_LL_DISPATCH_ARGS_INIT;
    lr.x = da.x;
    lr.topk_idx = la.topk_idx;
    lr.topk_idx_dtype = MOE_EP_DTYPE_I64;
    lr.topk_weights = da.topk_weights;
    lr.topk = TOPK;
    lr.layout = MOE_EP_LAYOUT_RANK_MAJOR;
    moe_ep_ll_dispatch_args_t bad_x = lr;
    if (r == 1) bad_x.x.ptr = NULL;
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    moe_ep_status_t d = moe_ep_ll_dispatch(ll_group, stream, &bad_x, &ll_refused);
    expect_published(r, ll_group, "low-latency dispatch with x NULL", d, "`x`", &t0);
    moe_ep_ll_handle_destroy(ll_refused);
    ll_refused = NULL;
    moe_ep_ll_handle_t *b = NULL;
    int ok = 0;
    if (expect(r, "low-latency dispatch after the refusal", moe_ep_ll_dispatch(ll_group, stream, &lr, &b),
               MOE_EP_OK, NULL)) {
      moe_ep_ll_buffers_t lb = MOE_EP_LL_BUFFERS_INIT;
      moe_ep_ll_combine_args_t lc = MOE_EP_LL_COMBINE_ARGS_INIT;
      if (expect(r, "ll_handle_buffers", moe_ep_ll_handle_buffers(b, &lb), MOE_EP_OK, NULL)) {
        lc.expert_out = lb.tokens;
        lc.out = (moe_ep_buf_mut_t){(void *)(uintptr_t)out, T * HIDDEN};
        ok = expect(r, "low-latency combine after the refusal",
                    moe_ep_ll_combine(ll_group, stream, b, &lc), MOE_EP_OK, NULL);
      }
    }
    if (ok) {
      static uint16_t sum[WORLD][T * HIDDEN];
      if (!cu_ok(r, "sync", cu.stream_synchronize(stream)) ||
          !cu_ok(r, "download out", cu.dtoh(sum[r], out, sizeof sum[r], stream)) ||
          !cu_ok(r, "sync", cu.stream_synchronize(stream)))
        ok = 0;
      int same = ok;
      for (int i = 0; ok && i < T * HIDDEN; i++)
        same &= sum[r][i] == bf16(2.0f * token(r, i / HIDDEN, i % HIDDEN));
      report(r, "the low-latency round trip after the refusal is 2 x", same, NULL);
    }
    moe_ep_ll_handle_destroy(b);
    expect(r, "group_check (low latency) after the round trip", moe_ep_group_check(ll_group),
           MOE_EP_OK, NULL);
  }

out:
  /* Every rank is done with its peers' windows before anything goes. */
  pthread_barrier_wait(a->line);
  moe_ep_dispatched_destroy(dispatched);
  moe_ep_dispatched_destroy(fp8);
  moe_ep_dispatched_destroy(dropped);
  moe_ep_dispatched_destroy(refused);
  moe_ep_dispatched_destroy(redone);
  moe_ep_handle_destroy(handle);
  moe_ep_handle_destroy(drop_handle);
  moe_ep_handle_destroy(again);
  moe_ep_buffer_free(window);
  moe_ep_group_destroy(group);
  moe_ep_group_destroy(drop_group);
  moe_ep_ll_handle_destroy(ll_refused);
  moe_ep_group_destroy(ll_group);
  pthread_barrier_wait(a->line);
  if (win) nccl.window_deregister(nc, win);
  if (nccl_mem) nccl.mem_free(nccl_mem);
  if (!a->nccl && base) cu.mem_free(base);
  if (x) cu.mem_free(x);
  if (w) cu.mem_free(w);
  if (idx) cu.mem_free(idx);
  if (out) cu.mem_free(out);
  if (codes) cu.mem_free(codes);
  if (scales) cu.mem_free(scales);
  if (stream) cu.stream_destroy(stream);
  moe_ep_comm_destroy(comm);
  if (nc) nccl.comm_destroy(nc);
  free(host);
  return NULL;
}

int main(void) {
  int gpus = 0;
  if (!load_cuda() || cu.device_get_count(&gpus) != 0 || gpus == 0) {
    printf("SKIP: " TEST ": no GPU (no CUDA driver, or no device)\n");
    return 0;
  }
  /* A rank that fails can leave its peer in a collective: end the test. */
  alarm(300);
  struct rank_args a[WORLD];
  pthread_barrier_t line;
  pthread_barrier_init(&line, NULL, WORLD);
  int use_nccl = gpus >= 2 && load_nccl();
  nccl_id_t id;
  memset(&id, 0, sizeof id);
  moe_ep_comm_t *comms[WORLD] = {NULL, NULL};
  if (use_nccl) {
    if (nccl.get_unique_id(&id) != 0) {
      printf("FAILED: ncclGetUniqueId\n");
      return 1;
    }
    printf(TEST ": 2 NCCL ranks on GPUs 0 and 1, an NCCL window (moe_ep_pool_wrap_window)\n");
  } else {
    moe_ep_status_t s = moe_ep_comm_create_virtual(0, WORLD, comms);
    if (s != MOE_EP_OK) {
      printf("FAILED: moe_ep_comm_create_virtual: %s: %s\n", moe_ep_status_name(s),
             moe_ep_last_error());
      return 1;
    }
    printf(TEST ": 2 virtual ranks on GPU 0, a device buffer (moe_ep_pool_wrap_device)\n");
  }
  pthread_t th[WORLD];
  for (int r = 0; r < WORLD; r++) {
    a[r] = (struct rank_args){r, use_nccl, id, comms[r], &line};
    pthread_create(&th[r], NULL, run_rank, &a[r]);
  }
  for (int r = 0; r < WORLD; r++) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&line);
  printf("%s: %d failures\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
