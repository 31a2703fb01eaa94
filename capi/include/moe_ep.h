/*
 * moe_ep.h: the C ABI of moe-ep (expert-parallel layout, dispatch and
 * combine over NVLink), for C and C++ runtimes.
 *
 * Link against libmoe_ep.so (or libmoe_ep.a plus -lgcc_s -lutil -lrt
 * -lpthread -lm -ldl -lc); capi/install.sh PREFIX installs both with this
 * header, a pkg-config file (pkg-config --cflags --libs moe_ep) and a CMake
 * package (find_package(moe_ep): moe_ep::moe_ep, moe_ep::moe_ep_static).
 * The kernels are embedded in the library; the CUDA driver
 * (libcuda) and NCCL (libnccl.so.2, or MOE_EP_NCCL_LIBRARY) are loaded at
 * run time, so nothing here needs the CUDA toolkit or NCCL headers: a
 * cudaStream_t or CUstream converts to moe_ep_stream_t, an ncclComm_t to
 * struct ncclComm *.
 *
 * Conventions, for every function:
 *   - The return value is a moe_ep_status_t; MOE_EP_OK is 0. On failure
 *     moe_ep_last_error() holds a message naming the argument and what was
 *     expected (per thread, valid until the next failing call of that
 *     thread). No call aborts or unwinds into the caller: a bug inside the
 *     library is MOE_EP_ERR_INTERNAL.
 *   - Every struct with `size` and `magic` first is versioned: initialise it
 *     with its MOE_EP_*_INIT macro (which sets both, every other field to 0 =
 *     the default), then set the fields you need. A newer library accepts
 *     the smaller struct of an older header (fields it lacks take their
 *     defaults); a struct larger than the library knows is accepted only
 *     when the extra bytes are zero. A wrong magic or a size below the
 *     first version's is refused with MOE_EP_ERR_INVALID_ARGUMENT naming the
 *     argument and the struct. Output structs are filled up to their `size`.
 *   - Buffers are (device pointer, element count) pairs; the element type is
 *     the one the field documents. {NULL, 0} is "not given" where a buffer
 *     is optional and an empty buffer where it is not; NULL with a nonzero
 *     count is refused. The library checks what it can, as the Rust API
 *     does: every buffer long enough, device memory of the group's GPU,
 *     token rows 16-byte aligned, outputs overlapping no input or other
 *     output of the call; each failure names the field. What C cannot show
 *     and the caller promises (the obligations of the Rust API's unsafe
 *     DeviceRegion traits): each buffer is one live allocation of at least
 *     `len` elements that stays allocated, and is not written by anyone
 *     else outside stream order, until the work enqueued with it has
 *     finished; an output is written by nothing else meanwhile.
 *   - Streams: every op is enqueued on the caller's stream and never waits
 *     on the host unless it says so. A stream must belong to the primary
 *     context of the communicator's device (the CUDA runtime's context) and
 *     must stay valid until the group, and every handle and result made on
 *     it, are destroyed. Ops of one group on different streams are ordered
 *     after each other by the library.
 *   - Collective calls (marked "collective") are made by every rank of the
 *     communicator, in the same order: on virtual ranks, each rank from its
 *     own thread at the same time.
 *   - Handles (moe_ep_comm_t, moe_ep_group_t, ...) are opaque; a destroy
 *     function takes NULL and does nothing. A group holds its communicator,
 *     so destroying the communicator first is allowed; a low-latency handle
 *     holds its group in the same way (see "low-latency mode" below).
 */
#ifndef MOE_EP_H
#define MOE_EP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library version this header belongs to (the crate's), and its ABI
 * version. MOE_EP_ABI_VERSION grows by one with every release that adds to
 * the ABI: functions, enum values, structs, fields appended to a versioned
 * struct. Nothing is removed, reordered or given another meaning, so a
 * caller built against ABI N runs against every library whose
 * moe_ep_abi_version() is at least N (check it once at start-up); a change
 * that broke this would come with a new library name. ABI 2 added the
 * low-latency mode (MOE_EP_MODE_LOW_LATENCY and the moe_ep_ll_* calls), ABI 3
 * moe_ep_group_config_t.ranks_per_node, ABI 4 the caller's own symmetric
 * memory (moe_ep_pool_wrap_window, moe_ep_pool_wrap_device) and ranges of a
 * buffer (moe_ep_buffer_range), ABI 5 what a TransformerEngine-style runtime
 * needs: the fp8 dispatch (moe_ep_dispatch_fp8, moe_ep_fp8_scales_t,
 * moe_ep_recv_buffers_t.scales and .scale_kind), the padding and overflow
 * policies (moe_ep_group_config_t.padding and .overflow), eager sizing and
 * the drop policy's results (moe_ep_handle_counts_t.max_recv_rows and
 * .dropped_rows, moe_ep_handle_dropped_rows, moe_ep_handle_dropped_slots,
 * moe_ep_handle_kept_topk_idx) and the memory footprint
 * (moe_ep_group_memory_footprint, moe_ep_handle_device_bytes), ABI 6 the
 * bound on the host collectives' wait (moe_ep_comm_host_timeout,
 * moe_ep_comm_set_host_timeout).
 *
 * That name is the shared library's SONAME, libmoe_ep.so.1: its number is
 * the ABI's major version, which only such a breaking change raises, so a
 * program linked against any ABI of major 1 loads every later library of
 * major 1 and never one of another major. The library is installed as
 * libmoe_ep.so.<major>.<MOE_EP_ABI_VERSION> (now libmoe_ep.so.1.6) with the
 * links libmoe_ep.so.1 and libmoe_ep.so; the pkg-config and CMake packages
 * have the version <major>.<MOE_EP_ABI_VERSION> (1.6): a caller of ABI N
 * asks for at least 1.N. */
#define MOE_EP_VERSION_MAJOR 0
#define MOE_EP_VERSION_MINOR 1
#define MOE_EP_VERSION_PATCH 0
#define MOE_EP_ABI_VERSION 6

/* ---- status codes ---------------------------------------------------- */

