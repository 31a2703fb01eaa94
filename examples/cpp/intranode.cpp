// moe-ep from C++17 through the C ABI (capi/include/moe_ep.h): layout, dispatch,
// identity experts and combine on every rank, the round trip checked bit
// for bit on the host, both backward passes checked against it, and the
// ops timed with CUDA events. With --ll, then the low-latency mode: bf16
// and fp8-cast dispatch, identity experts, combine, each checked bit for
// bit and timed.
//
//   capi/install.sh PREFIX                # the library, header and packages
//   cmake -S examples/cpp -B target/cpp -DCMAKE_PREFIX_PATH=PREFIX
//   cmake --build target/cpp              # (CMakeLists.txt has the options)
//   target/cpp/intranode --virtual 4      # 4 virtual ranks on GPU 0
//   target/cpp/intranode --gpus 2         # 2 GPUs, one NCCL rank each (--gpus 1 too)
//   target/cpp/intranode                  # every local GPU (a power of two), or 2 virtual ranks
//   target/cpp/intranode --gpus 2 --ll    # and the low-latency round trips
//   target/cpp/intranode --virtual 4 --ranks-per-node 2  # 2 nodes of 2: the two-level path
//
// One thread per rank. Exit status 0 when every rank's checks pass.
#include "moe_ep.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr size_t kExperts = 64, kHidden = 2048, kTokens = 256, kTopk = 8;
// The low-latency group's max tokens per rank, and the tokens each rank sends
// (the first of its routing's kTokens).
constexpr size_t kLlTokens = 128;
// Timed iterations (INTRANODE_ITERS overrides; one warm-up before them).
int kIters = 20;
// Ranks per node (--ranks-per-node; 0: the whole world on one node). Below
// the world size the group runs the two-level path over several nodes.
int kRanksPerNode = 0;

