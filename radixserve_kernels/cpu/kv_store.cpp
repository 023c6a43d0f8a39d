// KV store: quantize each new token's K and V rows and write them, with their scales, into int8 pool slots; or
// copy them into a float pool's (store_kv, at the end).
//
// The pool's int8 rows are head_dim values then a float16 scale per group of them (radixserve/cache/kv_format.py:
// 16 for keys, the whole row for values; each buffer's group is read off its own row width). Both are rotated here
// first (kv_rotate.h; values with their sign flips). Why here: the torch expression of the same quantization is ~10 small ops
// per tensor, K and V, in every layer of every decode step (~500 ops a step on the default model), whose dispatch
// cost more than the decode attention saved. Bit-identical to KVFormat.encode(rotate(k), "k") and
// KVFormat.encode(rotate_values(v), "v"): per group, scale = float16(min(max |x| / 127, 65504)) rounded to nearest even, then each
// value x / scale (float32 division) rounded half to even and clamped to +-127; a zero scale stores zeros.
#include "ops.h"
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kv_rotate.h"

namespace {

inline float widen(float x) { return x; }
inline float widen(at::BFloat16 x) { return static_cast<float>(x); }

// Row x (D floats) -> D int8 values and a float16 scale per group of G, at out.
void quantize_row(const float* x, int64_t D, int64_t G, int8_t* out) {
  for (int64_t g = 0; g < D / G; g++) {
    const float* xg = x + g * G;
    int8_t* og = out + g * G;
    float amax = 0.f;
    for (int64_t d = 0; d < G; d++) amax = std::max(amax, std::fabs(xg[d]));
    const at::Half scale(std::min(amax / 127.f, 65504.f));
    const float s = static_cast<float>(scale);
    for (int64_t d = 0; d < G; d++) {
      // nearbyint rounds half to even in the default rounding mode, as torch.round does.
      const float q = s > 0.f ? std::nearbyint(xg[d] / s) : 0.f;
      og[d] = static_cast<int8_t>(std::clamp(q, -127.f, 127.f));
    }
    std::memcpy(out + D + 2 * g, &scale, sizeof(scale));
  }
}

template <typename T>
void store(const at::Tensor& x, at::Tensor& buf, const int64_t* loc, bool values) {
  const int64_t T_ = x.size(0), KV = x.size(1), D = x.size(2), W = buf.size(-1);
  const int64_t G = radixserve_kv::scale_group(D, W);
  const T* xp = x.data_ptr<T>();
  int8_t* bp = buf.data_ptr<int8_t>();
  at::parallel_for(0, T_ * KV, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> row(D);
    for (int64_t i = i0; i < i1; i++) {
      const int64_t t = i / KV, h = i % KV;
      for (int64_t d = 0; d < D; d++) row[d] = widen(xp[(t * KV + h) * D + d]);
      if (values) radixserve_kv::flip_value_signs(row.data(), D);
      radixserve_kv::fwht(row.data(), D);
      quantize_row(row.data(), D, G, bp + (loc[t] * KV + h) * W);
    }
  });
}

// loc's slots, each checked to lie in the pool (a slot out of range would write outside the buffers).
const int64_t* checked_slots(const at::Tensor& loc, int64_t tokens, int64_t slots) {
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.numel() == tokens && loc.is_contiguous(),
              "loc must be contiguous int64 [tokens]");
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; t++)
    TORCH_CHECK(lp[t] >= 0 && lp[t] < slots, "loc[", t, "] = ", lp[t], " is not a pool slot");
  return lp;
}

}  // namespace