typedef enum moe_ep_status {
  MOE_EP_OK = 0,
  MOE_EP_ERR_INVALID_ARGUMENT = 1,   /* names the argument and what was expected */
  MOE_EP_ERR_NOT_SYMMETRIC = 2,      /* a buffer zero copy needs is not symmetric memory */
  MOE_EP_ERR_CAPACITY_EXCEEDED = 3,  /* receive rows over the group's capacity */
  MOE_EP_ERR_PEER_TIMEOUT = 4,       /* a wait on another GPU timed out: destroy the group */
  MOE_EP_ERR_COLLECTIVE_FAILED = 5,  /* a host collective failed (a rank did not come in time) */
  MOE_EP_ERR_INVALID_DEVICE_DATA = 6,/* e.g. an expert id out of range, seen on the GPU */
  MOE_EP_ERR_NO_DRIVER = 7,          /* no usable CUDA driver */
  MOE_EP_ERR_NOT_ENOUGH_GPUS = 8,
  MOE_EP_ERR_CUDA = 9,               /* a CUDA driver call failed */
  MOE_EP_ERR_NCCL_LIBRARY = 10,      /* libnccl not found or lacks a symbol */
  MOE_EP_ERR_NCCL_VERSION = 11,      /* libnccl older than the headers built against */
  MOE_EP_ERR_NCCL = 12,              /* an NCCL call failed */
  MOE_EP_ERR_MODULE = 13,            /* no kernel image for this GPU */
  MOE_EP_ERR_INVALID_STATE = 14,     /* e.g. an aborted communicator */
  MOE_EP_ERR_IO = 15,
  MOE_EP_ERR_INTERNAL = 16,          /* a bug in the library (a caught panic) */
  MOE_EP_ERR_PEER_FAILED = 17        /* another rank refused its part of the op (a bad argument
                                        there) or skipped it after an error: call
                                        moe_ep_group_check on every rank */
} moe_ep_status_t;

/* Element types (0 is no type, so that a zeroed field is refused). */
typedef enum moe_ep_dtype {
  MOE_EP_DTYPE_BF16 = 1,
  MOE_EP_DTYPE_F32 = 2,
  MOE_EP_DTYPE_I32 = 3,
  MOE_EP_DTYPE_I64 = 4,
  MOE_EP_DTYPE_U8 = 5
} moe_ep_dtype_t;

/* Receive layouts (moe_ep_layout_args_t.layout, moe_ep_ll_dispatch_args_t.layout). */
typedef enum moe_ep_recv_layout {
  MOE_EP_LAYOUT_RANK_MAJOR = 0,   /* one row per (token, rank), grouped by source rank */
  MOE_EP_LAYOUT_EXPERT_MAJOR = 1  /* one row per (token, local expert), blocks padded to `alignment` */
} moe_ep_recv_layout_t;

/* Kernel families (moe_ep_group_config_t.mode). */
typedef enum moe_ep_mode {
  MOE_EP_MODE_HIGH_THROUGHPUT = 0, /* training, prefill: moe_ep_layout, moe_ep_dispatch, ... */
  MOE_EP_MODE_LOW_LATENCY = 1      /* decode (ABI 2): the moe_ep_ll_* calls */
} moe_ep_mode_t;

/* How a low-latency dispatch's rows travel (moe_ep_ll_dispatch_args_t.payload). */
typedef enum moe_ep_ll_payload {
  MOE_EP_LL_BF16 = 0,                /* x bf16, sent as bf16 */
  MOE_EP_LL_CAST_FP8_EXACT = 1,      /* x bf16, cast to fp8 e4m3 by the sender: scale = amax / 448 */
  MOE_EP_LL_CAST_FP8_POWER_OF_TWO = 2,/* the same with scale = 2^ceil(log2(amax / 448)) */
  MOE_EP_LL_FP8 = 3                  /* the caller's fp8 rows (x codes, x_scales), sent as they are */
} moe_ep_ll_payload_t;

/* Where a low-latency handle's batch is (moe_ep_ll_handle_info_t.state). */
typedef enum moe_ep_ll_state {
  MOE_EP_LL_SENT = 1,          /* moe_ep_ll_dispatch_send done; wait for it */
  MOE_EP_LL_RECEIVED = 2,      /* dispatched: the buffers are there */
  MOE_EP_LL_COMBINE_SENT = 3,  /* moe_ep_ll_combine_send done; wait for it */
  MOE_EP_LL_COMBINED = 4
} moe_ep_ll_state_t;

/* Expert-major padding rows (moe_ep_group_config_t.padding, ABI 5). */
typedef enum moe_ep_padding {
  MOE_EP_PADDING_ZERO = 0,      /* zero codes, rows and scales of each expert's padding rows */
  MOE_EP_PADDING_UNTOUCHED = 1  /* leave them as they are (a grouped GEMM that takes per-expert
                                   counts never reads them); their weights, ids and sources are
                                   marked either way (0, -1, (-1, -1)) */
} moe_ep_padding_t;

/* Rows over a rank's recv_capacity (moe_ep_group_config_t.overflow, ABI 5). */
typedef enum moe_ep_overflow {
  MOE_EP_OVERFLOW_ERROR = 0,  /* every rank stops in that call, MOE_EP_ERR_CAPACITY_EXCEEDED
                                 (moe_ep_group_check reports it); nothing is written */
  MOE_EP_OVERFLOW_DROP = 1    /* the rows past the capacity are dropped, the same way on every
                                 rank (see moe_ep_group_config_t.overflow); one node only */
} moe_ep_overflow_t;

/* The block scales of fp8 rows (moe_ep_dispatch_fp8_args_t.scale_kind,
 * moe_ep_recv_buffers_t.scale_kind; ABI 5). */
typedef enum moe_ep_fp8_scales {
  MOE_EP_FP8_SCALES_NONE = 0,         /* no scales: bf16 rows (a result's kind only) */
  MOE_EP_FP8_SCALES_E8M0_PER_32 = 1,  /* MXFP8: one e8m0 exponent byte per 32 values, [rows, hidden / 32] u8 */
  MOE_EP_FP8_SCALES_F32_PER_128 = 2   /* one f32 per 128 values (DeepEP's recipe), [rows, hidden / 128] f32 */
} moe_ep_fp8_scales_t;

/* ---- opaque handles ---------------------------------------------------- */

typedef struct moe_ep_comm moe_ep_comm_t;             /* one rank of a world */
typedef struct moe_ep_group moe_ep_group_t;           /* an expert-parallel group */
typedef struct moe_ep_handle moe_ep_handle_t;         /* the routing of one batch (layout) */
typedef struct moe_ep_buffer moe_ep_buffer_t;         /* a symmetric buffer of a group's pool */
typedef struct moe_ep_dispatched moe_ep_dispatched_t; /* what a dispatch received */
typedef struct moe_ep_ll_handle moe_ep_ll_handle_t;   /* one low-latency batch (ABI 2) */

/* A CUDA stream: cudaStream_t and CUstream are both `struct CUstream_st *`. */
typedef struct CUstream_st *moe_ep_stream_t;
/* ncclComm_t is `struct ncclComm *`. */
struct ncclComm;
/* ncclWindow_t (NCCL >= 2.28) is `struct ncclWindow_vidmem *`. */
struct ncclWindow_vidmem;

/* ---- buffers ------------------------------------------------------------ */

typedef struct moe_ep_buf {      /* an input: read only */
  const void *ptr;               /* device address */
  size_t len;                    /* elements */
} moe_ep_buf_t;

