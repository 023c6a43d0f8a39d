// Linears over GGUF blocks as stored in the file (gguf_blocks.h): y[m, n] = sum_k x[m, k] w[n, k] (+ bias).
//
// How: the activations are quantized to int8 per block of 32 (scale = absmax / 127, as ggml's q8_0), then for each
// tile of kTile weight rows the blocks are unpacked into a small buffer of uint8 codes with a float (a, b) per 16
// weights, and every activation row is multiplied with the tile: an integer dot product of codes and int8
// activations per 64 columns (AVX-512 VNNI vpdpbusd; AVX2 widens to int16 and uses vpmaddwd; plain C++ otherwise),
// scaled per lane by a * x_scale in float, minus sum_j b_j * x_scale_j * (sum of the activation codes of block j).
// The tile stays in L1/L2 while all rows pass over it, so a prefill reads each weight byte once, like a decode step.
//
// Batch invariance: the result for row m depends only on x[m] and the weights. Every row takes the same quantization,
// the same unpacking and the same sequence of float operations whatever the step's row count or how the rows are
// grouped (rows are blocked in registers by kRowBlock, each with its own accumulator), so a token's logits do not
// change with the batch it runs in. What does differ is the instruction set: each build is invariant on its own.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "gguf_blocks.h"
#include "spin_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using radixserve::gguf::format_of;
using radixserve::gguf::kSub;
using radixserve::gguf::unpack_row;

constexpr int64_t kXBlock = 32;   // activations per int8 scale (ggml's q8_0 block)
constexpr int64_t kChunk = 64;    // columns per vpdpbusd: 16 int32 lanes of 4 bytes
constexpr int64_t kTile = 16;     // weight rows unpacked at a time: 16 x 4864 codes = 76 KiB, within L2
constexpr int64_t kRowBlock = 4;  // activation rows sharing one load of the codes
// Bytes ahead of the row being unpacked that are prefetched: unpacking stalled on each cache line of the blocks
// (measured: half the time of a Q8_0 LM head on one load), the hardware prefetcher alone does not run far enough.
constexpr int64_t kPrefetch = 4096;
constexpr int64_t kSerialBytes = int64_t{1} << 20;  // below this many block bytes one thread does the whole call

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// The activations as the dot products read them. K64: K padded to 64 with zero codes; S: per-16 entries padded to
// a multiple of 16 (zero), so the offset term's loop has no tail.
struct QuantX {
  int64_t K64, S;
  std::vector<int8_t> q;       // [M][K64]
  std::vector<float> lane;     // [M][K64 / 4]: the scale of the block each group of 4 codes belongs to
  std::vector<float> scale16;  // [M][S]: the scale per 16 columns
  std::vector<float> corr;     // [M][S]: scale * (sum of the 16 codes), what the offsets b multiply
};

// ggml's q8_0 rounding: q = nearest-even(x * (127 / absmax)), scale = absmax / 127 (0 for an all-zero block).
void quantize_block(const float* x, int8_t* q, float& scale) {
  float amax = 0.f;
  for (int j = 0; j < kXBlock; j++) amax = std::max(amax, std::fabs(x[j]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  scale = amax / 127.f;
  for (int j = 0; j < kXBlock; j++) q[j] = static_cast<int8_t>(std::clamp(std::nearbyint(x[j] * inv), -127.f, 127.f));
}

QuantX quantize_rows(const float* x, int64_t M, int64_t K) {
  QuantX xq{round_up(K, kChunk), round_up(round_up(K, kChunk) / kSub, 16), {}, {}, {}, {}};
  xq.q.assign(M * xq.K64, 0);
  xq.lane.assign(M * xq.K64 / 4, 0.f);
  xq.scale16.assign(M * xq.S, 0.f);
  xq.corr.assign(M * xq.S, 0.f);
  for (int64_t m = 0; m < M; m++) {
    int8_t* q = xq.q.data() + m * xq.K64;
    for (int64_t blk = 0; blk < K / kXBlock; blk++) {
      float s;
      quantize_block(x + m * K + blk * kXBlock, q + blk * kXBlock, s);
      std::fill_n(xq.lane.data() + m * xq.K64 / 4 + blk * 8, 8, s);
      for (int h = 0; h < 2; h++) {
        int sum = 0;
        for (int j = 0; j < 16; j++) sum += q[blk * kXBlock + h * 16 + j];
        xq.scale16[m * xq.S + blk * 2 + h] = s;
        xq.corr[m * xq.S + blk * 2 + h] = s * static_cast<float>(sum);
      }
    }
  }
  return xq;
}

// One weight row unpacked (gguf_blocks.h), padded like the activations.
struct RowView {
  const uint8_t* u;
  const float* a;
  const float* b;
};

// sum_j b[j] * corr[j]: the offsets' share of a row's dot product (S is a multiple of 16).
inline float offsets(const float* b, const float* corr, int64_t S) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t j = 0; j < S; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(b + j), _mm512_loadu_ps(corr + j), acc);
  return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t j = 0; j < S; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(b + j), _mm256_loadu_ps(corr + j), acc);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
