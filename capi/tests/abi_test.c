/* The C ABI without a GPU: version, versioned structs, argument checks, no
 * driver. Built by capi/tests/capi.rs against libmoe_ep.a and libmoe_ep.so,
 * of the build and of a package capi/install.sh installed.
 *
 *   abi_test          run the checks (exit status 0 when all pass)
 *   abi_test layout   print every struct's size, magic and field offsets
 */
#include "moe_ep.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(void *) == 8, "the ABI is laid out for 64-bit targets");
_Static_assert(sizeof(moe_ep_buf_t) == 16, "moe_ep_buf_t");
_Static_assert(sizeof(moe_ep_buf_mut_t) == 16, "moe_ep_buf_mut_t");
_Static_assert(sizeof(moe_ep_version_info_t) == 32, "moe_ep_version_info_t");
_Static_assert(sizeof(moe_ep_group_config_t) == 72, "moe_ep_group_config_t");
_Static_assert(sizeof(moe_ep_layout_args_t) == 40, "moe_ep_layout_args_t");
_Static_assert(sizeof(moe_ep_dispatch_args_t) == 72, "moe_ep_dispatch_args_t");
_Static_assert(sizeof(moe_ep_combine_args_t) == 56, "moe_ep_combine_args_t");
_Static_assert(sizeof(moe_ep_combine_backward_args_t) == 56, "moe_ep_combine_backward_args_t");
_Static_assert(sizeof(moe_ep_dispatch_backward_args_t) == 72, "moe_ep_dispatch_backward_args_t");
_Static_assert(sizeof(moe_ep_recv_buffers_t) == 96, "moe_ep_recv_buffers_t");
_Static_assert(sizeof(moe_ep_handle_counts_t) == 64, "moe_ep_handle_counts_t");
_Static_assert(sizeof(moe_ep_dispatch_fp8_args_t) == 112, "moe_ep_dispatch_fp8_args_t");
_Static_assert(sizeof(moe_ep_memory_footprint_t) == 64, "moe_ep_memory_footprint_t");
_Static_assert(sizeof(moe_ep_ll_dispatch_args_t) == 88, "moe_ep_ll_dispatch_args_t");
_Static_assert(sizeof(moe_ep_ll_combine_args_t) == 56, "moe_ep_ll_combine_args_t");
_Static_assert(sizeof(moe_ep_ll_handle_info_t) == 80, "moe_ep_ll_handle_info_t");
_Static_assert(sizeof(moe_ep_ll_buffers_t) == 152, "moe_ep_ll_buffers_t");
_Static_assert(sizeof(moe_ep_unique_id_t) == 128, "moe_ep_unique_id_t");
_Static_assert(sizeof(moe_ep_status_t) == sizeof(int), "moe_ep_status_t is an int");