typedef struct moe_ep_buf_mut {  /* an output */
  void *ptr;
  size_t len;
} moe_ep_buf_mut_t;

/* ---- versioned structs -------------------------------------------------- */

#define MOE_EP_MAGIC_VERSION_INFO 0x4d4f4501u
#define MOE_EP_MAGIC_GROUP_CONFIG 0x4d4f4502u
#define MOE_EP_MAGIC_LAYOUT_ARGS 0x4d4f4503u
#define MOE_EP_MAGIC_DISPATCH_ARGS 0x4d4f4504u
#define MOE_EP_MAGIC_COMBINE_ARGS 0x4d4f4505u
#define MOE_EP_MAGIC_COMBINE_BACKWARD_ARGS 0x4d4f4506u
#define MOE_EP_MAGIC_DISPATCH_BACKWARD_ARGS 0x4d4f4507u
#define MOE_EP_MAGIC_RECV_BUFFERS 0x4d4f4508u
#define MOE_EP_MAGIC_HANDLE_COUNTS 0x4d4f4509u
#define MOE_EP_MAGIC_LL_DISPATCH_ARGS 0x4d4f450au
#define MOE_EP_MAGIC_LL_COMBINE_ARGS 0x4d4f450bu
#define MOE_EP_MAGIC_LL_HANDLE_INFO 0x4d4f450cu
#define MOE_EP_MAGIC_LL_BUFFERS 0x4d4f450du
#define MOE_EP_MAGIC_DISPATCH_FP8_ARGS 0x4d4f450eu
#define MOE_EP_MAGIC_MEMORY_FOOTPRINT 0x4d4f450fu

/* Output of moe_ep_version. */
typedef struct moe_ep_version_info {
  uint32_t size;
  uint32_t magic;
  uint32_t major, minor, patch;  /* library version */
  uint32_t abi_version;          /* MOE_EP_ABI_VERSION of the library */
  int32_t nccl_headers_version;  /* NCCL_VERSION_CODE built against, e.g. 22809 */
  uint32_t reserved;
} moe_ep_version_info_t;
#define MOE_EP_VERSION_INFO_INIT {sizeof(moe_ep_version_info_t), MOE_EP_MAGIC_VERSION_INFO, 0, 0, 0, 0, 0, 0}

/* Sizes fixed when a group is created; the same on every rank. */
typedef struct moe_ep_group_config {
  uint32_t size;
  uint32_t magic;
  uint64_t num_experts;          /* over all ranks; a multiple of the world size */
  uint64_t hidden;               /* token width in bf16 elements; a multiple of 8 */
  uint64_t max_tokens_per_rank;  /* most tokens a rank passes to one layout (low latency: <= 1024) */
  uint64_t recv_capacity;        /* rows of the receive buffers; 0: world * max_tokens_per_rank */
  uint32_t num_sms;              /* SMs of the data kernels; 0: 24 */
  uint32_t combine_chunks;       /* pushed combine's pipeline depth 1, 2, 4, 8, 16; 0: 4 */
  uint32_t mode;                 /* moe_ep_mode_t; 0: high throughput (recv_capacity and
                                    combine_chunks are high throughput's only) */
  uint32_t timeout_ms;           /* bound on every wait for another GPU; 0: 10000 */
  uint64_t ranks_per_node;       /* (ABI 3) ranks per node, rank r on node r / ranks_per_node: a
                                    divisor of the world, at most 8; 0: the whole world on one
                                    node. Below the world size: several nodes, the two-level
                                    path (see moe_ep_group_create) */
  uint32_t padding;              /* (ABI 5) moe_ep_padding_t: expert-major padding rows (and
                                    the combine backward's) zeroed (0) or left untouched. Each
                                    rank's own choice (it writes only its own rows) */
  uint32_t overflow;             /* (ABI 5) moe_ep_overflow_t, the same on every rank; 0: an
                                    error. MOE_EP_OVERFLOW_DROP (high throughput, one node):
                                    a rank's senders share its capacity by water-filling
                                    (rank-major: the largest per-source quota that fits, then
                                    one more row for each source that has more, lowest rank
                                    first; expert-major: per local expert, in whole blocks of
                                    the alignment, lowest expert first), and each source or
                                    expert keeps its first rows in (source rank, token) order.
                                    A dropped (token, expert) is not sent, its combine adds
                                    nothing and its gradients are zero; see
                                    moe_ep_handle_dropped_slots, moe_ep_handle_dropped_rows,
                                    moe_ep_handle_kept_topk_idx */
} moe_ep_group_config_t;
#define MOE_EP_GROUP_CONFIG_INIT {sizeof(moe_ep_group_config_t), MOE_EP_MAGIC_GROUP_CONFIG, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

typedef struct moe_ep_layout_args {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_t topk_idx;         /* [T, topk] of topk_idx_dtype; -1 = not routed */
  uint32_t topk_idx_dtype;       /* MOE_EP_DTYPE_I32 or MOE_EP_DTYPE_I64 */
  uint32_t topk;
  uint32_t layout;               /* moe_ep_recv_layout_t */
  uint32_t alignment;            /* expert-major block granularity in rows (>= 1); rank-major: 0 */
} moe_ep_layout_args_t;
#define MOE_EP_LAYOUT_ARGS_INIT {sizeof(moe_ep_layout_args_t), MOE_EP_MAGIC_LAYOUT_ARGS, {0, 0}, 0, 0, 0, 0}

typedef struct moe_ep_dispatch_args {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_t x;                    /* [T, hidden] bf16 */
  moe_ep_buf_t topk_weights;         /* [T, topk] f32 */
  moe_ep_buf_mut_t recv_tokens;      /* optional, symmetric: [recv_capacity, hidden] bf16 (zero copy) */
  moe_ep_buf_mut_t recv_topk_weights;/* optional, symmetric: rank-major [recv_capacity, topk], expert-major [recv_capacity] f32 */
} moe_ep_dispatch_args_t;
#define MOE_EP_DISPATCH_ARGS_INIT {sizeof(moe_ep_dispatch_args_t), MOE_EP_MAGIC_DISPATCH_ARGS, {0, 0}, {0, 0}, {0, 0}, {0, 0}}

typedef struct moe_ep_combine_args {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_t expert_out;       /* [recv_capacity, hidden] bf16 in the handle's layout */
  moe_ep_buf_t weights;          /* optional, expert-major only: [recv_capacity] f32 */
  moe_ep_buf_mut_t out;          /* [T, hidden] bf16 */
} moe_ep_combine_args_t;
#define MOE_EP_COMBINE_ARGS_INIT {sizeof(moe_ep_combine_args_t), MOE_EP_MAGIC_COMBINE_ARGS, {0, 0}, {0, 0}, {0, 0}}

