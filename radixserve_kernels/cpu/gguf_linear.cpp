// Linears over GGUF blocks as stored in the file (gguf_blocks.h): y[m, n] = sum_k x[m, k] w[n, k] (+ bias).
//
// How: the activations are quantized to int8 per block of 32 (scale = absmax / 127, as ggml's q8_0), then for each
// tile of kTile weight rows the blocks are unpacked into a small buffer of uint8 codes with a float (a, b) per 16
// weights, and every activation row is multiplied with the tile (gguf_tiles.h): an integer dot product of codes and
// int8 activations (AVX-512 VNNI vpdpbusd; AVX2's vpmaddubsw + vpmaddwd; plain C++ otherwise), scaled by a * x_scale
// in float per 16 columns on VNNI for the K-quants (per block of 32 for Q4_0, Q5_0 and Q8_0, and on AVX2), minus
// sum_j b_j * x_scale_j * (sum of the activation codes of block j). The tile stays in L1/L2 while all rows pass over
// it, so a prefill reads each weight byte once, like a decode step. With VNNI or AVX2, formats with a fixed zero point
// take it out inside the integer dot product instead, and decode steps (at most kFusedRows rows) skip the tile: codes
// go from the blocks to registers (gguf_decode.h and gguf_decode32.h on VNNI, gguf_decode_avx2.h on AVX2). On AVX2,
// the K-quants take that path at every row count, against activations rounded per 256 columns (as ggml's q8_K;
// QuantX.q256): a super-block then sums in integers before its float step;
// past a decode step's rows they, Q4_0 and Q5_0 transpose eight weight rows once for all activation rows instead of
// unpacking a tile (gguf_packed_avx2.h).
//
// Batch invariance: the result for row m depends only on x[m] and the weights. Every row takes the same quantization,
// the same unpacking and the same sequence of float operations whatever the step's row count or how the rows are
// grouped (each pair of activation row and weight row has its own accumulators; the decode rows and the tiles run
// the same integer sums and float steps in the same order), so a token's logits do not change with the batch it runs
// in (tests/test_gguf_kernels.py). What does differ is the instruction set: each build is invariant on its own.
#include "ops.h"
#include <ATen/core/Tensor.h>

#include "gguf_activations.h"
#include "gguf_blocks.h"
#include "gguf_tiles.h"
#include "spin_pool.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

namespace {

using namespace radixserve::gguf;  // NOLINT: the formats' type ids and the dot products (gguf_tiles.h)

constexpr int64_t kTile = 16;     // weight rows unpacked at a time: 16 x 4864 codes = 76 KiB, within L2
// Bytes ahead of the row being unpacked that are prefetched: unpacking stalled on each cache line of the blocks
// (measured: half the time of a Q8_0 LM head on one load), the hardware prefetcher alone does not run far enough.
constexpr int64_t kPrefetch = 4096;
// Activation rows up to which a call leaves its rounded activations' buffers to the next call on its thread (a decode
// step's rows, a speculative check's few: kilobytes); a prefill's are freed.
constexpr int64_t kKeptRows = 16;
// Below this many block bytes one thread does the whole call. A layer's q/k/v (0.7 MB) and o (0.55 MB) took one
// thread at 1 MiB (~30 us each, 48 calls a decode step, single-thread CPU time) while the pool's worker, spinning
// from the layer's previous linear, waited for the next.
constexpr int64_t kSerialBytes = int64_t{128} << 10;
// How much of the next linears' blocks the pool prefetches between two linears: what the gaps between them (norms,
// attention, Python: tens of us) can fetch, and well within the L3 the next linear reads it from.
constexpr int64_t kAheadBytes = int64_t{8} << 20;

// The weight rows of one call: the parts of a fused projection (q, k, v may each have their own block type),
// stacked in order along the output.
struct Part {
  const uint8_t* data;
  int64_t type, rows, row_bytes, first;  // first: its first output column
  int64_t tiles_begin, tiles_end;        // its tiles' indices, counted over all parts
};

// Unpack tile `t` (kTile rows of the stacked parts, never crossing a part) and multiply every activation row with it.
// The tiles are numbered part after part; `run` finds each one's part by walking the few parts (instead of a vector
// of every tile's part and row, rebuilt each call: 9,500 entries for the LM head every step).
struct Tiles {
  std::vector<Part> parts;
  int64_t count = 0;  // tiles over all parts