namespace radixserve::cpu {

void store_kv_int8(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor k_buf, at::Tensor v_buf,
                   const at::Tensor& loc) {
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes(),
              "k and v must be [tokens, kv_heads, head_dim] of one dtype");
  TORCH_CHECK(k_buf.scalar_type() == at::kChar && v_buf.scalar_type() == at::kChar && k_buf.is_contiguous() &&
                  v_buf.is_contiguous() && k_buf.dim() == 4 && v_buf.dim() == 4 &&
                  k_buf.sizes().slice(0, 3) == v_buf.sizes().slice(0, 3),
              "k_buf / v_buf must be contiguous int8 [num_pages, page_size, kv_heads, row] (rows of any width)");
  TORCH_CHECK(k_buf.size(2) == k.size(1) && radixserve_kv::scale_group(k.size(2), k_buf.size(3)) > 0 &&
                  radixserve_kv::scale_group(k.size(2), v_buf.size(3)) > 0 && radixserve_kv::is_pow2(k.size(2)),
              "pool rows must be head_dim values and a 2-byte scale per group (head_dim a power of two)");
  const int64_t* lp = checked_slots(loc, k.size(0), k_buf.size(0) * k_buf.size(1));
  const auto dt = k.scalar_type();
  TORCH_CHECK((dt == at::kFloat || dt == at::kBFloat16) && v.scalar_type() == dt,
              "store_kv_int8: k and v must be float32 or bfloat16, of one dtype");
  if (dt == at::kFloat) {
    store<float>(k, k_buf, lp, false);
    store<float>(v, v_buf, lp, true);
  } else {
    store<at::BFloat16>(k, k_buf, lp, false);
    store<at::BFloat16>(v, v_buf, lp, true);
  }
}

// Float pools (bfloat16, float32): each token's K and V rows (all its kv heads) copied into slot loc[t] as they are,
// in one op where two index_copy_ and their Python ran in every layer of every decode step (KVPool.store of one
// bfloat16 token: 7.0 us with them, 1.4 us with this, one thread's CPU time). float32 rows into a bfloat16 pool (the
// activations of a CPU without bf16 hardware, radixserve/model/cpu_select.py) are rounded to nearest even, as
// torch's .to(torch.bfloat16) rounds them.
void store_kv(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor k_buf, at::Tensor v_buf, const at::Tensor& loc) {
  const at::Tensor k = k_in.contiguous(), v = v_in.contiguous();
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == v.scalar_type(),
              "k and v must be [tokens, kv_heads, head_dim] of one dtype");
  const bool narrow = k.scalar_type() == at::kFloat && k_buf.scalar_type() == at::kBFloat16;
  TORCH_CHECK((k_buf.scalar_type() == k.scalar_type() || narrow) && v_buf.scalar_type() == k_buf.scalar_type() &&
                  k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.dim() == 4 && k_buf.sizes() == v_buf.sizes() &&
                  k_buf.size(2) == k.size(1) && k_buf.size(3) == k.size(2),
              "k_buf / v_buf must be contiguous [num_pages, page_size, kv_heads, head_dim] of k's dtype (or bfloat16 "
              "for float32 k)");
  const int64_t* lp = checked_slots(loc, k.size(0), k_buf.size(0) * k_buf.size(1));
  const int64_t n = k.size(1) * k.size(2), row = n * k_buf.element_size();
  auto* kb = static_cast<uint8_t*>(k_buf.data_ptr());
  auto* vb = static_cast<uint8_t*>(v_buf.data_ptr());
  const auto* kp = static_cast<const uint8_t*>(k.data_ptr());
  const auto* vp = static_cast<const uint8_t*>(v.data_ptr());
  for (int64_t t = 0; t < loc.numel(); t++) {
    if (narrow) {
      const auto *ks = reinterpret_cast<const float*>(kp) + t * n, *vs = reinterpret_cast<const float*>(vp) + t * n;
      auto* kd = reinterpret_cast<at::BFloat16*>(kb + lp[t] * row);
      auto* vd = reinterpret_cast<at::BFloat16*>(vb + lp[t] * row);
      for (int64_t i = 0; i < n; i++) kd[i] = at::BFloat16(ks[i]);  // c10's conversion: round to nearest even
      for (int64_t i = 0; i < n; i++) vd[i] = at::BFloat16(vs[i]);
    } else {
      std::memcpy(kb + lp[t] * row, kp + t * row, row);
      std::memcpy(vb + lp[t] * row, vp + t * row, row);
    }
  }
}

}  // namespace radixserve::cpu