typedef struct moe_ep_combine_backward_args {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_t grad_out;             /* [T, hidden] bf16 */
  moe_ep_buf_t weights;              /* optional, expert-major only: [recv_capacity] f32 */
  moe_ep_buf_mut_t grad_expert_out;  /* optional, symmetric: [recv_capacity, hidden] bf16 */
} moe_ep_combine_backward_args_t;
#define MOE_EP_COMBINE_BACKWARD_ARGS_INIT {sizeof(moe_ep_combine_backward_args_t), MOE_EP_MAGIC_COMBINE_BACKWARD_ARGS, {0, 0}, {0, 0}, {0, 0}}

typedef struct moe_ep_dispatch_backward_args {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_t grad_recv_tokens;         /* [recv_capacity, hidden] bf16 */
  moe_ep_buf_t grad_recv_topk_weights;   /* optional, with grad_topk_weights */
  moe_ep_buf_mut_t grad_tokens;          /* [T, hidden] bf16 */
  moe_ep_buf_mut_t grad_topk_weights;    /* optional: [T, topk] f32 */
} moe_ep_dispatch_backward_args_t;
#define MOE_EP_DISPATCH_BACKWARD_ARGS_INIT {sizeof(moe_ep_dispatch_backward_args_t), MOE_EP_MAGIC_DISPATCH_BACKWARD_ARGS, {0, 0}, {0, 0}, {0, 0}, {0, 0}}

/* Output of moe_ep_dispatched_buffers: the receive buffers of a dispatch
 * (the caller's where given, else pool buffers owned by the result). `rows`
 * below is recv_capacity for pool buffers; a caller's buffers hold as many,
 * or, given after moe_ep_handle_counts, at least its max_recv_rows (eager
 * sizing). Rows past the handle's recv_rows are not written. */
typedef struct moe_ep_recv_buffers {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_mut_t tokens;        /* [rows, hidden] bf16; of moe_ep_dispatch_fp8: the e4m3 codes,
                                     [rows, hidden] u8 */
  moe_ep_buf_mut_t topk_weights;  /* rank-major [rows, topk], expert-major [rows] f32 */
  moe_ep_buf_mut_t topk_idx;      /* local expert ids, shaped as the weights, i32; -1 = none */
  moe_ep_buf_mut_t src;           /* [rows, 2] i32: (source rank, source token) */
  moe_ep_buf_mut_t scales;        /* (ABI 5) of moe_ep_dispatch_fp8: row i's scales beside row i,
                                     of scale_kind ([rows, hidden / 32] u8 or [rows, hidden / 128]
                                     f32); {NULL, 0} for bf16 rows */
  uint32_t scale_kind;            /* (ABI 5) moe_ep_fp8_scales_t; MOE_EP_FP8_SCALES_NONE for bf16 */
  uint32_t reserved;
} moe_ep_recv_buffers_t;
#define MOE_EP_RECV_BUFFERS_INIT {sizeof(moe_ep_recv_buffers_t), MOE_EP_MAGIC_RECV_BUFFERS, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, 0, 0}

/* Output of moe_ep_handle_counts. */
typedef struct moe_ep_handle_counts {
  uint32_t size;
  uint32_t magic;
  uint64_t num_tokens;           /* tokens of this rank */
  uint64_t topk;
  uint64_t recv_rows;            /* rows received here in the handle's layout (expert-major: padded) */
  uint64_t recv_tokens;          /* tokens received here */
  uint64_t num_local_experts;
  uint64_t max_recv_rows;        /* (ABI 5) the most rows any rank receives (the same on every
                                    rank): after this call, on one node, the buffers this rank
                                    passes to the handle's ops (dispatch's receive buffers,
                                    combine's expert_out and weights, the backward passes' row
                                    buffers) need only this many rows instead of recv_capacity,
                                    so a runtime can allocate exactly that (collectively) between
                                    layout and dispatch: eager sizing */
  uint64_t dropped_rows;         /* (ABI 5) rows dropped over all ranks (MOE_EP_OVERFLOW_DROP,
                                    else 0); per rank: moe_ep_handle_dropped_rows */
} moe_ep_handle_counts_t;
#define MOE_EP_HANDLE_COUNTS_INIT {sizeof(moe_ep_handle_counts_t), MOE_EP_MAGIC_HANDLE_COUNTS, 0, 0, 0, 0, 0, 0, 0}

/* Arguments of moe_ep_dispatch_fp8 (ABI 5): fp8 e4m3 codes and their block
 * scales, forwarded as given (x ~ e4m3(code) * scale of its block). */
typedef struct moe_ep_dispatch_fp8_args {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_t codes;                /* [T, hidden] u8 e4m3 codes, 16-byte aligned */
  moe_ep_buf_t scales;               /* of scale_kind: [T, hidden / 32] u8 e8m0, or
                                        [T, hidden / 128] f32 */
  uint32_t scale_kind;               /* moe_ep_fp8_scales_t: E8M0_PER_32 or F32_PER_128 (0 refused) */
  uint32_t reserved;                 /* 0 */
  moe_ep_buf_t topk_weights;         /* [T, topk] f32 */
  moe_ep_buf_mut_t recv_codes;       /* optional, symmetric: [rows, hidden] u8 (zero copy) */
  moe_ep_buf_mut_t recv_scales;      /* optional, symmetric, of scale_kind: [rows, hidden / 32] u8
                                        or [rows, hidden / 128] f32 */
  moe_ep_buf_mut_t recv_topk_weights;/* optional, symmetric: rank-major [rows, topk], expert-major
                                        [rows] f32 */
} moe_ep_dispatch_fp8_args_t;
#define MOE_EP_DISPATCH_FP8_ARGS_INIT {sizeof(moe_ep_dispatch_fp8_args_t), MOE_EP_MAGIC_DISPATCH_FP8_ARGS, {0, 0}, {0, 0}, 0, 0, {0, 0}, {0, 0}, {0, 0}, {0, 0}}

/* Output of moe_ep_group_memory_footprint (ABI 5): what one rank of a group
 * holds, in bytes. Everything but handles (moe_ep_handle_device_bytes) is
 * held from moe_ep_group_create to the group's destroy; receive buffers a
 * dispatch takes from the pool come and go within pool_other / pool_free. */