  void run(const QuantX& x, int64_t M, int64_t K, int64_t t0, int64_t t1, float* y, int64_t N) const {
    thread_local std::vector<uint8_t> u;
    thread_local std::vector<float> a, b;
    bool cleared = false;  // filled at this call's first unpacked tile: a decode step's fused calls never need them
    size_t i = 0;
    for (int64_t t = t0; t < t1; t++) {
      while (parts[i].tiles_end <= t) i++;
      const Part& p = parts[i];
      const int64_t r0 = (t - p.tiles_begin) * kTile, rows = std::min(kTile, p.rows - r0);
      if (fused(p.type, M, K)) {
        fused_rows(p.type, p.data + r0 * p.row_bytes, p.row_bytes, rows, x, M, y + p.first + r0, N);
        continue;
      }
      if (!cleared) {
        u.assign(kTile * x.K64, 0);  // zero padding: the columns past K contribute nothing
        a.assign(kTile * x.S, 0.f);
        b.assign(kTile * x.S, 0.f);
        cleared = true;
      }
      for (int64_t r = 0; r < rows; r++) {
        const uint8_t* next = p.data + (r0 + r) * p.row_bytes + kPrefetch;
        for (int64_t off = 0; off < p.row_bytes; off += 64) __builtin_prefetch(next + off);
        unpack_row(p.type, p.data + (r0 + r) * p.row_bytes, K, &u[r * x.K64], &a[r * x.S], &b[r * x.S]);
      }
      RowView views[kTile];
      for (int64_t r = 0; r < rows; r++) views[r] = {&u[r * x.K64], &a[r * x.S], &b[r * x.S]};
      dot_tile(p.type, views, rows, x, M, y + p.first + r0, N);
    }
  }
};

// c10::BFloat16's rounding of v (round to nearest even, NaN to 0x7FC0) written so that the compiler vectorizes the
// loops that call it, where static_cast<at::BFloat16> ran value by value (~2.4M outputs a decode step at eight rows;
// gguf_linear's own time in perf came out level either way, RESULTS.md issue 38 session 50).
inline uint16_t bf16_bits(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  const uint16_t rounded = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return v != v ? uint16_t{0x7FC0} : rounded;
}

Tiles plan(const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& types, int64_t K, int64_t& N,
           int64_t& bytes) {
  TORCH_CHECK(blocks.size() == types.size() && !blocks.empty(), "one block type per tensor of blocks");
  Tiles tiles;
  N = bytes = 0;
  for (size_t i = 0; i < blocks.size(); i++) {
    const at::Tensor& w = blocks[i];
    check_blocks(w, types[i], K);
    const int64_t begin = tiles.count;
    tiles.count += (w.size(0) + kTile - 1) / kTile;
    tiles.parts.push_back({w.data_ptr<uint8_t>(), types[i], w.size(0), w.size(1), N, begin, tiles.count});
    N += w.size(0);
    bytes += w.numel();
  }
  return tiles;
}

}  // namespace