#else
  float acc = 0.f;
  for (int64_t j = 0; j < S; j++) acc += b[j] * corr[j];
  return acc;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

// y[r] for RB activation rows starting at m0 against one weight row.
template <int RB>
inline void dot_rows(const RowView& w, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);  // a per 16 -> lanes
  __m512 acc[RB];
  for (int r = 0; r < RB; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < x.K64 / kChunk; c++) {
    const __m512i u = _mm512_loadu_si512(w.u + c * kChunk);
    const __m512 a = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(w.a + c * 4)));
    for (int r = 0; r < RB; r++) {
      const int64_t m = m0 + r;
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, _mm512_loadu_si512(&x.q[m * x.K64 + c * kChunk]));
      const __m512 s = _mm512_mul_ps(a, _mm512_loadu_ps(&x.lane[m * x.K64 / 4 + c * 16]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, acc[r]);
    }
  }
  for (int r = 0; r < RB; r++)
    y[r * ldy] = _mm512_reduce_add_ps(acc[r]) - offsets(w.b, &x.corr[(m0 + r) * x.S], x.S);
}

#elif defined(__AVX2__) && defined(__FMA__)

// No vpdpbusd: codes and activations widened to int16, vpmaddwd sums pairs exactly (vpmaddubsw would saturate at
// 255 * 127 * 2), one (a * scale) per 16 columns.
template <int RB>
inline void dot_rows(const RowView& w, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  __m256 acc[RB];
  for (int r = 0; r < RB; r++) acc[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < x.K64 / kSub; j++) {
    const __m256i u = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.u + j * kSub)));
    for (int r = 0; r < RB; r++) {
      const int64_t m = m0 + r;
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(&x.q[m * x.K64 + j * kSub]));
      const __m256i dot = _mm256_madd_epi16(u, _mm256_cvtepi8_epi16(q));
      const __m256 s = _mm256_set1_ps(w.a[j] * x.scale16[m * x.S + j]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), s, acc[r]);
    }
  }
  for (int r = 0; r < RB; r++) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[r]), _mm256_extractf128_ps(acc[r], 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    y[r * ldy] = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h))) - offsets(w.b, &x.corr[(m0 + r) * x.S], x.S);
  }
}

#else

template <int RB>
inline void dot_rows(const RowView& w, const QuantX& x, int64_t m0, float* y, int64_t ldy) {
  for (int r = 0; r < RB; r++) {
    const int64_t m = m0 + r;
    float acc = 0.f;
    for (int64_t j = 0; j < x.K64 / kSub; j++) {
      int32_t dot = 0;
      for (int64_t l = 0; l < kSub; l++) dot += w.u[j * kSub + l] * x.q[m * x.K64 + j * kSub + l];
      acc += static_cast<float>(dot) * (w.a[j] * x.scale16[m * x.S + j]);
    }
    y[r * ldy] = acc - offsets(w.b, &x.corr[m * x.S], x.S);
  }
}

#endif

// The weight rows of one call: the parts of a fused projection (q, k, v may each have their own block type),
// stacked in order along the output.
struct Part {
  const uint8_t* data;
  int64_t type, rows, row_bytes, first;  // first: its first output column
};

// Unpack tile `t` (kTile rows of the stacked parts, never crossing a part) and multiply every activation row with it.
struct Tiles {
  std::vector<Part> parts;
  std::vector<std::pair<int64_t, int64_t>> index;  // tile -> (part, first row in the part)

  void run(const QuantX& x, int64_t M, int64_t K, int64_t t0, int64_t t1, float* y, int64_t N) const {
    thread_local std::vector<uint8_t> u;
    thread_local std::vector<float> a, b;
    u.assign(kTile * x.K64, 0);  // zero padding: the columns past K contribute nothing
    a.assign(kTile * x.S, 0.f);
    b.assign(kTile * x.S, 0.f);
    for (int64_t t = t0; t < t1; t++) {
      const Part& p = parts[index[t].first];
      const int64_t r0 = index[t].second, rows = std::min(kTile, p.rows - r0);
      for (int64_t r = 0; r < rows; r++) {
        const uint8_t* next = p.data + (r0 + r) * p.row_bytes + kPrefetch;
        for (int64_t off = 0; off < p.row_bytes; off += 64) __builtin_prefetch(next + off);
        unpack_row(p.type, p.data + (r0 + r) * p.row_bytes, K, &u[r * x.K64], &a[r * x.S], &b[r * x.S]);
      }
      for (int64_t r = 0; r < rows; r++) {
        const RowView w{&u[r * x.K64], &a[r * x.S], &b[r * x.S]};
        float* out = y + p.first + r0 + r;
        int64_t m = 0;
        for (; m + kRowBlock <= M; m += kRowBlock) dot_rows<kRowBlock>(w, x, m, out + m * N, N);
        for (; m < M; m++) dot_rows<1>(w, x, m, out + m * N, N);
      }
    }
  }
};