typedef struct moe_ep_memory_footprint {
  uint32_t size;
  uint32_t magic;
  uint64_t workspace;    /* the symmetric workspace: flags, count matrix, descriptors and, most
                            of it, the combine stage (about 4 * world * max_tokens * hidden) */
  uint64_t low_latency;  /* the low-latency buffer sets (moe_ep_ll_buffer_bytes); 0 in
                            high-throughput mode */
  uint64_t pool_other;   /* the pool's segments beside those: receive buffers and handles'
                            symmetric arrays in use now, and freed ranges kept for reuse */
  uint64_t pool_free;    /* of pool_other, the bytes in free ranges now */
  uint64_t two_level;    /* the two-level path's own device buffers; 0 on one node */
  uint64_t pinned_host;  /* pinned host memory (the error report the kernels write) */
  uint64_t device_total; /* workspace + low_latency + pool_other + two_level */
} moe_ep_memory_footprint_t;
#define MOE_EP_MEMORY_FOOTPRINT_INIT {sizeof(moe_ep_memory_footprint_t), MOE_EP_MAGIC_MEMORY_FOOTPRINT, 0, 0, 0, 0, 0, 0, 0}

/* Arguments of moe_ep_ll_dispatch and moe_ep_ll_dispatch_send (ABI 2). */
typedef struct moe_ep_ll_dispatch_args {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_t x;                /* [T, hidden] bf16; MOE_EP_LL_FP8: [T, hidden] e4m3 codes (u8) */
  moe_ep_buf_t x_scales;         /* MOE_EP_LL_FP8 only: [T, hidden / 128] f32; else not given */
  moe_ep_buf_t topk_idx;         /* [T, topk] of topk_idx_dtype, global expert ids; -1 = not routed */
  moe_ep_buf_t topk_weights;     /* [T, topk] f32 */
  uint32_t topk_idx_dtype;       /* MOE_EP_DTYPE_I32 or MOE_EP_DTYPE_I64 */
  uint32_t topk;                 /* 1..=16 */
  uint32_t layout;               /* moe_ep_recv_layout_t */
  uint32_t payload;              /* moe_ep_ll_payload_t; 0: bf16 (fp8: hidden a multiple of 128) */
} moe_ep_ll_dispatch_args_t;
#define MOE_EP_LL_DISPATCH_ARGS_INIT {sizeof(moe_ep_ll_dispatch_args_t), MOE_EP_MAGIC_LL_DISPATCH_ARGS, {0, 0}, {0, 0}, {0, 0}, {0, 0}, 0, 0, 0, 0}

/* Arguments of moe_ep_ll_combine; moe_ep_ll_combine_send reads expert_out,
 * moe_ep_ll_combine_wait weights and out (pass the same struct to both). */
typedef struct moe_ep_ll_combine_args {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_t expert_out;       /* [num_rows, hidden] bf16 in the dispatch's layout (counted rows read):
                                    expert-major one unweighted row per (token, expert); rank-major
                                    per row the sum of this rank's experts' weighted outputs */
  moe_ep_buf_t weights;          /* optional, expert-major only: [T, topk] f32 applied here (the
                                    home rank); not given: the dispatch's topk_weights */
  moe_ep_buf_mut_t out;          /* [T, hidden] bf16 */
} moe_ep_ll_combine_args_t;
#define MOE_EP_LL_COMBINE_ARGS_INIT {sizeof(moe_ep_ll_combine_args_t), MOE_EP_MAGIC_LL_COMBINE_ARGS, {0, 0}, {0, 0}, {0, 0}}

/* Output of moe_ep_ll_handle_info: the batch's shape (host values, no sync). */
typedef struct moe_ep_ll_handle_info {
  uint32_t size;
  uint32_t magic;
  uint64_t num_tokens;           /* T of this rank */
  uint64_t topk;
  uint64_t hidden;
  uint64_t num_rows;             /* rows of the layout: expert-major El * W * M, rank-major W * M */
  uint64_t num_local_experts;    /* El = num_experts / W */
  uint64_t world;                /* W */
  uint64_t max_tokens_per_rank;  /* M */
  uint32_t layout;               /* moe_ep_recv_layout_t */
  uint32_t fp8;                  /* 1: the rows are fp8 codes and scales, 0: bf16 */
  uint32_t buffer_set;           /* 0 or 1 */
  uint32_t state;                /* moe_ep_ll_state_t */
} moe_ep_ll_handle_info_t;
#define MOE_EP_LL_HANDLE_INFO_INIT {sizeof(moe_ep_ll_handle_info_t), MOE_EP_MAGIC_LL_HANDLE_INFO, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}

/* Output of moe_ep_ll_handle_buffers: where a dispatched batch is on this
 * rank, in the group's buffers (read only). {NULL, 0} where the batch has
 * none. Only counted rows are defined: expert-major the first
 * tokens_per_local_expert[j] rows of block j (rows j * W * M ...), each
 * expert's rows packed by (source rank, token); rank-major row s * M + t
 * for token t < tokens_from_rank[s] of rank s. */
typedef struct moe_ep_ll_buffers {
  uint32_t size;
  uint32_t magic;
  moe_ep_buf_t tokens;                   /* bf16 rows: [num_rows, hidden] bf16 */
  moe_ep_buf_t fp8_codes;                /* fp8 rows: [num_rows, hidden] e4m3 (u8) */
  moe_ep_buf_t fp8_scales;               /* fp8 rows: [num_rows, hidden / 128] f32 */
  moe_ep_buf_t src;                      /* [num_rows, 2] i32: (source rank, source token) */
  moe_ep_buf_t topk_local_idx;           /* rank-major: [W * M, topk] i32 local ids, -1 = not here */
  moe_ep_buf_t topk_weights;             /* rank-major: [W * M, topk] f32, 0 where not here */
  moe_ep_buf_t tokens_per_local_expert;  /* [El] i32 */
  moe_ep_buf_t tokens_per_expert_source; /* [El * W] i32: [j * W + s] rows of expert j from rank s */
  moe_ep_buf_t tokens_from_rank;         /* [W] i32: every rank's T */
} moe_ep_ll_buffers_t;
#define MOE_EP_LL_BUFFERS_INIT {sizeof(moe_ep_ll_buffers_t), MOE_EP_MAGIC_LL_BUFFERS, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}, {0, 0}}

/* An NCCL unique id (ncclUniqueId's 128 bytes). */
typedef struct moe_ep_unique_id {
  char internal[128];
} moe_ep_unique_id_t;

/* ---- version and errors ------------------------------------------------- */

uint32_t moe_ep_abi_version(void);
moe_ep_status_t moe_ep_version(moe_ep_version_info_t *out);
/* "0.1.0 (ABI 5, NCCL headers 2.28.9)"; static storage. */
const char *moe_ep_version_string(void);
/* The message of this thread's last failing call ("" if none). */
const char *moe_ep_last_error(void);
/* "MOE_EP_ERR_INVALID_ARGUMENT", ...; static storage. */
const char *moe_ep_status_name(moe_ep_status_t status);

/* ---- devices and communicators ----------------------------------------- */

moe_ep_status_t moe_ep_device_count(int *out);
/* A fresh NCCL unique id (rank 0 makes it and sends it to the others). */
moe_ep_status_t moe_ep_unique_id_create(moe_ep_unique_id_t *out);
/* Collective: this rank's NCCL communicator on GPU `device`, owned by the
 * returned handle. */