// Throws the library's message on an error.
void ok(moe_ep_status_t s, const char *what) {
  if (s != MOE_EP_OK)
    throw std::runtime_error(std::string(what) + ": " + moe_ep_status_name(s) + ": " +
                             moe_ep_last_error());
}
void cuda(cudaError_t e, const char *what) {
  if (e != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
}

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return uint16_t(u >> 16);
}
float from_bf16(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The same seeded routing as examples/intranode.rs: K distinct experts per
// token, every 4th token leaves its last slot unrouted (-1).
struct Routing {
  std::vector<int64_t> idx;
  std::vector<float> w;
  std::vector<uint16_t> x;
};
Routing routing(int rank) {
  uint64_t state = 0x5EED ^ uint64_t(rank);
  auto below = [&](size_t n) {
    state += 0x9E3779B97F4A7C15ull;
    uint64_t z = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return size_t((z ^ (z >> 31)) % n);
  };
  Routing r;
  for (size_t t = 0; t < kTokens; t++) {
    size_t start = below(kExperts), stride = 2 * below(kExperts / 2) + 1;
    for (size_t j = 0; j < kTopk; j++) r.idx.push_back(int64_t((start + j * stride) % kExperts));
    if (t % 4 == 3) r.idx[(t + 1) * kTopk - 1] = -1;
  }
  for (size_t i = 0; i < kTokens * kTopk; i++) r.w.push_back(float(i % 5) / 4.0f);
  for (size_t i = 0; i < kTokens * kHidden; i++)
    r.x.push_back(to_bf16((float(below(4096)) - 2048.0f) / 512.0f));
  return r;
}

// A host barrier for the threads of one process (C++17 has none).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait() {
    std::unique_lock<std::mutex> l(m_);
    int gen = gen_;
    if (++count_ == n_) {
      count_ = 0;
      gen_++;
      cv_.notify_all();
    } else {
      cv_.wait(l, [&] { return gen != gen_; });
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_, count_ = 0, gen_ = 0;
};

template <class T>
T *device_copy(const std::vector<T> &host, cudaStream_t s) {
  T *d = nullptr;
  cuda(cudaMalloc(&d, host.size() * sizeof(T)), "cudaMalloc");
  // Drained first: virtual ranks share the driver's pageable staging buffers.
  cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  cuda(cudaMemcpy(d, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return d;
}
template <class T>
std::vector<T> host_copy(const T *d, size_t n, cudaStream_t s) {
  std::vector<T> h(n);
  cuda(cudaStreamSynchronize(s), "cudaStreamSynchronize");
  cuda(cudaMemcpy(h.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost), "cudaMemcpy");
  return h;
}

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2] * 1000.0;  // ms -> us
}

struct RankResult {
  std::string line;
  bool passed = false;
};

// One rank's work, collective with its peers.
RankResult run_rank(moe_ep_comm_t *comm, int device, cudaStream_t s, Barrier *host_barrier) {
  int rank = 0, world = 0;
  ok(moe_ep_comm_rank(comm, &rank), "moe_ep_comm_rank");
  ok(moe_ep_comm_world(comm, &world), "moe_ep_comm_world");
  cuda(cudaSetDevice(device), "cudaSetDevice");

  moe_ep_group_config_t cfg = MOE_EP_GROUP_CONFIG_INIT;
  cfg.num_experts = kExperts;
  cfg.hidden = kHidden;
  cfg.max_tokens_per_rank = kTokens;
  cfg.ranks_per_node = uint64_t(kRanksPerNode);
  uint32_t fit = 0;  // ranks that share a GPU must all fit on it at once
  ok(moe_ep_comm_max_sms(comm, kExperts, &fit), "moe_ep_comm_max_sms");
  // Several nodes on one GPU: one block per rank is combine's hop's.
  if (kRanksPerNode > 0 && kRanksPerNode < world && fit <= 24 && fit > 1) fit -= 1;
  cfg.num_sms = std::min<uint32_t>(24, fit);

  // Every allocation before the group exists (the group's barrier orders the
  // ranks after it); nothing that waits for the whole GPU while peers wait.
  Routing r = routing(rank);
  int64_t *d_idx = device_copy(r.idx, s);
  float *d_w = device_copy(r.w, s);
  uint16_t *d_x = device_copy(r.x, s);
  uint16_t *d_out = nullptr, *d_grad = nullptr;
  cuda(cudaMalloc(&d_out, kTokens * kHidden * 2), "cudaMalloc");
  cuda(cudaMalloc(&d_grad, kTokens * kHidden * 2), "cudaMalloc");
  cudaEvent_t ev[4];
  for (auto &e : ev) cuda(cudaEventCreate(&e), "cudaEventCreate");

  moe_ep_group_t *group = nullptr;
  ok(moe_ep_group_create(comm, &cfg, &group), "moe_ep_group_create");
  uint64_t cap = 0;
  ok(moe_ep_group_recv_capacity(group, &cap), "moe_ep_group_recv_capacity");

  moe_ep_layout_args_t la = MOE_EP_LAYOUT_ARGS_INIT;
  la.topk_idx = {d_idx, kTokens * kTopk};
  la.topk_idx_dtype = MOE_EP_DTYPE_I64;
  la.topk = kTopk;
  la.layout = MOE_EP_LAYOUT_RANK_MAJOR;
  moe_ep_dispatch_args_t da = MOE_EP_DISPATCH_ARGS_INIT;
  da.x = {d_x, kTokens * kHidden};
  da.topk_weights = {d_w, kTokens * kTopk};

  // The library checks what it can: a short input and host memory are
  // refused naming the argument, before anything is enqueued.
  std::string refused;
  {
    moe_ep_handle_t *h = nullptr;
    ok(moe_ep_layout(group, s, &la, &h), "moe_ep_layout");
    moe_ep_dispatch_args_t bad = da;
    bad.x.len -= 1;
    moe_ep_dispatched_t *d = nullptr;
    moe_ep_status_t st = moe_ep_dispatch(group, s, h, &bad, &d);
    bool named = st == MOE_EP_ERR_INVALID_ARGUMENT && std::strstr(moe_ep_last_error(), "`x`");
    bad = da;
    bad.topk_weights = {r.w.data(), r.w.size()};
    st = moe_ep_dispatch(group, s, h, &bad, &d);
    named = named && st == MOE_EP_ERR_INVALID_ARGUMENT &&
            std::strstr(moe_ep_last_error(), "`topk_weights`");
    if (kRanksPerNode > 0 && kRanksPerNode < world) {
      // A group of several nodes has no low-latency mode.
      moe_ep_ll_dispatch_args_t lla = MOE_EP_LL_DISPATCH_ARGS_INIT;
      lla.x = {d_x, kTokens * kHidden};
      lla.topk_idx = {d_idx, kTokens * kTopk};
      lla.topk_weights = {d_w, kTokens * kTopk};
      lla.topk_idx_dtype = MOE_EP_DTYPE_I64;
      lla.topk = kTopk;
      moe_ep_ll_handle_t *lh = nullptr;
      st = moe_ep_ll_dispatch(group, s, &lla, &lh);
      named = named && st == MOE_EP_ERR_INVALID_ARGUMENT &&
              std::strstr(moe_ep_last_error(), "`group`");
    }
    refused = !named ? "FAILED: bad arguments accepted"
              : kRanksPerNode > 0 && kRanksPerNode < world
                  ? "short `x`, host `topk_weights` and a low-latency dispatch refused by name"
                  : "short `x` and host `topk_weights` refused by name";
    ok(moe_ep_handle_destroy(h), "moe_ep_handle_destroy");
    ok(moe_ep_group_check(group), "moe_ep_group_check");
  }

  std::vector<float> t_layout, t_dispatch, t_combine;
  moe_ep_handle_counts_t counts = MOE_EP_HANDLE_COUNTS_INIT;
  for (int it = 0; it <= kIters; it++) {  // iteration 0 warms up
    moe_ep_handle_t *h = nullptr;
    moe_ep_dispatched_t *d = nullptr;
    cuda(cudaEventRecord(ev[0], s), "cudaEventRecord");
    ok(moe_ep_layout(group, s, &la, &h), "moe_ep_layout");
    cuda(cudaEventRecord(ev[1], s), "cudaEventRecord");
    ok(moe_ep_dispatch(group, s, h, &da, &d), "moe_ep_dispatch");
    cuda(cudaEventRecord(ev[2], s), "cudaEventRecord");
    moe_ep_recv_buffers_t recv = MOE_EP_RECV_BUFFERS_INIT;
    ok(moe_ep_dispatched_buffers(d, &recv), "moe_ep_dispatched_buffers");
    // Identity experts: the received rows are their own outputs, read in
    // place from symmetric memory by each token's home rank.
    moe_ep_combine_args_t ca = MOE_EP_COMBINE_ARGS_INIT;
    ca.expert_out = {recv.tokens.ptr, recv.tokens.len};
    ca.out = {d_out, kTokens * kHidden};
    ok(moe_ep_combine(group, s, h, &ca), "moe_ep_combine");
    cuda(cudaEventRecord(ev[3], s), "cudaEventRecord");
    if (it == kIters) {
      // Backward passes: dispatch's backward of the same rows is the same
      // sum; combine's backward of x sends x where dispatch sent it.
      moe_ep_dispatch_backward_args_t db = MOE_EP_DISPATCH_BACKWARD_ARGS_INIT;
      db.grad_recv_tokens = {recv.tokens.ptr, recv.tokens.len};
      db.grad_tokens = {d_grad, kTokens * kHidden};
      ok(moe_ep_dispatch_backward(group, s, h, &db), "moe_ep_dispatch_backward");
      std::vector<uint16_t> got_recv =
          host_copy(static_cast<const uint16_t *>(recv.tokens.ptr), recv.tokens.len, s);
      moe_ep_combine_backward_args_t cb = MOE_EP_COMBINE_BACKWARD_ARGS_INIT;
      cb.grad_out = {d_x, kTokens * kHidden};
      moe_ep_buffer_t *gexp = nullptr;
      ok(moe_ep_combine_backward(group, s, h, &cb, &gexp), "moe_ep_combine_backward");
      moe_ep_buf_mut_t gb;
      ok(moe_ep_buffer_get(gexp, &gb), "moe_ep_buffer_get");
      ok(moe_ep_handle_counts(h, s, &counts), "moe_ep_handle_counts");
      std::vector<uint16_t> got_gexp = host_copy(static_cast<const uint16_t *>(gb.ptr), gb.len, s);
      size_t n = counts.recv_rows * kHidden;
      if (!std::equal(got_recv.begin(), got_recv.begin() + n, got_gexp.begin()))
        throw std::runtime_error("combine backward of x differs from dispatch's received rows");
      ok(moe_ep_buffer_free(gexp), "moe_ep_buffer_free");
    }
    cuda(cudaEventSynchronize(ev[3]), "cudaEventSynchronize");
    if (it > 0) {
      float ms[3];
      for (int k = 0; k < 3; k++) cuda(cudaEventElapsedTime(&ms[k], ev[k], ev[k + 1]), "elapsed");
      t_layout.push_back(ms[0]);
      t_dispatch.push_back(ms[1]);
      t_combine.push_back(ms[2]);
    }
    ok(moe_ep_dispatched_destroy(d), "moe_ep_dispatched_destroy");
    ok(moe_ep_handle_destroy(h), "moe_ep_handle_destroy");
  }
  ok(moe_ep_group_check(group), "moe_ep_group_check");  // errors only the GPU saw
  std::vector<uint16_t> got = host_copy(d_out, kTokens * kHidden, s);
  std::vector<uint16_t> grad = host_copy(d_grad, kTokens * kHidden, s);

  // Every rank done with the GPU before any frees (cudaFree waits for the GPU).
  if (host_barrier) host_barrier->wait();
  ok(moe_ep_group_destroy(group), "moe_ep_group_destroy");
  for (auto &e : ev) cudaEventDestroy(e);
  cudaFree(d_idx), cudaFree(d_w), cudaFree(d_x), cudaFree(d_out), cudaFree(d_grad);

  // Each output row is its input row times the number of ranks it reached:
  // on one node one sum of those rows, rounded once; on several, each
  // node's sum rounded (the node's combine), then the nodes' in ascending
  // order, rounded once.
  const int per_node = kRanksPerNode > 0 ? kRanksPerNode : world;
  const uint32_t node_mask = (1u << per_node) - 1u;
  RankResult res;
  for (size_t t = 0; t < kTokens; t++) {
    uint32_t hit = 0;
    for (size_t j = 0; j < kTopk; j++) {
      int64_t e = r.idx[t * kTopk + j];
      if (e >= 0) hit |= 1u << (size_t(e) / (kExperts / size_t(world)));
    }
    for (size_t c = 0; c < kHidden; c++) {
      size_t i = t * kHidden + c;
      float x = from_bf16(r.x[i]), acc = 0.0f;
      for (int m = 0; m < world / per_node; m++) {
        float n = float(__builtin_popcount((hit >> (m * per_node)) & node_mask));
        if (n > 0.0f) acc += per_node == world ? x * n : from_bf16(to_bf16(x * n));
      }
      uint16_t want = to_bf16(acc);
      if (got[i] != want || grad[i] != want) {
        char buf[160];
        std::snprintf(buf, sizeof buf, "FAILED: token %zu, column %zu: combine %g, backward %g, want %g",
                      t, c, from_bf16(got[i]), from_bf16(grad[i]), from_bf16(want));
        res.line = buf;
        return res;
      }
    }
  }
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "%s%llu tokens received (capacity %llu), %u SMs; out = x * ranks reached, bit for bit "
                "(combine and dispatch backward), combine backward = dispatch; %s; median of %d: "
                "layout %.1f us, dispatch %.1f us, combine %.1f us",
                per_node == world ? "" : ("nodes of " + std::to_string(per_node) + " ranks: ").c_str(),
                (unsigned long long)counts.recv_tokens, (unsigned long long)cap, cfg.num_sms,
                refused.c_str(), kIters, median(t_layout), median(t_dispatch), median(t_combine));
  res.line = buf;
  res.passed = refused.rfind("FAILED", 0) != 0;
  return res;
}