Tiles plan(const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& types, int64_t K, int64_t& N,
           int64_t& bytes) {
  TORCH_CHECK(blocks.size() == types.size() && !blocks.empty(), "one block type per tensor of blocks");
  Tiles tiles;
  N = bytes = 0;
  for (size_t i = 0; i < blocks.size(); i++) {
    const at::Tensor& w = blocks[i];
    const auto f = format_of(types[i]);
    TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "blocks must be uint8 [N, bytes]");
    TORCH_CHECK(K % f.weights == 0 && w.size(1) == K / f.weights * f.bytes, "blocks of type ", types[i],
                " do not hold rows of ", K, " weights");
    tiles.parts.push_back({w.data_ptr<uint8_t>(), types[i], w.size(0), w.size(1), N});
    for (int64_t r = 0; r < w.size(0); r += kTile) tiles.index.emplace_back(i, r);
    N += w.size(0);
    bytes += w.numel();
  }
  return tiles;
}

// y = x W^T + bias with W the stacked GGUF blocks: x float32 or bfloat16 [M, K], y [M, N] in x's dtype.
at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& types,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % kXBlock == 0, "K must be a multiple of ", kXBlock);
  int64_t N, bytes;
  const Tiles tiles = plan(blocks, types, K, N, bytes);
  TORCH_CHECK(!bias || bias->numel() == N, "bias must have ", N, " values");
  at::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const QuantX xq = quantize_rows(xf.data_ptr<float>(), M, K);
  at::Tensor y = x.scalar_type() == at::kFloat ? out : at::empty({M, N}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  const int64_t T = static_cast<int64_t>(tiles.index.size());
  auto work = [&](int64_t t0, int64_t t1) { tiles.run(xq, M, K, t0, t1, yp, N); };
  if (bytes < kSerialBytes)
    work(0, T);
  else
    radixserve::SpinPool::get().run(T, work);
  if (bias) y.add_(bias->to(at::kFloat).view({1, N}));
  if (x.scalar_type() != at::kFloat) out.copy_(y);
  return out;
}

// The weights of `blocks` [N, bytes] (all rows, or rows `ids`) as float32 [rows, K]: w = a u - b, rounded once.
// Serves the tests (against gguf-py's dequantizers) and the embedding lookup of a GGUF's token table.
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, const std::optional<at::Tensor>& ids) {
  const auto f = format_of(type);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be uint8 [N, bytes]");
  TORCH_CHECK(blocks.size(1) % f.bytes == 0, "row bytes are not whole blocks");
  const int64_t K = blocks.size(1) / f.bytes * f.weights;
  const at::Tensor rows = ids ? ids->to(at::kLong).contiguous() : at::arange(blocks.size(0), at::kLong);
  const int64_t R = rows.numel();
  at::Tensor out = at::empty({R, K}, blocks.options().dtype(at::kFloat));
  const int64_t* idx = rows.data_ptr<int64_t>();
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  for (int64_t i = 0; i < R; i++) TORCH_CHECK(idx[i] >= 0 && idx[i] < blocks.size(0), "row index out of range");
  at::parallel_for(0, R, 64, [&](int64_t r0, int64_t r1) {
    std::vector<uint8_t> u(K);
    std::vector<float> a(K / kSub), b(K / kSub);
    for (int64_t r = r0; r < r1; r++) {
      unpack_row(type, src + idx[r] * blocks.size(1), K, u.data(), a.data(), b.data());
      for (int64_t k = 0; k < K; k++) dst[r * K + k] = a[k / kSub] * static_cast<float>(u[k]) - b[k / kSub];
    }
  });
  return out;
}

// The activation rounding every dot product above starts from: (int8 codes [M, K], float32 scales [M, K / 32]).
std::tuple<at::Tensor, at::Tensor> gguf_quantize_activations(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kXBlock == 0, "x must be [M, K] with K a multiple of ", kXBlock);
  const int64_t M = x.size(0), K = x.size(1);
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor s = at::empty({M, K / kXBlock}, x.options().dtype(at::kFloat));
  for (int64_t m = 0; m < M; m++)
    for (int64_t blk = 0; blk < K / kXBlock; blk++)
      quantize_block(xf.data_ptr<float>() + m * K + blk * kXBlock, q.data_ptr<int8_t>() + m * K + blk * kXBlock,
                     s.data_ptr<float>()[m * (K / kXBlock) + blk]);
  return {q, s};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("gguf_linear(Tensor x, Tensor[] blocks, int[] types, Tensor? bias) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, Tensor? ids) -> Tensor");
  m.def("gguf_quantize_activations(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_quantize_activations", &gguf_quantize_activations);
}