#define SIZE(T) printf(#T " size %zu\n", sizeof(T))
#define OFF(T, f) printf(#T "." #f " %zu\n", offsetof(T, f))
#define INIT(T, macro)                                                  \
  do {                                                                  \
    T v_ = macro;                                                       \
    printf(#T " init_size %u\n" #T " magic %u\n", v_.size, v_.magic);   \
  } while (0)

static void layout(void) {
  SIZE(moe_ep_buf_t); OFF(moe_ep_buf_t, ptr); OFF(moe_ep_buf_t, len);
  SIZE(moe_ep_buf_mut_t); OFF(moe_ep_buf_mut_t, ptr); OFF(moe_ep_buf_mut_t, len);
  SIZE(moe_ep_unique_id_t);
  SIZE(moe_ep_version_info_t); INIT(moe_ep_version_info_t, MOE_EP_VERSION_INFO_INIT);
  OFF(moe_ep_version_info_t, major); OFF(moe_ep_version_info_t, minor);
  OFF(moe_ep_version_info_t, patch); OFF(moe_ep_version_info_t, abi_version);
  OFF(moe_ep_version_info_t, nccl_headers_version); OFF(moe_ep_version_info_t, reserved);
  SIZE(moe_ep_group_config_t); INIT(moe_ep_group_config_t, MOE_EP_GROUP_CONFIG_INIT);
  OFF(moe_ep_group_config_t, num_experts); OFF(moe_ep_group_config_t, hidden);
  OFF(moe_ep_group_config_t, max_tokens_per_rank); OFF(moe_ep_group_config_t, recv_capacity);
  OFF(moe_ep_group_config_t, num_sms); OFF(moe_ep_group_config_t, combine_chunks);
  OFF(moe_ep_group_config_t, mode); OFF(moe_ep_group_config_t, timeout_ms);
  OFF(moe_ep_group_config_t, ranks_per_node); OFF(moe_ep_group_config_t, padding);
  OFF(moe_ep_group_config_t, overflow);
  SIZE(moe_ep_layout_args_t); INIT(moe_ep_layout_args_t, MOE_EP_LAYOUT_ARGS_INIT);
  OFF(moe_ep_layout_args_t, topk_idx); OFF(moe_ep_layout_args_t, topk_idx_dtype);
  OFF(moe_ep_layout_args_t, topk); OFF(moe_ep_layout_args_t, layout);
  OFF(moe_ep_layout_args_t, alignment);
  SIZE(moe_ep_dispatch_args_t); INIT(moe_ep_dispatch_args_t, MOE_EP_DISPATCH_ARGS_INIT);
  OFF(moe_ep_dispatch_args_t, x); OFF(moe_ep_dispatch_args_t, topk_weights);
  OFF(moe_ep_dispatch_args_t, recv_tokens); OFF(moe_ep_dispatch_args_t, recv_topk_weights);
  SIZE(moe_ep_combine_args_t); INIT(moe_ep_combine_args_t, MOE_EP_COMBINE_ARGS_INIT);
  OFF(moe_ep_combine_args_t, expert_out); OFF(moe_ep_combine_args_t, weights);
  OFF(moe_ep_combine_args_t, out);
  SIZE(moe_ep_combine_backward_args_t);
  INIT(moe_ep_combine_backward_args_t, MOE_EP_COMBINE_BACKWARD_ARGS_INIT);
  OFF(moe_ep_combine_backward_args_t, grad_out); OFF(moe_ep_combine_backward_args_t, weights);
  OFF(moe_ep_combine_backward_args_t, grad_expert_out);
  SIZE(moe_ep_dispatch_backward_args_t);
  INIT(moe_ep_dispatch_backward_args_t, MOE_EP_DISPATCH_BACKWARD_ARGS_INIT);
  OFF(moe_ep_dispatch_backward_args_t, grad_recv_tokens);
  OFF(moe_ep_dispatch_backward_args_t, grad_recv_topk_weights);
  OFF(moe_ep_dispatch_backward_args_t, grad_tokens);
  OFF(moe_ep_dispatch_backward_args_t, grad_topk_weights);
  SIZE(moe_ep_recv_buffers_t); INIT(moe_ep_recv_buffers_t, MOE_EP_RECV_BUFFERS_INIT);
  OFF(moe_ep_recv_buffers_t, tokens); OFF(moe_ep_recv_buffers_t, topk_weights);
  OFF(moe_ep_recv_buffers_t, topk_idx); OFF(moe_ep_recv_buffers_t, src);
  OFF(moe_ep_recv_buffers_t, scales); OFF(moe_ep_recv_buffers_t, scale_kind);
  OFF(moe_ep_recv_buffers_t, reserved);
  SIZE(moe_ep_handle_counts_t); INIT(moe_ep_handle_counts_t, MOE_EP_HANDLE_COUNTS_INIT);
  OFF(moe_ep_handle_counts_t, num_tokens); OFF(moe_ep_handle_counts_t, topk);
  OFF(moe_ep_handle_counts_t, recv_rows); OFF(moe_ep_handle_counts_t, recv_tokens);
  OFF(moe_ep_handle_counts_t, num_local_experts); OFF(moe_ep_handle_counts_t, max_recv_rows);
  OFF(moe_ep_handle_counts_t, dropped_rows);
  SIZE(moe_ep_dispatch_fp8_args_t);
  INIT(moe_ep_dispatch_fp8_args_t, MOE_EP_DISPATCH_FP8_ARGS_INIT);
  OFF(moe_ep_dispatch_fp8_args_t, codes); OFF(moe_ep_dispatch_fp8_args_t, scales);
  OFF(moe_ep_dispatch_fp8_args_t, scale_kind); OFF(moe_ep_dispatch_fp8_args_t, reserved);
  OFF(moe_ep_dispatch_fp8_args_t, topk_weights); OFF(moe_ep_dispatch_fp8_args_t, recv_codes);
  OFF(moe_ep_dispatch_fp8_args_t, recv_scales);
  OFF(moe_ep_dispatch_fp8_args_t, recv_topk_weights);
  SIZE(moe_ep_memory_footprint_t);
  INIT(moe_ep_memory_footprint_t, MOE_EP_MEMORY_FOOTPRINT_INIT);
  OFF(moe_ep_memory_footprint_t, workspace); OFF(moe_ep_memory_footprint_t, low_latency);
  OFF(moe_ep_memory_footprint_t, pool_other); OFF(moe_ep_memory_footprint_t, pool_free);
  OFF(moe_ep_memory_footprint_t, two_level); OFF(moe_ep_memory_footprint_t, pinned_host);
  OFF(moe_ep_memory_footprint_t, device_total);
  SIZE(moe_ep_ll_dispatch_args_t); INIT(moe_ep_ll_dispatch_args_t, MOE_EP_LL_DISPATCH_ARGS_INIT);
  OFF(moe_ep_ll_dispatch_args_t, x); OFF(moe_ep_ll_dispatch_args_t, x_scales);
  OFF(moe_ep_ll_dispatch_args_t, topk_idx); OFF(moe_ep_ll_dispatch_args_t, topk_weights);
  OFF(moe_ep_ll_dispatch_args_t, topk_idx_dtype); OFF(moe_ep_ll_dispatch_args_t, topk);
  OFF(moe_ep_ll_dispatch_args_t, layout); OFF(moe_ep_ll_dispatch_args_t, payload);
  SIZE(moe_ep_ll_combine_args_t); INIT(moe_ep_ll_combine_args_t, MOE_EP_LL_COMBINE_ARGS_INIT);
  OFF(moe_ep_ll_combine_args_t, expert_out); OFF(moe_ep_ll_combine_args_t, weights);
  OFF(moe_ep_ll_combine_args_t, out);
  SIZE(moe_ep_ll_handle_info_t); INIT(moe_ep_ll_handle_info_t, MOE_EP_LL_HANDLE_INFO_INIT);
  OFF(moe_ep_ll_handle_info_t, num_tokens); OFF(moe_ep_ll_handle_info_t, topk);
  OFF(moe_ep_ll_handle_info_t, hidden); OFF(moe_ep_ll_handle_info_t, num_rows);
  OFF(moe_ep_ll_handle_info_t, num_local_experts); OFF(moe_ep_ll_handle_info_t, world);
  OFF(moe_ep_ll_handle_info_t, max_tokens_per_rank); OFF(moe_ep_ll_handle_info_t, layout);
  OFF(moe_ep_ll_handle_info_t, fp8); OFF(moe_ep_ll_handle_info_t, buffer_set);
  OFF(moe_ep_ll_handle_info_t, state);
  SIZE(moe_ep_ll_buffers_t); INIT(moe_ep_ll_buffers_t, MOE_EP_LL_BUFFERS_INIT);
  OFF(moe_ep_ll_buffers_t, tokens); OFF(moe_ep_ll_buffers_t, fp8_codes);
  OFF(moe_ep_ll_buffers_t, fp8_scales); OFF(moe_ep_ll_buffers_t, src);
  OFF(moe_ep_ll_buffers_t, topk_local_idx); OFF(moe_ep_ll_buffers_t, topk_weights);
  OFF(moe_ep_ll_buffers_t, tokens_per_local_expert);
  OFF(moe_ep_ll_buffers_t, tokens_per_expert_source);
  OFF(moe_ep_ll_buffers_t, tokens_from_rank);
}

static int failures = 0;

/* `call` must return `want` with a message containing every word given. */
static void expect(const char *what, moe_ep_status_t got, moe_ep_status_t want, const char *w1,
                   const char *w2) {
  const char *msg = got == MOE_EP_OK ? "" : moe_ep_last_error();
  int ok = got == want && (!w1 || strstr(msg, w1)) && (!w2 || strstr(msg, w2));
  printf("%s %s: %s%s%s\n", ok ? "ok  " : "FAIL", what, moe_ep_status_name(got),
         *msg ? ": " : "", msg);
  if (!ok) {
    printf("     expected %s with \"%s\" and \"%s\"\n", moe_ep_status_name(want), w1 ? w1 : "",
           w2 ? w2 : "");
    failures++;
  }
}

#define BAD MOE_EP_ERR_INVALID_ARGUMENT

static moe_ep_group_config_t good_config(void) {
  moe_ep_group_config_t c = MOE_EP_GROUP_CONFIG_INIT;
  c.num_experts = 64;
  c.hidden = 2048;
  c.max_tokens_per_rank = 256;
  return c;
}

static void version(void) {
  moe_ep_version_info_t v = MOE_EP_VERSION_INFO_INIT;
  expect("moe_ep_version", moe_ep_version(&v), MOE_EP_OK, NULL, NULL);
  int same = v.major == MOE_EP_VERSION_MAJOR && v.minor == MOE_EP_VERSION_MINOR &&
             v.patch == MOE_EP_VERSION_PATCH && v.abi_version == MOE_EP_ABI_VERSION &&
             moe_ep_abi_version() == MOE_EP_ABI_VERSION && v.nccl_headers_version >= 22800;
  printf("%s version %u.%u.%u ABI %u NCCL headers %d: %s\n", same ? "ok  " : "FAIL", v.major,
         v.minor, v.patch, v.abi_version, v.nccl_headers_version, moe_ep_version_string());
  failures += !same;
  char want[32];
  snprintf(want, sizeof want, "%d.%d.%d (ABI %d", MOE_EP_VERSION_MAJOR, MOE_EP_VERSION_MINOR,
           MOE_EP_VERSION_PATCH, MOE_EP_ABI_VERSION);
  if (strncmp(moe_ep_version_string(), want, strlen(want)) != 0) {
    printf("FAIL version string does not start with \"%s\"\n", want);
    failures++;
  }
  expect("moe_ep_version(NULL)", moe_ep_version(NULL), BAD, "`out`", "moe_ep_version_info_t");
  moe_ep_version_info_t bad = MOE_EP_VERSION_INFO_INIT;
  bad.magic = 0;
  expect("version info with a wrong magic", moe_ep_version(&bad), BAD, "moe_ep_version_info_t",
         "magic");
  if (strcmp(moe_ep_status_name(MOE_EP_ERR_NO_DRIVER), "MOE_EP_ERR_NO_DRIVER") != 0 ||
      strcmp(moe_ep_status_name((moe_ep_status_t)99), "MOE_EP_UNKNOWN_STATUS") != 0) {
    printf("FAIL moe_ep_status_name\n");
    failures++;
  }
}

static void structs(void) {
  moe_ep_group_config_t c = good_config();
  expect("a good config at world 2", moe_ep_group_config_validate(&c, 2), MOE_EP_OK, NULL, NULL);
  c.magic = 0xdeadbeefu;
  expect("config with a wrong magic", moe_ep_group_config_validate(&c, 2), BAD, "`cfg`",
         "moe_ep_group_config_t");
  c = good_config();
  c.size = 8;
  expect("config of size 8", moe_ep_group_config_validate(&c, 2), BAD, "moe_ep_group_config_t",
         "size 8");
  c.size = 0;
  expect("config of size 0", moe_ep_group_config_validate(&c, 2), BAD, "moe_ep_group_config_t",
         "size 0");
  /* A newer caller's larger struct: accepted when the extra bytes are zero. */
  struct {
    moe_ep_group_config_t c;
    uint64_t newer_field;
  } big;
  memset(&big, 0, sizeof big);
  big.c = good_config();
  big.c.size = sizeof big;
  expect("a larger struct with zero extra bytes", moe_ep_group_config_validate(&big.c, 2),
         MOE_EP_OK, NULL, NULL);
  big.newer_field = 1;
  expect("a larger struct with a field set this library lacks",
         moe_ep_group_config_validate(&big.c, 2), BAD, "`cfg`", "does not know");
  expect("config NULL", moe_ep_group_config_validate(NULL, 2), BAD, "`cfg`", "NULL");
  c = good_config();
  c.hidden = 12;
  expect("hidden 12", moe_ep_group_config_validate(&c, 2), BAD, "`hidden`", "multiple of 8");
  c = good_config();
  c.num_experts = 63;
  expect("63 experts at world 2", moe_ep_group_config_validate(&c, 2), BAD, "`num_experts`",
         NULL);
  c = good_config();
  c.mode = MOE_EP_MODE_LOW_LATENCY;
  expect("a low-latency config", moe_ep_group_config_validate(&c, 2), MOE_EP_OK, NULL, NULL);
  c.max_tokens_per_rank = 2048;
  expect("low latency, 2048 tokens per rank", moe_ep_group_config_validate(&c, 2), BAD,
         "`max_tokens_per_rank`", "LowLatency");
  c = good_config();
  c.mode = 2;
  expect("mode 2", moe_ep_group_config_validate(&c, 2), BAD, "`mode`", NULL);
  /* ranks_per_node (ABI 3): 0 and the world size are one node, a smaller
   * divisor several (the two-level path); a non-divisor and more than 8 per
   * node are refused by name, and so are what several nodes cannot take
   * (more than 64 nodes, the low-latency mode, a forward batch past 2^20
   * tokens). An ABI 2 caller's struct lacks the field: one node. */
  c = good_config();
  c.ranks_per_node = 2;
  expect("2 ranks per node at world 2", moe_ep_group_config_validate(&c, 2), MOE_EP_OK, NULL,
         NULL);
  c.ranks_per_node = 3;
  expect("3 ranks per node at world 2", moe_ep_group_config_validate(&c, 2), BAD,
         "`ranks_per_node`", "divisor");
  c.num_experts = 256;
  c.ranks_per_node = 16;
  expect("16 ranks per node at world 32", moe_ep_group_config_validate(&c, 32), BAD,
         "`ranks_per_node`", "at most 8");
  c.ranks_per_node = 1;
  expect("2 nodes of 1 rank", moe_ep_group_config_validate(&c, 2), MOE_EP_OK, NULL, NULL);
  c.ranks_per_node = 8;
  expect("2 nodes of 8 ranks", moe_ep_group_config_validate(&c, 16), MOE_EP_OK, NULL, NULL);
  c.num_experts = 1024;
  c.ranks_per_node = 1;
  expect("128 nodes of 1 rank", moe_ep_group_config_validate(&c, 128), BAD, "`ranks_per_node`",
         "at most 64 nodes");
  c.num_experts = 256;
  c.ranks_per_node = 4;
  c.mode = MOE_EP_MODE_LOW_LATENCY;
  expect("low latency over 2 nodes", moe_ep_group_config_validate(&c, 8), BAD, "`mode`",
         "two-level");
  c.mode = MOE_EP_MODE_HIGH_THROUGHPUT;
  c.max_tokens_per_rank = 1 << 19;
  expect("2^19 tokens over 4 nodes", moe_ep_group_config_validate(&c, 16), BAD,
         "`max_tokens_per_rank`", "2^20");
  c = good_config();
  c.num_experts = 256;
  c.ranks_per_node = 0;
  expect("16 ranks on one node", moe_ep_group_config_validate(&c, 16), BAD, "`world`", NULL);
  c = good_config();
  c.ranks_per_node = 1; /* past an ABI 2 struct's end: not read */
  c.size = 56;
  expect("an ABI 2 config (56 bytes)", moe_ep_group_config_validate(&c, 2), MOE_EP_OK, NULL,
         NULL);
  /* padding and overflow (ABI 5): 0 the defaults; an ABI 4 struct (64 bytes)
   * lacks them and means the defaults; unknown values and the drop policy
   * where it cannot run are refused by name. */
  c = good_config();
  c.padding = MOE_EP_PADDING_UNTOUCHED;
  c.overflow = MOE_EP_OVERFLOW_DROP;
  expect("padding untouched, overflow drop", moe_ep_group_config_validate(&c, 2), MOE_EP_OK, NULL,
         NULL);
  c.padding = 2;
  expect("padding 2", moe_ep_group_config_validate(&c, 2), BAD, "`padding`",
         "MOE_EP_PADDING_UNTOUCHED");
  c.padding = MOE_EP_PADDING_ZERO;
  c.overflow = 7;
  expect("overflow 7", moe_ep_group_config_validate(&c, 2), BAD, "`overflow`",
         "MOE_EP_OVERFLOW_DROP");
  c.overflow = 7; /* past an ABI 4 struct's end: not read */
  c.size = 64;
  expect("an ABI 4 config (64 bytes)", moe_ep_group_config_validate(&c, 2), MOE_EP_OK, NULL,
         NULL);
  c = good_config();
  c.overflow = MOE_EP_OVERFLOW_DROP;
  c.mode = MOE_EP_MODE_LOW_LATENCY;
  expect("overflow drop in low-latency mode", moe_ep_group_config_validate(&c, 2), BAD,
         "`overflow`", NULL);
  c.mode = MOE_EP_MODE_HIGH_THROUGHPUT;
  c.ranks_per_node = 1;
  expect("overflow drop over 2 nodes", moe_ep_group_config_validate(&c, 2), BAD, "`overflow`",
         "one node");

  /* Every argument struct of an op is checked before anything else. */
  moe_ep_layout_args_t la = MOE_EP_LAYOUT_ARGS_INIT;
  la.magic = 1;
  moe_ep_handle_t *h = NULL;
  expect("layout args, wrong magic", moe_ep_layout(NULL, NULL, &la, &h), BAD, "`args`",
         "moe_ep_layout_args_t");
  moe_ep_dispatch_args_t da = MOE_EP_DISPATCH_ARGS_INIT;
  da.size = 16;
  moe_ep_dispatched_t *d = NULL;
  expect("dispatch args, size 16", moe_ep_dispatch(NULL, NULL, NULL, &da, &d), BAD,
         "moe_ep_dispatch_args_t", "size 16");
  moe_ep_combine_args_t ca = MOE_EP_COMBINE_ARGS_INIT;
  ca.magic = MOE_EP_MAGIC_DISPATCH_ARGS;
  expect("combine args with another struct's magic", moe_ep_combine(NULL, NULL, NULL, &ca), BAD,
         "`args`", "moe_ep_combine_args_t");
  moe_ep_combine_backward_args_t cb = MOE_EP_COMBINE_BACKWARD_ARGS_INIT;
  cb.magic = 0;
  expect("combine backward args, wrong magic", moe_ep_combine_backward(NULL, NULL, NULL, &cb, NULL),
         BAD, "`args`", "moe_ep_combine_backward_args_t");
  moe_ep_dispatch_backward_args_t db = MOE_EP_DISPATCH_BACKWARD_ARGS_INIT;
  db.size = 4;
  expect("dispatch backward args, size 4", moe_ep_dispatch_backward(NULL, NULL, NULL, &db), BAD,
         "moe_ep_dispatch_backward_args_t", "size 4");
  moe_ep_recv_buffers_t rb = MOE_EP_RECV_BUFFERS_INIT;
  rb.magic = 3;
  expect("recv buffers out, wrong magic", moe_ep_dispatched_buffers(NULL, &rb), BAD, "`out`",
         "moe_ep_recv_buffers_t");
  moe_ep_handle_counts_t hc = MOE_EP_HANDLE_COUNTS_INIT;
  hc.size = 9;
  expect("handle counts out, size 9", moe_ep_handle_counts(NULL, NULL, &hc), BAD,
         "moe_ep_handle_counts_t", "size 9");
  /* An ABI 4 caller's smaller output structs are accepted (filled up to
   * their size): the call gets past them to the handle. */
  hc = (moe_ep_handle_counts_t)MOE_EP_HANDLE_COUNTS_INIT;
  hc.size = 48;
  expect("an ABI 4 handle counts out (48 bytes)", moe_ep_handle_counts(NULL, NULL, &hc), BAD,
         "`handle`", NULL);
  rb = (moe_ep_recv_buffers_t)MOE_EP_RECV_BUFFERS_INIT;
  rb.size = 72;
  expect("an ABI 4 recv buffers out (72 bytes)", moe_ep_dispatched_buffers(NULL, &rb), BAD,
         "`dispatched`", NULL);

  /* ABI 5 structs. */
  moe_ep_dispatch_fp8_args_t fa = MOE_EP_DISPATCH_FP8_ARGS_INIT;
  fa.magic = MOE_EP_MAGIC_DISPATCH_ARGS;
  expect("fp8 dispatch args with the dispatch's magic",
         moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d), BAD, "`args`",
         "moe_ep_dispatch_fp8_args_t");
  fa = (moe_ep_dispatch_fp8_args_t)MOE_EP_DISPATCH_FP8_ARGS_INIT;
  fa.size = 100;
  expect("fp8 dispatch args, size 100", moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d), BAD,
         "moe_ep_dispatch_fp8_args_t", "size 100");
  expect("fp8 dispatch args NULL", moe_ep_dispatch_fp8(NULL, NULL, NULL, NULL, &d), BAD,
         "`args`", "NULL");
  moe_ep_memory_footprint_t fp = MOE_EP_MEMORY_FOOTPRINT_INIT;
  fp.magic = MOE_EP_MAGIC_HANDLE_COUNTS;
  expect("memory footprint out, wrong magic", moe_ep_group_memory_footprint(NULL, &fp), BAD,
         "`out`", "moe_ep_memory_footprint_t");
  fp = (moe_ep_memory_footprint_t)MOE_EP_MEMORY_FOOTPRINT_INIT;
  fp.size = 12;
  expect("memory footprint out, size 12", moe_ep_group_memory_footprint(NULL, &fp), BAD,
         "moe_ep_memory_footprint_t", "size 12");

  /* The low-latency structs (ABI 2). */
  moe_ep_ll_dispatch_args_t lda = MOE_EP_LL_DISPATCH_ARGS_INIT;
  moe_ep_ll_handle_t *lh = NULL;
  lda.magic = MOE_EP_MAGIC_DISPATCH_ARGS;
  expect("ll dispatch args with the dispatch's magic", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh),
         BAD, "`args`", "moe_ep_ll_dispatch_args_t");
  lda = (moe_ep_ll_dispatch_args_t)MOE_EP_LL_DISPATCH_ARGS_INIT;
  lda.size = 40;
  expect("ll dispatch send args, size 40", moe_ep_ll_dispatch_send(NULL, NULL, &lda, &lh), BAD,
         "moe_ep_ll_dispatch_args_t", "size 40");
  expect("ll dispatch args NULL", moe_ep_ll_dispatch(NULL, NULL, NULL, &lh), BAD, "`args`",
         "NULL");
  struct {
    moe_ep_ll_dispatch_args_t a;
    uint32_t newer_field;
  } lbig;
  memset(&lbig, 0, sizeof lbig);
  lbig.a = (moe_ep_ll_dispatch_args_t)MOE_EP_LL_DISPATCH_ARGS_INIT;
  lbig.a.size = sizeof lbig;
  lbig.newer_field = 5;
  expect("a larger ll dispatch args with a field set this library lacks",
         moe_ep_ll_dispatch(NULL, NULL, &lbig.a, &lh), BAD, "`args`", "does not know");
  moe_ep_ll_combine_args_t lca = MOE_EP_LL_COMBINE_ARGS_INIT;
  lca.magic = MOE_EP_MAGIC_COMBINE_ARGS;
  expect("ll combine args with the combine's magic", moe_ep_ll_combine(NULL, NULL, NULL, &lca),
         BAD, "`args`", "moe_ep_ll_combine_args_t");
  lca = (moe_ep_ll_combine_args_t)MOE_EP_LL_COMBINE_ARGS_INIT;
  lca.size = 12;
  expect("ll combine send args, size 12", moe_ep_ll_combine_send(NULL, NULL, NULL, &lca), BAD,
         "moe_ep_ll_combine_args_t", "size 12");
  lca.size = 0;
  expect("ll combine wait args, size 0", moe_ep_ll_combine_wait(NULL, NULL, NULL, &lca), BAD,
         "moe_ep_ll_combine_args_t", "size 0");
  moe_ep_ll_handle_info_t li = MOE_EP_LL_HANDLE_INFO_INIT;
  li.magic = 0;
  expect("ll handle info out, wrong magic", moe_ep_ll_handle_info(NULL, &li), BAD, "`out`",
         "moe_ep_ll_handle_info_t");
  moe_ep_ll_buffers_t lb = MOE_EP_LL_BUFFERS_INIT;
  lb.size = 9;
  expect("ll buffers out, size 9", moe_ep_ll_handle_buffers(NULL, &lb), BAD,
         "moe_ep_ll_buffers_t", "size 9");
  c = good_config();
  c.magic = MOE_EP_MAGIC_LL_DISPATCH_ARGS;
  expect("ll buffer bytes of a config with a wrong magic", moe_ep_ll_buffer_bytes(&c, 2, NULL, NULL),
         BAD, "`cfg`", "moe_ep_group_config_t");
}