// ---- the low-latency mode ----

// moe_ep::reference's fp8 e4m3 cast with Fp8Scaling::Exact, bit for bit
// (src/reference/fp8.rs): per 128 values amax = max(1e-4, max |x|),
// scale = amax * (1/448), code = e4m3(x * (448 / amax)), round to nearest
// even, saturating. Plain f32 arithmetic (no fast-math, no contraction).
uint8_t f32_to_e4m3(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  uint8_t sign = uint8_t((bits >> 24) & 0x80);
  float a = std::fabs(x);
  if (std::isnan(a)) return 0x7F;
  if (a >= 448.0f) return sign | 0x7E;
  if (a < 0.015625f) return sign | uint8_t(std::nearbyint(a * 512.0f));  // below 2^-6: m * 2^-9
  uint32_t ab;
  std::memcpy(&ab, &a, 4);
  uint32_t mant = ab & 0x7FFFFF;
  uint32_t code = (uint32_t(int(ab >> 23) - 127 + 7) << 3) | (mant >> 20);
  uint32_t rest = mant & 0xFFFFF;
  if (rest > 0x80000 || (rest == 0x80000 && (code & 1))) code++;
  return sign | uint8_t(code);
}
float e4m3_to_f32(uint8_t q) {
  uint8_t mag = q & 0x7F;
  if (mag == 0x7F) return NAN;
  int exp = mag >> 3;
  float m = float(mag & 7);
  float v = exp == 0 ? std::ldexp(m, -9) : std::ldexp(8.0f + m, exp - 10);
  return (q & 0x80) ? -v : v;
}
// One row of kHidden bf16 values: kHidden codes, kHidden / 128 scales.
void quantize_row(const uint16_t *x, uint8_t *q, float *scales) {
  for (size_t b = 0; b < kHidden / 128; b++) {
    const uint16_t *xb = x + b * 128;
    float amax = 1e-4f;
    for (size_t i = 0; i < 128; i++) amax = std::fmax(amax, std::fabs(from_bf16(xb[i])));
    scales[b] = amax * (1.0f / 448.0f);
    float mul = 448.0f / amax;
    for (size_t i = 0; i < 128; i++) q[b * 128 + i] = f32_to_e4m3(from_bf16(xb[i]) * mul);
  }
}