moe_ep_status_t moe_ep_comm_init(int device, const moe_ep_unique_id_t *id, int rank, int world,
                                 moe_ep_comm_t **out);
/* Collective over `nccl`: wraps the caller's NCCL communicator on GPU
 * `device`. It is never finalized, destroyed or aborted by the library; it
 * must outlive the returned handle and every group made from it. */
moe_ep_status_t moe_ep_comm_borrow_nccl(int device, struct ncclComm *nccl, moe_ep_comm_t **out);
/* `world` virtual ranks on GPU `device`, written to comms[0..world): give
 * each to its own thread, with its own stream (not the default stream). */
moe_ep_status_t moe_ep_comm_create_virtual(int device, int world, moe_ep_comm_t **comms);
moe_ep_status_t moe_ep_comm_destroy(moe_ep_comm_t *comm);
moe_ep_status_t moe_ep_comm_rank(const moe_ep_comm_t *comm, int *out);
moe_ep_status_t moe_ep_comm_world(const moe_ep_comm_t *comm, int *out);
/* The most SMs a group of `num_experts` may ask for on this communicator
 * (virtual ranks share one GPU's SMs). A group of several nodes
 * (`ranks_per_node`) whose ranks share a GPU takes one fewer: its combine's
 * network hop waits with one block per rank beside the node combine. */
moe_ep_status_t moe_ep_comm_max_sms(const moe_ep_comm_t *comm, uint64_t num_experts, uint32_t *out);
/* Unblocks pending NCCL calls; groups on it then refuse work. Never aborts a
 * borrowed NCCL communicator. */
moe_ep_status_t moe_ep_comm_abort(moe_ep_comm_t *comm);
/* (ABI 6) How long this rank's host collectives (the all-gathers of group
 * creation, moe_ep_group_check and the two-level layout) wait for the
 * slowest rank, in milliseconds: on NCCL 600000 unless set; on virtual
 * ranks the bound their creation set. Past it they fail with
 * MOE_EP_ERR_COLLECTIVE_FAILED and an owned NCCL communicator is aborted
 * (NCCL's call ends no other way; a borrowed one is left to its owner). */
moe_ep_status_t moe_ep_comm_host_timeout(const moe_ep_comm_t *comm, uint64_t *out_ms);
/* (ABI 6) Sets that bound on an NCCL communicator (alike on every rank); 0,
 * and virtual ranks (bound at creation), are refused naming `timeout`. */
moe_ep_status_t moe_ep_comm_set_host_timeout(const moe_ep_comm_t *comm, uint64_t timeout_ms);

/* ---- groups ---------------------------------------------------------------- */

/* Checks a config against a world size without a GPU. */
moe_ep_status_t moe_ep_group_config_validate(const moe_ep_group_config_t *cfg, int world);
/* Collective: validates the config, compares it between ranks, allocates
 * the symmetric workspace.
 *
 * A config whose ranks_per_node makes several nodes (2 to 64 nodes,
 * high-throughput mode) makes a group of the two-level path: a token crosses
 * the network once per remote node it reaches, to its rail peer there (the
 * rank with its local index), which forwards it over NVLink; combine sums
 * inside each node first, then over the nodes at home in a fixed order. The
 * ops and their arguments are the same; what differs: moe_ep_layout waits
 * on the host (the node streams' lengths; not capturable in a CUDA graph),
 * the ops use the caller's buffers on the op's stream as they are (no
 * ordering after another stream), moe_ep_pool_alloc gives the node's pool,
 * moe_ep_handle_counts gives this rank's rows of the node's dispatch, and
 * the moe_ep_ll_* calls refuse the group, naming `group`. A handle works
 * only with the group whose layout made it. */
moe_ep_status_t moe_ep_group_create(const moe_ep_comm_t *comm, const moe_ep_group_config_t *cfg,
                                    moe_ep_group_t **out);
/* Waits for the group's work, then frees it (at once, or, while low-latency
 * handles of it live, when the last of them is destroyed). */
moe_ep_status_t moe_ep_group_destroy(moe_ep_group_t *group);
/* Waits for the group's work on this rank, then learns what every rank found
 * since the last check and clears it. Collective: call it on every rank at the
 * same point (after the same ops); it ends in one all-gather of the
 * communicator. MOE_EP_OK when no rank found anything; otherwise every rank
 * gets an error (its own, or MOE_EP_ERR_PEER_FAILED naming the rank that had
 * one) and the group takes work again, every rank in the same state; handles
 * made before the error are refused (make new ones). After a timeout the
 * group stays unusable: destroy it. */
moe_ep_status_t moe_ep_group_check(const moe_ep_group_t *group);
/* Lets the group's ops be called on a stream that captures a CUDA graph
 * (refused with MOE_EP_ERR_INVALID_ARGUMENT naming `stream` until then).
 * The caller's contract: while such a graph can still be launched, every
 * buffer and handle a captured op was given (pool buffers too: their ranges'
 * reuse is not ordered after the graph's launches) stays alive, and the
 * group outlives the graph; every rank launches its graph the same number of
 * times, in the same order relative to the group's other ops. */
moe_ep_status_t moe_ep_group_allow_graph_capture(const moe_ep_group_t *group);
moe_ep_status_t moe_ep_group_recv_capacity(const moe_ep_group_t *group, uint64_t *out);
/* (ABI 5) The memory this rank of the group holds now, by category (no GPU
 * work; the pool's figures change as buffers come and go). On several
 * nodes: the node stage's group and the network hop's flags. */
moe_ep_status_t moe_ep_group_memory_footprint(const moe_ep_group_t *group,
                                              moe_ep_memory_footprint_t *out);

/* ---- symmetric memory -------------------------------------------------- */

/* Collective: `len` elements of `dtype` from the group's pool, at the same
 * offset on every rank (zero-copy receive buffers). */
moe_ep_status_t moe_ep_pool_alloc(const moe_ep_group_t *group, moe_ep_dtype_t dtype, size_t len,
                                  moe_ep_buffer_t **out);
/* Returns the range to the pool; do it once the work using it has finished
 * (or is ordered before the group's later ops). */
moe_ep_status_t moe_ep_buffer_free(moe_ep_buffer_t *buffer);
moe_ep_status_t moe_ep_buffer_get(const moe_ep_buffer_t *buffer, moe_ep_buf_mut_t *out);
/* *out = 1 when [ptr, ptr + bytes) lies in symmetric memory of the group's
 * communicator, else 0. */
moe_ep_status_t moe_ep_is_symm_backed(const moe_ep_group_t *group, const void *ptr, size_t bytes,
                                      int *out);