static void arguments(void) {
  static char fake[4096]; /* addresses only: no call below gets to a GPU */
  moe_ep_group_config_t c = good_config();
  moe_ep_group_t *g = NULL;
  expect("group of a NULL comm", moe_ep_group_create(NULL, &c, &g), BAD, "`comm`", NULL);
  moe_ep_layout_args_t la = MOE_EP_LAYOUT_ARGS_INIT;
  la.topk_idx_dtype = MOE_EP_DTYPE_I64;
  la.topk = 8;
  moe_ep_handle_t *h = NULL;
  expect("layout of a NULL group", moe_ep_layout(NULL, NULL, &la, &h), BAD, "`group`", NULL);
  la.topk_idx.len = 16;
  expect("topk_idx NULL with 16 elements", moe_ep_layout(NULL, NULL, &la, &h), BAD, "`topk_idx`",
         "NULL");
  la.topk_idx.len = 0;
  la.topk_idx_dtype = 0;
  expect("topk_idx_dtype 0", moe_ep_layout(NULL, NULL, &la, &h), BAD, "`topk_idx_dtype`", NULL);
  la.topk_idx_dtype = MOE_EP_DTYPE_I32;
  la.layout = MOE_EP_LAYOUT_EXPERT_MAJOR;
  expect("expert-major alignment 0", moe_ep_layout(NULL, NULL, &la, &h), BAD, "`alignment`",
         NULL);
  la.layout = MOE_EP_LAYOUT_RANK_MAJOR;
  la.alignment = 3;
  expect("rank-major alignment 3", moe_ep_layout(NULL, NULL, &la, &h), BAD, "`alignment`", NULL);
  la.layout = 7;
  expect("layout 7", moe_ep_layout(NULL, NULL, &la, &h), BAD, "`layout`", NULL);

  moe_ep_dispatch_args_t da = MOE_EP_DISPATCH_ARGS_INIT;
  moe_ep_dispatched_t *d = NULL;
  da.x.len = 5;
  expect("x NULL with 5 elements", moe_ep_dispatch(NULL, NULL, NULL, &da, &d), BAD, "`x`", "NULL");
  da.x.len = 0;
  da.recv_tokens.len = 3;
  expect("recv_tokens NULL with 3 elements", moe_ep_dispatch(NULL, NULL, NULL, &da, &d), BAD,
         "`recv_tokens`", NULL);
  da.recv_tokens.len = 0;
  da.x.ptr = fake;
  da.x.len = 64;
  da.recv_tokens.ptr = fake + 64;
  da.recv_tokens.len = 64;
  expect("recv_tokens overlapping x", moe_ep_dispatch(NULL, NULL, NULL, &da, &d), BAD,
         "`recv_tokens`", "`x`");
  da.recv_tokens.ptr = fake + 1024;
  expect("dispatch of a NULL group", moe_ep_dispatch(NULL, NULL, NULL, &da, &d), BAD, "`group`",
         NULL);

  /* The fp8 dispatch (ABI 5): every buffer and the scale kind named before
   * the group is looked at. */
  moe_ep_dispatch_fp8_args_t fa = MOE_EP_DISPATCH_FP8_ARGS_INIT;
  expect("fp8 dispatch without a scale kind", moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d), BAD,
         "`scale_kind`", "MOE_EP_FP8_SCALES_E8M0_PER_32");
  fa.scale_kind = 3;
  expect("fp8 dispatch, scale kind 3", moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d), BAD,
         "`scale_kind`", NULL);
  fa.scale_kind = MOE_EP_FP8_SCALES_F32_PER_128;
  fa.codes.len = 256;
  expect("codes NULL with 256 elements", moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d), BAD,
         "`codes`", "NULL");
  fa.codes.ptr = fake;
  fa.scales.len = 2;
  expect("scales NULL with 2 elements", moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d), BAD,
         "`scales`", "NULL");
  fa.scales.ptr = fake + 256;
  fa.recv_scales.len = 4;
  expect("recv_scales NULL with 4 elements", moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d), BAD,
         "`recv_scales`", "NULL");
  fa.recv_scales.ptr = fake + 1024;
  fa.recv_codes.ptr = fake + 1024 + 8;
  fa.recv_codes.len = 64;
  expect("recv_codes overlapping recv_scales", moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d), BAD,
         "`recv_codes`", "`recv_scales`");
  fa.recv_codes.ptr = fake + 2048;
  fa.recv_topk_weights.ptr = fake + 128;
  fa.recv_topk_weights.len = 8;
  expect("recv_topk_weights overlapping codes", moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d),
         BAD, "`recv_topk_weights`", "`codes`");
  fa.recv_topk_weights.ptr = fake + 3072;
  expect("fp8 dispatch of a NULL group", moe_ep_dispatch_fp8(NULL, NULL, NULL, &fa, &d), BAD,
         "`group`", NULL);

  moe_ep_combine_args_t ca = MOE_EP_COMBINE_ARGS_INIT;
  ca.out.len = 3;
  expect("combine out NULL with 3 elements", moe_ep_combine(NULL, NULL, NULL, &ca), BAD, "`out`",
         "NULL");
  ca.expert_out.ptr = fake;
  ca.expert_out.len = 100;
  ca.out.ptr = fake + 64;
  ca.out.len = 100;
  expect("combine out overlapping expert_out", moe_ep_combine(NULL, NULL, NULL, &ca), BAD,
         "`out`", "`expert_out`");
  ca.weights.ptr = fake;
  ca.weights.len = 0;
  ca.out.ptr = fake + 2048;
  expect("combine of a NULL group", moe_ep_combine(NULL, NULL, NULL, &ca), BAD, "`group`", NULL);

  moe_ep_combine_backward_args_t cb = MOE_EP_COMBINE_BACKWARD_ARGS_INIT;
  cb.grad_out.len = 2;
  expect("grad_out NULL with 2 elements", moe_ep_combine_backward(NULL, NULL, NULL, &cb, NULL),
         BAD, "`grad_out`", NULL);
  cb.grad_out.len = 0;
  expect("combine backward, pool result to NULL", moe_ep_combine_backward(NULL, NULL, NULL, &cb, NULL),
         BAD, "`out`", NULL);
  moe_ep_dispatch_backward_args_t db = MOE_EP_DISPATCH_BACKWARD_ARGS_INIT;
  db.grad_recv_tokens.len = 4;
  expect("grad_recv_tokens NULL with 4 elements", moe_ep_dispatch_backward(NULL, NULL, NULL, &db),
         BAD, "`grad_recv_tokens`", NULL);
  db.grad_recv_tokens.len = 0;
  db.grad_tokens.ptr = fake;
  db.grad_tokens.len = 64;
  db.grad_topk_weights.ptr = fake + 16;
  db.grad_topk_weights.len = 4;
  expect("grad_tokens overlapping grad_topk_weights", moe_ep_dispatch_backward(NULL, NULL, NULL, &db),
         BAD, "`grad_tokens`", "`grad_topk_weights`");

  /* Low-latency ops: every buffer named before the group is looked at. */
  moe_ep_ll_dispatch_args_t lda = MOE_EP_LL_DISPATCH_ARGS_INIT;
  moe_ep_ll_handle_t *lh = NULL;
  lda.topk_idx_dtype = MOE_EP_DTYPE_I64;
  lda.topk = 8;
  expect("ll dispatch of a NULL group", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh), BAD, "`group`",
         NULL);
  expect("ll dispatch send of a NULL group", moe_ep_ll_dispatch_send(NULL, NULL, &lda, &lh), BAD,
         "`group`", NULL);
  lda.x.len = 7;
  expect("ll x NULL with 7 elements", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh), BAD, "`x`",
         "NULL");
  lda.x.len = 0;
  lda.topk_weights.len = 8;
  expect("ll topk_weights NULL with 8 elements", moe_ep_ll_dispatch_send(NULL, NULL, &lda, &lh),
         BAD, "`topk_weights`", "NULL");
  lda.topk_weights.len = 0;
  lda.topk_idx.len = 8;
  expect("ll topk_idx NULL with 8 elements", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh), BAD,
         "`topk_idx`", "NULL");
  lda.topk_idx.len = 0;
  lda.topk_idx_dtype = MOE_EP_DTYPE_F32;
  expect("ll topk_idx_dtype f32", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh), BAD,
         "`topk_idx_dtype`", NULL);
  lda.topk_idx_dtype = MOE_EP_DTYPE_I32;
  lda.layout = 5;
  expect("ll layout 5", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh), BAD, "`layout`", NULL);
  lda.layout = MOE_EP_LAYOUT_EXPERT_MAJOR;
  lda.payload = 9;
  expect("ll payload 9", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh), BAD, "`payload`", NULL);
  lda.payload = MOE_EP_LL_CAST_FP8_EXACT;
  lda.x_scales.ptr = fake;
  lda.x_scales.len = 16;
  expect("ll x_scales with bf16 rows", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh), BAD,
         "`x_scales`", "MOE_EP_LL_FP8");
  lda.payload = MOE_EP_LL_FP8;
  lda.x_scales.ptr = NULL;
  expect("ll x_scales NULL with 16 elements", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh), BAD,
         "`x_scales`", "NULL");
  lda.x_scales.len = 0;
  expect("ll fp8 dispatch of a NULL group", moe_ep_ll_dispatch(NULL, NULL, &lda, &lh), BAD,
         "`group`", NULL);
  expect("ll dispatch wait of a NULL group", moe_ep_ll_dispatch_wait(NULL, NULL, NULL), BAD,
         "`group`", NULL);

  moe_ep_ll_combine_args_t lca = MOE_EP_LL_COMBINE_ARGS_INIT;
  lca.out.len = 3;
  expect("ll combine out NULL with 3 elements", moe_ep_ll_combine(NULL, NULL, NULL, &lca), BAD,
         "`out`", "NULL");
  expect("ll combine wait out NULL with 3 elements", moe_ep_ll_combine_wait(NULL, NULL, NULL, &lca),
         BAD, "`out`", "NULL");
  /* combine send reads only expert_out */
  expect("ll combine send of a NULL group", moe_ep_ll_combine_send(NULL, NULL, NULL, &lca), BAD,
         "`group`", NULL);
  lca.expert_out.len = 2;
  expect("ll combine send expert_out NULL with 2 elements",
         moe_ep_ll_combine_send(NULL, NULL, NULL, &lca), BAD, "`expert_out`", "NULL");
  lca.expert_out.ptr = fake;
  lca.expert_out.len = 512;
  lca.out.ptr = fake + 256;
  lca.out.len = 512;
  expect("ll combine out overlapping expert_out", moe_ep_ll_combine(NULL, NULL, NULL, &lca), BAD,
         "`out`", "`expert_out`");
  lca.out.ptr = fake + 2048;
  lca.out.len = 64;
  lca.weights.len = 4;
  expect("ll combine wait weights NULL with 4 elements",
         moe_ep_ll_combine_wait(NULL, NULL, NULL, &lca), BAD, "`weights`", "NULL");
  lca.weights.ptr = fake + 2048;
  expect("ll combine wait out overlapping weights", moe_ep_ll_combine_wait(NULL, NULL, NULL, &lca),
         BAD, "`out`", "`weights`");
  lca.weights.ptr = NULL;
  lca.weights.len = 0;
  expect("ll combine of a NULL group", moe_ep_ll_combine(NULL, NULL, NULL, &lca), BAD, "`group`",
         NULL);
  expect("ll combine wait of a NULL group", moe_ep_ll_combine_wait(NULL, NULL, NULL, &lca), BAD,
         "`group`", NULL);
  moe_ep_ll_handle_info_t li = MOE_EP_LL_HANDLE_INFO_INIT;
  moe_ep_ll_buffers_t lb = MOE_EP_LL_BUFFERS_INIT;
  expect("ll handle info of NULL", moe_ep_ll_handle_info(NULL, &li), BAD, "`handle`", NULL);
  expect("ll handle buffers of NULL", moe_ep_ll_handle_buffers(NULL, &lb), BAD, "`handle`", NULL);
  expect("destroy NULL ll handle", moe_ep_ll_handle_destroy(NULL), MOE_EP_OK, NULL, NULL);

  moe_ep_group_config_t lc = good_config();
  lc.mode = MOE_EP_MODE_LOW_LATENCY;
  uint64_t sym = 0, loc = 0;
  expect("ll buffer bytes of a NULL config", moe_ep_ll_buffer_bytes(NULL, 2, &sym, &loc), BAD,
         "`cfg`", "NULL");
  expect("ll buffer bytes at world 0", moe_ep_ll_buffer_bytes(&lc, 0, &sym, &loc), BAD, "`world`",
         NULL);
  lc.num_experts = 63;
  expect("ll buffer bytes of 63 experts at world 2", moe_ep_ll_buffer_bytes(&lc, 2, &sym, &loc),
         BAD, "`num_experts`", NULL);
  lc.num_experts = 64;
  expect("ll buffer bytes into NULL", moe_ep_ll_buffer_bytes(&lc, 2, NULL, NULL), MOE_EP_OK, NULL,
         NULL);

  int n = 0;
  uint64_t cap = 0;
  moe_ep_buffer_t *b = NULL;
  moe_ep_buf_mut_t bm;
  moe_ep_buf_t bi;
  expect("comm_rank of NULL", moe_ep_comm_rank(NULL, &n), BAD, "`comm`", NULL);
  expect("comm_world of NULL", moe_ep_comm_world(NULL, &n), BAD, "`comm`", NULL);
  expect("recv_capacity of NULL", moe_ep_group_recv_capacity(NULL, &cap), BAD, "`group`", NULL);
  expect("group_check of NULL", moe_ep_group_check(NULL), BAD, "`group`", NULL);
  expect("pool_alloc of NULL", moe_ep_pool_alloc(NULL, MOE_EP_DTYPE_BF16, 8, &b), BAD, "`group`",
         NULL);
  expect("buffer_get of NULL", moe_ep_buffer_get(NULL, &bm), BAD, "`buffer`", NULL);
  expect("is_symm_backed of NULL", moe_ep_is_symm_backed(NULL, fake, 8, &n), BAD, "`group`", NULL);
  /* The caller's windows (ABI 4): the group, the buffer and the out-parameter
   * are named before anything is wrapped. */
  expect("pool_wrap_window of a NULL group",
         moe_ep_pool_wrap_window(NULL, (struct ncclWindow_vidmem *)fake, fake, 4096, &b), BAD,
         "`group`", NULL);
  expect("pool_wrap_device of a NULL group", moe_ep_pool_wrap_device(NULL, fake, 4096, &b), BAD,
         "`group`", NULL);
  expect("buffer_range of a NULL buffer",
         moe_ep_buffer_range(NULL, 0, MOE_EP_DTYPE_BF16, 8, &bm), BAD, "`buffer`", NULL);
  expect("tokens_per_local_expert of NULL", moe_ep_handle_tokens_per_local_expert(NULL, &bi), BAD,
         "`handle`", NULL);
  moe_ep_recv_buffers_t rb = MOE_EP_RECV_BUFFERS_INIT;
  expect("dispatched_buffers of NULL", moe_ep_dispatched_buffers(NULL, &rb), BAD, "`dispatched`",
         NULL);
  moe_ep_handle_counts_t hc = MOE_EP_HANDLE_COUNTS_INIT;
  expect("handle_counts of NULL", moe_ep_handle_counts(NULL, NULL, &hc), BAD, "`handle`", NULL);
  /* The drop policy's results and the footprint (ABI 5). */
  uint64_t rows[2];
  uint8_t slots[8];
  uint64_t bytes = 0;
  moe_ep_memory_footprint_t fp = MOE_EP_MEMORY_FOOTPRINT_INIT;
  expect("dropped_rows into NULL", moe_ep_handle_dropped_rows(NULL, NULL, NULL, 2), BAD, "`out`",
         NULL);
  expect("dropped_rows of NULL", moe_ep_handle_dropped_rows(NULL, NULL, rows, 2), BAD,
         "`handle`", NULL);
  expect("dropped_slots into NULL with len 8", moe_ep_handle_dropped_slots(NULL, NULL, NULL, 8),
         BAD, "`out`", "NULL");
  expect("dropped_slots of NULL", moe_ep_handle_dropped_slots(NULL, NULL, slots, 8), BAD,
         "`handle`", NULL);
  expect("kept_topk_idx of NULL", moe_ep_handle_kept_topk_idx(NULL, &bi), BAD, "`handle`", NULL);
  expect("device_bytes of NULL", moe_ep_handle_device_bytes(NULL, &bytes), BAD, "`handle`", NULL);
  expect("memory_footprint of NULL", moe_ep_group_memory_footprint(NULL, &fp), BAD, "`group`",
         NULL);
  expect("device_count to NULL", moe_ep_device_count(NULL), BAD, "`out`", NULL);
  moe_ep_comm_t *comms[2];
  expect("virtual world 0", moe_ep_comm_create_virtual(0, 0, comms), BAD, "`world`", NULL);
  expect("virtual world into NULL", moe_ep_comm_create_virtual(0, 2, NULL), BAD, "`comms`", NULL);
  expect("comm_init without an id", moe_ep_comm_init(0, NULL, 0, 2, comms), BAD, "`id`", NULL);
  expect("borrow a NULL ncclComm_t", moe_ep_comm_borrow_nccl(0, NULL, comms), BAD, "`nccl`", NULL);
  uint64_t ms = 0;
  expect("host_timeout of NULL (ABI 6)", moe_ep_comm_host_timeout(NULL, &ms), BAD, "`comm`", NULL);
  expect("set_host_timeout of NULL (ABI 6)", moe_ep_comm_set_host_timeout(NULL, 1000), BAD,
         "`comm`", NULL);
  expect("destroy NULL comm", moe_ep_comm_destroy(NULL), MOE_EP_OK, NULL, NULL);
  expect("destroy NULL group", moe_ep_group_destroy(NULL), MOE_EP_OK, NULL, NULL);
  expect("destroy NULL handle", moe_ep_handle_destroy(NULL), MOE_EP_OK, NULL, NULL);
  expect("destroy NULL result", moe_ep_dispatched_destroy(NULL), MOE_EP_OK, NULL, NULL);
  expect("free NULL buffer", moe_ep_buffer_free(NULL), MOE_EP_OK, NULL, NULL);
}

