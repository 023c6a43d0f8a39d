// argmax over the last dimension of float32 rows (the greedy sampler's pick), on the calling thread.
//
// Why: torch's argmax over a 152k-entry vocabulary row is a parallel reduction; with OpenMP PASSIVE (radixserve's
// setting) each call wakes a sleeping thread, ~80-170 us a decode step on the 2-core machine measured, for ~0.6 MB
// a single core reads in ~10 us. Same answer as torch.argmax: NaN counts as the largest value, and among equal
// largest values (-0.0 equals 0.0) the first index wins.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

int64_t argmax_scalar(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t j = 1; j < n; j++) {
    if (std::isnan(x[best])) break;
    if (std::isnan(x[j]) || x[j] > x[best]) best = j;
  }
  return best;
}

int64_t argmax_row(const float* x, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16 && n < (int64_t{1} << 31)) {
    // Per lane the first largest value and its index (a strictly greater value replaces it); NaN lanes noted.
    __m512 best = _mm512_loadu_ps(x);
    __m512i at = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), idx = at;
    const __m512i sixteen = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t j = 16;
    for (; j + 16 <= n; j += 16) {
      idx = _mm512_add_epi32(idx, sixteen);
      const __m512 v = _mm512_loadu_ps(x + j);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, gt, v);
      at = _mm512_mask_mov_epi32(at, gt, idx);
    }
    if (nan) return argmax_scalar(x, n);  // a NaN anywhere in the vector part: the first NaN, found in order
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 eq = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    int64_t found = _mm512_mask_reduce_min_epi32(eq, at);
    for (; j < n; j++) {  // the tail, after every vector index
      if (std::isnan(x[j])) return j;
      if (x[j] > x[found]) found = j;
    }
    return found;
  }
#endif
  return argmax_scalar(x, n);
}

// logits [rows, V] float32 -> int64 [rows].
at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0 && logits.scalar_type() == at::kFloat,
              "argmax_rows: float32 [rows, V]");
  const at::Tensor x = logits.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* in = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; r++) o[r] = argmax_row(in + r * n, n);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) { m.def("argmax_rows(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("argmax_rows", &argmax_rows); }