namespace radixserve::cpu {

// y = x W^T + bias with W the stacked GGUF blocks: x float32 or bfloat16 [M, K], y [M, N] in x's dtype.
// `ahead`: the blocks the next linears will read, in order; their first kAheadBytes are handed to the pool to
// prefetch while the caller does the serial work between this linear and the next (SpinPool::prefetch_ahead).
at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& types,
                       const std::optional<at::Tensor>& bias,
                       const std::optional<std::vector<at::Tensor>>& ahead) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kXBlock == 0, "K must be a multiple of ", kXBlock);
  int64_t N, bytes;
  const Tiles tiles = plan(blocks, types, K, N, bytes);
  TORCH_CHECK(!bias || bias->numel() == N, "bias must have ", N, " values");
  at::Tensor out = x.new_empty({M, N});
  if (M == 0) return out;
  const at::Tensor xc = x.contiguous();  // rounded from its own dtype: a float32 copy was a pass and an allocation
  const bool per256 = std::any_of(types.begin(), types.end(), rounds_per_256);
  DecodeNeeds needs;  // the zero points the VNNI decode rows take out, and how they read the codes
  for (const int64_t t : types)
    if (kVnniLanes && zero_shift(t) >= 0 && fused(t, M, K))
      (is_block32(t) ? needs.zero32 : needs.zero16) |= 1u << zero_shift(t);
  // Its buffers outlive the call: the next linear on this thread reuses them. Bound to a plain reference so that
  // the pool's threads read this thread's (a lambda naming a thread_local reads the running thread's own).
  thread_local QuantX reused;
  QuantX& xq = reused;
  if (x.scalar_type() == at::kFloat)
    quantize_rows(xc.data_ptr<float>(), M, K, per256, needs, xq);
  else
    quantize_rows(xc.data_ptr<at::BFloat16>(), M, K, per256, needs, xq);
  // float32 without a bias: the kernels write the output itself. Otherwise a float32 buffer (every entry is
  // written, so it is not cleared: a zeroed 150k-entry LM head buffer cost a pass over 0.6 MB a step), then the bias
  // and the cast in one loop (separate torch ops cost ~10 us of dispatch each, ~100 linears a step).
  const bool direct = x.scalar_type() == at::kFloat && !bias;
  // A decode step's buffer is kept for the next call on this thread, as the activations' are (a new one per call,
  // up to 300 KB, went through malloc's consolidation); a prefill's is freed.
  thread_local std::vector<float> kept;
  std::unique_ptr<float[]> buffer;
  if (!direct && M > kKeptRows) buffer.reset(new float[M * N]);
  float* y = direct ? out.data_ptr<float>() : buffer ? buffer.get() : at_least(kept, M * N);
  const int64_t T = tiles.count;
  auto work = [&](int64_t t0, int64_t t1) { tiles.run(xq, M, K, t0, t1, y, N); };
  if (bytes < kSerialBytes)
    work(0, T);
  else
    radixserve::SpinPool::get().run(T, work);
  if (M > kKeptRows) xq = QuantX{};  // a prefill's buffers (MBs) are not kept past the call
  if (ahead && !ahead->empty()) {
    std::vector<std::pair<const uint8_t*, int64_t>> regions;
    int64_t left = kAheadBytes;
    for (const at::Tensor& a : *ahead) {
      TORCH_CHECK(a.is_contiguous(), "ahead: contiguous blocks");
      const int64_t n = std::min<int64_t>(left, a.numel() * a.element_size());
      regions.emplace_back(static_cast<const uint8_t*>(a.data_ptr()), n);
      if ((left -= n) == 0) break;
    }
    radixserve::SpinPool::get().prefetch_ahead(std::move(regions));
  }
  if (direct) return out;
  const at::Tensor bc = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias ? bc.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();  // not direct: it has a bias
    for (int64_t m = 0; m < M; m++)
      for (int64_t n = 0; n < N; n++) o[m * N + n] = y[m * N + n] + b[n];
  } else {
    uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
    for (int64_t m = 0; m < M; m++)
      if (b)
        for (int64_t n = 0; n < N; n++) o[m * N + n] = bf16_bits(y[m * N + n] + b[n]);
      else
        for (int64_t n = 0; n < N; n++) o[m * N + n] = bf16_bits(y[m * N + n]);
  }
  return out;
}

}  // namespace radixserve::cpu