// The expert-major combine of identity experts on the home rank: per token,
// f32 acc = fma(w[t, k], row(t), acc) over the routed slots k ascending,
// rounded to bf16 once (every copy of token t carries the same row).
std::vector<uint16_t> expert_major_sum(const Routing &r, const std::vector<uint16_t> &rows) {
  std::vector<uint16_t> out(kLlTokens * kHidden);
  for (size_t t = 0; t < kLlTokens; t++)
    for (size_t c = 0; c < kHidden; c++) {
      float acc = 0.0f;
      for (size_t k = 0; k < kTopk; k++)
        if (r.idx[t * kTopk + k] >= 0)
          acc = std::fma(r.w[t * kTopk + k], from_bf16(rows[t * kHidden + c]), acc);
      out[t * kHidden + c] = to_bf16(acc);
    }
  return out;
}

struct LlCase {
  const char *name;
  uint32_t layout, payload;
  bool two_phase;
};

// One rank's low-latency round trips, collective with its peers; every
// allocation before the group exists, as in run_rank.
std::string run_ll(moe_ep_comm_t *comm, int device, cudaStream_t s, Barrier *host_barrier,
                   uint32_t num_sms) {
  int rank = 0, world = 0;
  ok(moe_ep_comm_rank(comm, &rank), "moe_ep_comm_rank");
  ok(moe_ep_comm_world(comm, &world), "moe_ep_comm_world");
  cuda(cudaSetDevice(device), "cudaSetDevice");
  const size_t T = kLlTokens, K = kTopk, H = kHidden, W = size_t(world), El = kExperts / W;
  const size_t NB = H / 128, rows = El * W * kLlTokens;  // expert-major rows

  moe_ep_group_config_t cfg = MOE_EP_GROUP_CONFIG_INIT;
  cfg.mode = MOE_EP_MODE_LOW_LATENCY;
  cfg.num_experts = kExperts;
  cfg.hidden = H;
  cfg.max_tokens_per_rank = kLlTokens;
  cfg.num_sms = num_sms;
  uint64_t sym = 0, local = 0;
  ok(moe_ep_ll_buffer_bytes(&cfg, world, &sym, &local), "moe_ep_ll_buffer_bytes");

  // Every rank's tokens and their fp8 cast, so that an expert rank can check
  // what it received; this rank sends the first T tokens of its routing.
  std::vector<Routing> all;
  std::vector<std::vector<uint8_t>> q(W, std::vector<uint8_t>(T * H));
  std::vector<std::vector<float>> sc(W, std::vector<float>(T * NB));
  for (size_t r = 0; r < W; r++) {
    all.push_back(routing(int(r)));
    for (size_t t = 0; t < T; t++)
      quantize_row(&all[r].x[t * H], &q[r][t * H], &sc[r][t * NB]);
  }
  Routing r = all[size_t(rank)];
  r.idx.resize(T * K), r.w.resize(T * K), r.x.resize(T * H);
  std::vector<uint16_t> dq(T * H);  // this rank's tokens as the fp8 experts see them
  for (size_t i = 0; i < T * H; i++)
    dq[i] = to_bf16(e4m3_to_f32(q[size_t(rank)][i]) * sc[size_t(rank)][i / 128]);

  int64_t *d_idx = device_copy(r.idx, s);
  float *d_w = device_copy(r.w, s);
  uint16_t *d_x = device_copy(r.x, s);
  uint16_t *d_out = nullptr, *d_y = nullptr;
  cuda(cudaMalloc(&d_out, T * H * 2), "cudaMalloc");
  cuda(cudaMalloc(&d_y, rows * H * 2), "cudaMalloc");  // the fp8 experts' bf16 outputs
  cudaEvent_t ev[4];
  for (auto &e : ev) cuda(cudaEventCreate(&e), "cudaEventCreate");

  moe_ep_group_t *group = nullptr;
  ok(moe_ep_group_create(comm, &cfg, &group), "moe_ep_group_create (low latency)");

  const LlCase cases[] = {
      {"bf16 expert-major", MOE_EP_LAYOUT_EXPERT_MAJOR, MOE_EP_LL_BF16, false},
      {"bf16 rank-major two-phase", MOE_EP_LAYOUT_RANK_MAJOR, MOE_EP_LL_BF16, true},
      {"fp8 expert-major", MOE_EP_LAYOUT_EXPERT_MAJOR, MOE_EP_LL_CAST_FP8_EXACT, false},
  };
  std::string times, failed;
  bool refused = false;
  moe_ep_ll_handle_t *last = nullptr;  // kept past the group's destroy (it holds the group)
  uint32_t batches = 0;  // the group alternates its two buffer sets over all of its batches
  for (const LlCase &c : cases) {
    bool fp8 = c.payload != MOE_EP_LL_BF16;
    moe_ep_ll_dispatch_args_t da = MOE_EP_LL_DISPATCH_ARGS_INIT;
    da.x = {d_x, T * H};
    da.topk_idx = {d_idx, T * K};
    da.topk_idx_dtype = MOE_EP_DTYPE_I64;
    da.topk_weights = {d_w, T * K};
    da.topk = K;
    da.layout = c.layout;
    da.payload = c.payload;
    std::vector<float> t_dispatch, t_combine;
    for (int it = 0; it <= kIters; it++) {  // iteration 0 warms up
      moe_ep_ll_handle_t *h = nullptr;
      moe_ep_ll_handle_info_t info = MOE_EP_LL_HANDLE_INFO_INIT;
      cuda(cudaEventRecord(ev[0], s), "cudaEventRecord");
      if (c.two_phase) {
        ok(moe_ep_ll_dispatch_send(group, s, &da, &h), "moe_ep_ll_dispatch_send");
        // (other work of the stream would go here)
        ok(moe_ep_ll_dispatch_wait(group, s, h), "moe_ep_ll_dispatch_wait");
      } else {
        ok(moe_ep_ll_dispatch(group, s, &da, &h), "moe_ep_ll_dispatch");
      }
      cuda(cudaEventRecord(ev[1], s), "cudaEventRecord");
      moe_ep_ll_buffers_t b = MOE_EP_LL_BUFFERS_INIT;
      ok(moe_ep_ll_handle_buffers(h, &b), "moe_ep_ll_handle_buffers");
      ok(moe_ep_ll_handle_info(h, &info), "moe_ep_ll_handle_info");
      if (info.num_rows != (c.layout == MOE_EP_LAYOUT_EXPERT_MAJOR ? rows : W * kLlTokens) ||
          info.state != MOE_EP_LL_RECEIVED || info.fp8 != uint32_t(fp8) ||
          info.buffer_set != batches % 2)
        failed += std::string(c.name) + ": unexpected handle info; ";
      batches++;
      if (fp8 && it == 0) {
        // The experts: each received row checked against its source token's
        // cast, then dequantized to bf16 (y = e4m3(q) * scale), the rows
        // every later iteration's combine reads (the packing is the same).
        std::vector<uint8_t> codes = host_copy(static_cast<const uint8_t *>(b.fp8_codes.ptr), b.fp8_codes.len, s);
        std::vector<float> scales = host_copy(static_cast<const float *>(b.fp8_scales.ptr), b.fp8_scales.len, s);
        std::vector<int32_t> src = host_copy(static_cast<const int32_t *>(b.src.ptr), b.src.len, s);
        std::vector<int32_t> count = host_copy(static_cast<const int32_t *>(b.tokens_per_local_expert.ptr), El, s);
        std::vector<uint16_t> y(rows * H, 0);
        size_t pairs = 0, want = 0;
        for (size_t sr = 0; sr < W; sr++)
          for (size_t i = 0; i < T * K; i++)
            want += all[sr].idx[i] >= 0 && size_t(all[sr].idx[i]) / El == size_t(rank);
        for (size_t j = 0; j < El && failed.empty(); j++) {
          int64_t expert = int64_t(size_t(rank) * El + j), prev = -1;
          for (int32_t i = 0; i < count[j] && failed.empty(); i++, pairs++) {
            size_t row = j * W * kLlTokens + size_t(i);
            int32_t sr = src[2 * row], t = src[2 * row + 1];
            bool routed = sr >= 0 && size_t(sr) < W && t >= 0 && size_t(t) < T &&
                          int64_t(sr) * int64_t(T) + t > prev;  // packed by (rank, token)
            for (size_t k = 0; routed && k < K; k++)
              if (all[size_t(sr)].idx[size_t(t) * K + k] == expert) break;
              else if (k == K - 1) routed = false;
            if (!routed ||
                std::memcmp(&codes[row * H], &q[size_t(sr)][size_t(t) * H], H) != 0 ||
                std::memcmp(&scales[row * NB], &sc[size_t(sr)][size_t(t) * NB], NB * 4) != 0) {
              char buf[160];
              std::snprintf(buf, sizeof buf, "fp8 row %zu of expert %zu (from rank %d, token %d) is wrong; ",
                            size_t(i), j, sr, t);
              failed += buf;
            }
            prev = int64_t(sr) * int64_t(T) + t;
            for (size_t col = 0; col < H; col++)
              y[row * H + col] = to_bf16(e4m3_to_f32(codes[row * H + col]) * scales[row * NB + col / 128]);
          }
        }
        if (failed.empty() && pairs != want) failed += "fp8: received pair count is not the routing's; ";
        cuda(cudaMemcpy(d_y, y.data(), y.size() * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
      }
      // Identity experts: the received bf16 rows (or the dequantized fp8
      // rows) are their own outputs; expert-major combine weights them here.
      moe_ep_ll_combine_args_t ca = MOE_EP_LL_COMBINE_ARGS_INIT;
      ca.expert_out = fp8 ? moe_ep_buf_t{d_y, rows * H} : b.tokens;
      ca.out = {d_out, T * H};
      cuda(cudaEventRecord(ev[2], s), "cudaEventRecord");
      if (c.two_phase) {
        ok(moe_ep_ll_combine_send(group, s, h, &ca), "moe_ep_ll_combine_send");
        if (it == 0) {
          // A refused wait leaves the batch sent: fix the call, wait again.
          moe_ep_ll_combine_args_t bad = ca;
          bad.out.len -= 1;
          moe_ep_status_t st = moe_ep_ll_combine_wait(group, s, h, &bad);
          refused = st == MOE_EP_ERR_INVALID_ARGUMENT && std::strstr(moe_ep_last_error(), "`out`") &&
                    moe_ep_ll_handle_info(h, &info) == MOE_EP_OK && info.state == MOE_EP_LL_COMBINE_SENT;
        }
        ok(moe_ep_ll_combine_wait(group, s, h, &ca), "moe_ep_ll_combine_wait");
      } else {
        ok(moe_ep_ll_combine(group, s, h, &ca), "moe_ep_ll_combine");
      }
      cuda(cudaEventRecord(ev[3], s), "cudaEventRecord");
      cuda(cudaEventSynchronize(ev[3]), "cudaEventSynchronize");
      if (it > 0) {
        float ms[2];
        cuda(cudaEventElapsedTime(&ms[0], ev[0], ev[1]), "elapsed");
        cuda(cudaEventElapsedTime(&ms[1], ev[2], ev[3]), "elapsed");
        t_dispatch.push_back(ms[0]);
        t_combine.push_back(ms[1]);
      }
      if (it == kIters) {
        ok(moe_ep_group_check(group), "moe_ep_group_check");
        std::vector<uint16_t> got = host_copy(d_out, T * H, s);
        std::vector<uint16_t> want;
        if (c.layout == MOE_EP_LAYOUT_EXPERT_MAJOR) {
          want = expert_major_sum(r, fp8 ? dq : r.x);
        } else {  // rank-major: the token times the ranks it reached
          want.resize(T * H);
          for (size_t t = 0; t < T; t++) {
            uint32_t hit = 0;
            for (size_t k = 0; k < K; k++)
              if (r.idx[t * K + k] >= 0) hit |= 1u << (size_t(r.idx[t * K + k]) / El);
            for (size_t col = 0; col < H; col++)
              want[t * H + col] = to_bf16(from_bf16(r.x[t * H + col]) * float(__builtin_popcount(hit)));
          }
        }
        for (size_t i = 0; i < T * H; i++)
          if (got[i] != want[i]) {
            char buf[200];
            std::snprintf(buf, sizeof buf, "%s: token %zu, column %zu: %g, want %g; ", c.name, i / H,
                          i % H, from_bf16(got[i]), from_bf16(want[i]));
            failed += buf;
            break;
          }
      }
      if (it == kIters && &c == &cases[2]) {
        last = h;
      } else {
        ok(moe_ep_ll_handle_destroy(h), "moe_ep_ll_handle_destroy");
      }
    }
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s%s dispatch %.1f us, combine %.1f us", times.empty() ? "" : "; ",
                  c.name, median(t_dispatch), median(t_combine));
    times += buf;
  }

  // Every rank done with the GPU before any frees. The last handle holds
  // the group: destroying the group first is allowed, the handle stays
  // readable, and the group goes with it.
  if (host_barrier) host_barrier->wait();
  ok(moe_ep_group_destroy(group), "moe_ep_group_destroy (low latency)");
  moe_ep_ll_handle_info_t info = MOE_EP_LL_HANDLE_INFO_INIT;
  ok(moe_ep_ll_handle_info(last, &info), "moe_ep_ll_handle_info after the group's destroy");
  if (info.state != MOE_EP_LL_COMBINED) failed += "the kept handle is not combined; ";
  ok(moe_ep_ll_handle_destroy(last), "moe_ep_ll_handle_destroy");
  for (auto &e : ev) cudaEventDestroy(e);
  cudaFree(d_idx), cudaFree(d_w), cudaFree(d_x), cudaFree(d_out), cudaFree(d_y);
  if (!refused) failed += "a short `out` was not refused by name, or the batch left COMBINE_SENT; ";

  if (!failed.empty()) return "FAILED: low latency: " + failed;
  char buf[700];
  std::snprintf(buf, sizeof buf,
                "low latency, %zu tokens, %u SMs, buffers %.1f MB (%.1f MB symmetric): out bit for "
                "bit (expert-major: the home's weights over x, fp8: over the dequantized cast, "
                "whose codes equal the host's; rank-major: x * ranks reached); short `out` "
                "refused, waited again; median of %d: %s",
                T, num_sms, double(sym + local) / 1e6, double(sym) / 1e6, kIters, times.c_str());
  return buf;
}

int usage() {
  std::fprintf(stderr,
               "usage: intranode [--virtual W | --gpus N] [--ranks-per-node P] [--ll]\n"
               "  W, N in 1, 2, 4, 8; P a divisor of the world below it: the two-level path over\n"
               "  world / P nodes (not with --ll)\n");
  return 2;
}

}  // namespace