static void no_driver(void) {
  int n = -1;
  moe_ep_status_t s = moe_ep_device_count(&n);
  if (s == MOE_EP_OK) {
    printf("skip no-driver checks: a driver is present (%d GPUs)\n", n);
    return;
  }
  expect("device_count without a driver", s, MOE_EP_ERR_NO_DRIVER, "driver", NULL);
  moe_ep_comm_t *comms[2] = {NULL, NULL};
  expect("virtual world without a driver", moe_ep_comm_create_virtual(0, 2, comms),
         MOE_EP_ERR_NO_DRIVER, "driver", NULL);
  /* Sizing needs no driver: 64 experts, hidden 2048, 256 tokens, world 2. */
  moe_ep_group_config_t c = good_config();
  c.mode = MOE_EP_MODE_LOW_LATENCY;
  uint64_t sym = 0, loc = 0;
  expect("ll buffer bytes without a driver", moe_ep_ll_buffer_bytes(&c, 2, &sym, &loc), MOE_EP_OK,
         NULL, NULL);
  uint64_t approx = 4ull * 2048 * 256 * (64 + 2 + 16);
  int sane = sym > 0 && loc > sym && sym + loc >= approx && sym + loc < approx + approx / 10;
  printf("%s ll buffer bytes: %llu symmetric + %llu local (about %llu)\n", sane ? "ok  " : "FAIL",
         (unsigned long long)sym, (unsigned long long)loc, (unsigned long long)approx);
  failures += !sane;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "layout") == 0) {
    layout();
    return 0;
  }
  version();
  structs();
  arguments();
  no_driver();
  printf("%s: %d failures\n", failures ? "FAILED" : "passed", failures);
  return failures ? 1 : 0;
}