/* The caller's own symmetric memory (ABI 4). A runtime that owns its
 * payload buffers (TransformerEngine's EP backend: an NCCL window it
 * registered itself and a byte offset into it) wraps the window once and
 * passes ranges of it to the ops. Every op accepts, for every buffer, any
 * (pointer, length) that lies inside a registered window of the group's
 * communicator (moe_ep_is_symm_backed says 1): pool buffers, wrapped
 * windows, and ranges of either (moe_ep_buffer_range, or the caller's own
 * arithmetic on moe_ep_buffer_get's pointer). Such a buffer is symmetric:
 * it is located by its window and its offset in it, which must be the same
 * on every rank (the kernels compare them between ranks before they touch
 * a peer's copy), so zero copy works for receive tokens and weights
 * (moe_ep_dispatch_args_t.recv_tokens, .recv_topk_weights), expert outputs
 * read in place by combine (moe_ep_combine_args_t.expert_out: pulled over
 * NVLink), backward gradients, and any payload later ABIs add (the fp8
 * dispatch's scales among them).
 *
 * Collective: wraps `window`, a symmetric window (ncclCommWindowRegister
 * with NCCL_WIN_COLL_SYMMETRIC) the caller registered on the group's NCCL
 * communicator over `bytes` bytes at `base` on this rank (the same size on
 * every rank), and returns a u8 buffer over all of it (moe_ep_buffer_get:
 * {base, bytes}). Refused on every rank, naming `window`, when any rank's
 * window, base or size is NULL or 0, the sizes differ, or a rank's window is
 * not one of this communicator: its copy of this rank must be the memory at
 * `base` (the same cuMem allocation), which a window registered on another
 * communicator (where this process has another rank, or none) is not. Not
 * told apart: a window of another communicator over the same processes with
 * the same rank numbers (it maps the same memory, and works), and a `base`
 * elsewhere in the window's own allocation. Refused naming `window` on a
 * group of virtual ranks (they have no NCCL windows: use
 * moe_ep_pool_wrap_device). The window stays the caller's: keep it
 * registered, and its memory allocated, until the group is destroyed (the
 * group's pool keeps a record of it until then; moe_ep_buffer_free releases
 * only the returned handle). */
moe_ep_status_t moe_ep_pool_wrap_window(const moe_ep_group_t *group,
                                        struct ncclWindow_vidmem *window, void *base,
                                        size_t bytes, moe_ep_buffer_t **out);
/* Collective, on a group of virtual ranks (moe_ep_comm_create_virtual):
 * the counterpart of moe_ep_pool_wrap_window. Every rank registers its own
 * device buffer of `bytes` bytes at `base` (device memory of the group's
 * GPU, the same size on every rank, else refused naming `buffer`), so that
 * its siblings map it; returns a u8 buffer over all of it. Refused naming
 * `group` on a group of NCCL ranks. Keep the memory allocated until the
 * group is destroyed. */
moe_ep_status_t moe_ep_pool_wrap_device(const moe_ep_group_t *group, void *base, size_t bytes,
                                        moe_ep_buffer_t **out);
/* `len` elements of `dtype` starting `byte_offset` bytes into `buffer` (a
 * pool buffer or a wrapped window), as an op's argument: *out =
 * {address of the range, len}. Refused naming `byte_offset` when it is not a
 * multiple of the element's size, `len` when the range passes the buffer's
 * end, `dtype` when it is not a moe_ep_dtype_t. The range is symmetric
 * memory like its buffer; give every rank the same offset. The ops check the
 * rest (length for their shapes, 16-byte aligned token rows). */
moe_ep_status_t moe_ep_buffer_range(const moe_ep_buffer_t *buffer, uint64_t byte_offset,
                                    moe_ep_dtype_t dtype, size_t len, moe_ep_buf_mut_t *out);

/* ---- ops (collective, on the caller's stream) -------------------------- */

moe_ep_status_t moe_ep_layout(const moe_ep_group_t *group, moe_ep_stream_t stream,
                              const moe_ep_layout_args_t *args, moe_ep_handle_t **out);
moe_ep_status_t moe_ep_handle_destroy(moe_ep_handle_t *handle);
/* Copies the handle's counts to the host (synchronises `stream`). After it,
 * on one node, the caller's buffers of this rank's later ops of the handle
 * need hold only max_recv_rows rows, not recv_capacity (eager sizing). */
moe_ep_status_t moe_ep_handle_counts(const moe_ep_handle_t *handle, moe_ep_stream_t stream,
                                     moe_ep_handle_counts_t *out);
/* Unpadded (token, expert) rows per local expert, on the device (i32),
 * valid while the handle lives. */
moe_ep_status_t moe_ep_handle_tokens_per_local_expert(const moe_ep_handle_t *handle,
                                                      moe_ep_buf_t *out);
/* (ABI 5) Rows each rank dropped (MOE_EP_OVERFLOW_DROP, else zeros), by
 * receiving rank, into the host array `out` of `len` >= world entries
 * (rank-major: tokens; expert-major: (token, expert) rows); synchronises
 * `stream` (as moe_ep_handle_counts). Refused naming `out` (NULL) or `len`. */
moe_ep_status_t moe_ep_handle_dropped_rows(const moe_ep_handle_t *handle, moe_ep_stream_t stream,
                                           uint64_t *out, size_t len);
/* (ABI 5) This rank's dropped slots: out[t * topk + k] = 1 where token t's
 * k-th expert was routed and its row dropped at the receiver, else 0, into
 * the host array `out` of `len` >= T * topk bytes; synchronises `stream`.
 * All zeros without MOE_EP_OVERFLOW_DROP and on several nodes. */
moe_ep_status_t moe_ep_handle_dropped_slots(const moe_ep_handle_t *handle, moe_ep_stream_t stream,
                                            uint8_t *out, size_t len);
/* (ABI 5) The routing the layout kept: [T, topk] i32 on the device, the
 * caller's topk_idx with -1 for unrouted, bad and dropped slots (what a
 * runtime's own permutation or a grouped GEMM should route by), written by
 * the layout on its stream and valid while the handle lives. One node: a
 * handle of a group of several nodes is refused naming `handle`. */
moe_ep_status_t moe_ep_handle_kept_topk_idx(const moe_ep_handle_t *handle, moe_ep_buf_t *out);
/* (ABI 5) Device bytes the handle holds (its arrays and symmetric rows), on
 * top of the group's footprint. */
moe_ep_status_t moe_ep_handle_device_bytes(const moe_ep_handle_t *handle, uint64_t *out);

moe_ep_status_t moe_ep_dispatch(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                const moe_ep_handle_t *handle, const moe_ep_dispatch_args_t *args,
                                moe_ep_dispatched_t **out);