int main(int argc, char **argv) {
  setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);  // more queues for virtual ranks
  if (const char *it = std::getenv("INTRANODE_ITERS")) kIters = std::max(1, std::atoi(it));
  std::printf("moe-ep %s\n", moe_ep_version_string());
  int gpus = 0;
  moe_ep_status_t st = moe_ep_device_count(&gpus);
  if (st != MOE_EP_OK || gpus == 0) {
    std::printf("no GPU: %s\n", st != MOE_EP_OK ? moe_ep_last_error() : "0 devices");
    return 0;
  }
  bool virt = gpus == 1, ll = false;
  int world = virt ? 2 : 1 << (31 - __builtin_clz(unsigned(std::min(gpus, 8))));
  for (int a = 1; a < argc; a++) {
    if (std::strcmp(argv[a], "--ll") == 0) {
      ll = true;
    } else if (a + 1 < argc && std::strcmp(argv[a], "--virtual") == 0) {
      virt = true, world = std::atoi(argv[++a]);
    } else if (a + 1 < argc && std::strcmp(argv[a], "--gpus") == 0) {
      virt = false, world = std::atoi(argv[++a]);
    } else if (a + 1 < argc && std::strcmp(argv[a], "--ranks-per-node") == 0) {
      kRanksPerNode = std::atoi(argv[++a]);
    } else {
      return usage();
    }
  }
  if (world < 1 || world > 8 || (world & (world - 1)) || (!virt && world > gpus)) return usage();
  if (kRanksPerNode < 0 || (kRanksPerNode > 0 && world % kRanksPerNode != 0) ||
      (kRanksPerNode > 0 && ll))
    return usage();

  const size_t n = size_t(world);
  std::vector<moe_ep_comm_t *> comms(n, nullptr);
  std::vector<cudaStream_t> streams(n, nullptr);
  std::vector<RankResult> results(n);
  std::vector<std::string> ll_results(n);
  Barrier barrier(world);
  try {
    if (virt) {
      cuda(cudaSetDevice(0), "cudaSetDevice");
      ok(moe_ep_comm_create_virtual(0, world, comms.data()), "moe_ep_comm_create_virtual");
    }
    // Streams made one after another: the driver spreads them over its queues.
    for (int r = 0; r < world; r++) {
      cuda(cudaSetDevice(virt ? 0 : r), "cudaSetDevice");
      cuda(cudaStreamCreateWithFlags(&streams[size_t(r)], cudaStreamNonBlocking), "cudaStreamCreate");
    }
  } catch (const std::exception &e) {
    std::printf("FAILED: %s\n", e.what());
    return 1;
  }
  moe_ep_unique_id_t id;
  if (!virt && moe_ep_unique_id_create(&id) != MOE_EP_OK) {
    std::printf("FAILED: moe_ep_unique_id_create: %s\n", moe_ep_last_error());
    return 1;
  }
  std::vector<std::thread> threads;
  for (int r = 0; r < world; r++) {
    threads.emplace_back([&, r] {
      size_t i = size_t(r);
      int device = virt ? 0 : r;
      ll_results[i] = "FAILED: not run";
      try {
        if (!virt) ok(moe_ep_comm_init(device, &id, r, world, &comms[i]), "moe_ep_comm_init");
        results[i] = run_rank(comms[i], device, streams[i], &barrier);
      } catch (const std::exception &e) {
        results[i].line = std::string("FAILED: ") + e.what();
        return;
      }
      if (!ll) return;
      try {
        uint32_t fit = 0;
        ok(moe_ep_comm_max_sms(comms[i], kExperts, &fit), "moe_ep_comm_max_sms");
        ll_results[i] = run_ll(comms[i], device, streams[i], &barrier, std::min<uint32_t>(24, fit));
      } catch (const std::exception &e) {
        ll_results[i] = std::string("FAILED: ") + e.what();
      }
    });
  }
  for (auto &t : threads) t.join();
  bool all = true;
  for (int r = 0; r < world; r++) {
    std::printf("rank %d of %d (%s): %s\n", r, world, virt ? "virtual, GPU 0" : "NCCL",
                results[size_t(r)].line.c_str());
    all = all && results[size_t(r)].passed;
    if (ll) {
      std::printf("rank %d of %d: %s\n", r, world, ll_results[size_t(r)].c_str());
      all = all && ll_results[size_t(r)].rfind("FAILED", 0) != 0;
    }
    moe_ep_comm_destroy(comms[size_t(r)]);
    cudaStreamDestroy(streams[size_t(r)]);
  }
  std::printf("%s\n", all ? "passed" : "FAILED");
  return all ? 0 : 1;
}
