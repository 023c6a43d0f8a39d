// int8 KV store: quantize each new token's K and V rows and write them, with their scales, into pool slots.
//
// The pool's int8 rows are head_dim values then a float16 scale per 16 of them (radixserve/cache/kv_format.py; keys
// arrive already rotated). Why here:
// the torch expression of the same quantization is ~10 small ops per tensor, K and V, in every layer of every
// decode step (~500 ops a step on the default model), whose dispatch cost more than the decode attention saved.
// Bit-identical to KVFormat.encode: per group of 16, scale = float16(min(max |x| / 127, 65504)) rounded to nearest
// even, then each value x / scale (float32 division) rounded half to even and clamped to +-127; a zero scale stores
// zeros.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

constexpr int64_t kGroup = 16;

template <typename T>
void quantize_row(const T* x, int64_t D, int8_t* out) {
  for (int64_t g = 0; g < D / kGroup; g++) {
    const T* xg = x + g * kGroup;
    int8_t* og = out + g * kGroup;
    float amax = 0.f;
    for (int64_t d = 0; d < kGroup; d++) amax = std::max(amax, std::fabs(widen(xg[d])));
    const at::Half scale(std::min(amax / 127.f, 65504.f));
    const float s = static_cast<float>(scale);
    for (int64_t d = 0; d < kGroup; d++) {
      // nearbyint rounds half to even in the default rounding mode, as torch.round does.
      const float q = s > 0.f ? std::nearbyint(widen(xg[d]) / s) : 0.f;
      og[d] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
    }
    std::memcpy(out + D + 2 * g, &scale, sizeof(scale));
  }
}

template <typename T>
void store(const at::Tensor& x, at::Tensor& buf, const int64_t* loc) {
  const int64_t T_ = x.size(0), KV = x.size(1), D = x.size(2), W = buf.size(-1);
  const T* xp = x.data_ptr<T>();
  int8_t* bp = buf.data_ptr<int8_t>();
  at::parallel_for(0, T_ * KV, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; i++) {
      const int64_t t = i / KV, h = i % KV;
      quantize_row(xp + (t * KV + h) * D, D, bp + (loc[t] * KV + h) * W);
    }
  });
}

void store_kv_int8(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor k_buf, at::Tensor v_buf,
                   const at::Tensor& loc) {
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "k and v must be [tokens, kv_heads, head_dim] of one dtype");
  TORCH_CHECK(k_buf.scalar_type() == at::kChar && v_buf.scalar_type() == at::kChar && k_buf.is_contiguous() &&
                  v_buf.is_contiguous() && k_buf.sizes() == v_buf.sizes() && k_buf.dim() == 4,
              "k_buf / v_buf must be contiguous int8 [num_pages, page_size, kv_heads, head_dim * 9 / 8]");
  TORCH_CHECK(k.size(2) % kGroup == 0 && k_buf.size(2) == k.size(1) && k_buf.size(3) == k.size(2) / 8 * 9,
              "pool rows must be head_dim values and a 2-byte scale per 16 (head_dim a multiple of 16)");
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.numel() == k.size(0) && loc.is_contiguous(),
              "loc must be contiguous int64 [tokens]");
  const int64_t slots = k_buf.size(0) * k_buf.size(1);
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < loc.numel(); t++)
    TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "loc[", t, "] = ", lp[t], " is not a pool slot");
  const auto dt = k.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16, "store_kv_int8: k and v must be float32 or bfloat16");
  if (dt == at::kFloat) {
    store<float>(k, k_buf, lp);
    store<float>(v, v_buf, lp);
  } else {
    store<at::BFloat16>(k, k_buf, lp);
    store<at::BFloat16>(v, v_buf, lp);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("store_kv_int8(Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("store_kv_int8", &store_kv_int8); }