/* (ABI 5) moe_ep_dispatch of fp8 rows: the e4m3 codes and their block scales
 * (args->scale_kind), forwarded as given; each received row's scales land
 * beside it (same row index) in a buffer of the same kind. Both layouts;
 * expert-major padding rows get zero codes and scales unless the config's
 * padding is MOE_EP_PADDING_UNTOUCHED. hidden must be a multiple of 128
 * (else refused naming `hidden`). Every rank must send the same payload: a
 * rank whose dispatch is bf16 or whose scales are of the other kind makes
 * every rank stop naming `op`. *out is a moe_ep_dispatched_t as the bf16
 * dispatch's: moe_ep_dispatched_buffers gives the codes as `tokens` and the
 * scales as `scales`. Combine stays bf16 (moe_ep_combine of the experts'
 * bf16 outputs). One node only: a group of several nodes is refused naming
 * `ranks_per_node`. Errors before the op name the field: `codes`, `scales`,
 * `scale_kind`, `topk_weights`, `recv_codes`, `recv_scales`,
 * `recv_topk_weights` (the library's length checks of the inputs name
 * `x.codes` and `x.scales`). */
moe_ep_status_t moe_ep_dispatch_fp8(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                    const moe_ep_handle_t *handle,
                                    const moe_ep_dispatch_fp8_args_t *args,
                                    moe_ep_dispatched_t **out);
moe_ep_status_t moe_ep_dispatched_buffers(const moe_ep_dispatched_t *dispatched,
                                          moe_ep_recv_buffers_t *out);
/* Returns its pool buffers (not the caller's) to the pool; as moe_ep_buffer_free. */
moe_ep_status_t moe_ep_dispatched_destroy(moe_ep_dispatched_t *dispatched);

moe_ep_status_t moe_ep_combine(const moe_ep_group_t *group, moe_ep_stream_t stream,
                               const moe_ep_handle_t *handle, const moe_ep_combine_args_t *args);
/* *out receives a pool buffer when args->grad_expert_out is not given (else
 * NULL; `out` may then be NULL). */
moe_ep_status_t moe_ep_combine_backward(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                        const moe_ep_handle_t *handle,
                                        const moe_ep_combine_backward_args_t *args,
                                        moe_ep_buffer_t **out);
moe_ep_status_t moe_ep_dispatch_backward(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                         const moe_ep_handle_t *handle,
                                         const moe_ep_dispatch_backward_args_t *args);

/* ---- low-latency mode (ABI 2; groups of MOE_EP_MODE_LOW_LATENCY) -------
 *
 * For decode: no layout pass, no host synchronisation, no allocation per
 * call (CUDA-graph capturable). A batch is dispatched (one call, or send
 * then wait with other work between), the experts read its rows through
 * moe_ep_ll_handle_buffers, and it is combined (one call, or send then
 * wait). Batches alternate between two buffer sets fixed at group
 * creation; a set takes a new batch only after its previous batch was
 * combined (a third dispatch is refused before that, MOE_EP_ERR_INVALID_STATE),
 * and a handle's buffers hold its batch until then.
 *
 * Lifetimes: a moe_ep_ll_handle_t holds its group, so destroying the group
 * first is allowed; the group's memory is then released when its last
 * handle is destroyed (as a group destroy releases it: collective, so make
 * the last of them the same call on every rank). A call that fails leaves
 * the handle in its state: a wait refused (a short `out`, a stream of
 * another context) can be made again once fixed. After an error the GPU
 * found, moe_ep_group_check on every rank frees both buffer sets; handles
 * of earlier batches are then refused by name. */

/* Bytes a low-latency group of `cfg` over `world` ranks allocates for its
 * two buffer sets (whatever cfg->mode says; the high-throughput workspace
 * every group has comes on top): *symmetric from the group's pool, *local
 * plain device memory. About 4 * hidden * M * (E + W + 16) in all. Either
 * output may be NULL. No GPU needed. */
moe_ep_status_t moe_ep_ll_buffer_bytes(const moe_ep_group_config_t *cfg, int world,
                                       uint64_t *symmetric, uint64_t *local);
/* Collective: every token of this rank to the ranks of its experts, in
 * args->layout; *out is a MOE_EP_LL_RECEIVED handle. Errors only the GPU
 * sees (an expert id outside [-1, E) or repeated in a token, ranks that
 * disagree on topk, layout or payload) make every rank's later ops refuse
 * until moe_ep_group_check. */
moe_ep_status_t moe_ep_ll_dispatch(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                   const moe_ep_ll_dispatch_args_t *args, moe_ep_ll_handle_t **out);
/* The first half of moe_ep_ll_dispatch: sends and returns at once with a
 * MOE_EP_LL_SENT handle. */
moe_ep_status_t moe_ep_ll_dispatch_send(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                        const moe_ep_ll_dispatch_args_t *args,
                                        moe_ep_ll_handle_t **out);
/* The second half: waits on the stream (bounded by the group's timeout)
 * for every rank's rows and lays them out; SENT -> RECEIVED. */
moe_ep_status_t moe_ep_ll_dispatch_wait(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                        moe_ep_ll_handle_t *handle);
/* Collective: the expert outputs brought home and summed per token in f32
 * in a fixed order into args->out (expert-major: the weights applied here,
 * slot by slot; rank-major: the ranks' rows, rank by rank); a token with no
 * expert gets zeros. RECEIVED -> COMBINED. */
moe_ep_status_t moe_ep_ll_combine(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                  moe_ep_ll_handle_t *handle, const moe_ep_ll_combine_args_t *args);
/* The first half of moe_ep_ll_combine (reads args->expert_out); RECEIVED ->
 * COMBINE_SENT. */
moe_ep_status_t moe_ep_ll_combine_send(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                       moe_ep_ll_handle_t *handle,
                                       const moe_ep_ll_combine_args_t *args);
/* The second half (reads args->weights and args->out); COMBINE_SENT -> COMBINED. */
moe_ep_status_t moe_ep_ll_combine_wait(const moe_ep_group_t *group, moe_ep_stream_t stream,
                                       moe_ep_ll_handle_t *handle,
                                       const moe_ep_ll_combine_args_t *args);
/* The batch's shape and state, in any state. */
moe_ep_status_t moe_ep_ll_handle_info(const moe_ep_ll_handle_t *handle,
                                      moe_ep_ll_handle_info_t *out);
/* The batch's device buffers: RECEIVED, COMBINE_SENT or COMBINED (else
 * MOE_EP_ERR_INVALID_STATE). */
moe_ep_status_t moe_ep_ll_handle_buffers(const moe_ep_ll_handle_t *handle,
                                         moe_ep_ll_buffers_t *out);
/* Lets go of the batch and of the group. Wait for a SENT batch first: one
 * never waited for keeps its buffer set from taking new batches. */
moe_ep_status_t moe_ep_ll_handle_destroy(moe_ep_ll_handle_t *handle);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* MOE_EP_H */
