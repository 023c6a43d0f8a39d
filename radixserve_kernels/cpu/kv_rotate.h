// The int8 KV format's rotation and row layout (radixserve/cache/kv_format.py), shared by the store and decode ops.
//
// Rotation: x times the n x n Walsh-Hadamard matrix / sqrt(n), as the fast transform, stage by stage exactly as
// kv_format.fwht runs it (a + b, a - b on pairs h apart, h = 1, 2, 4, ..., then one multiply), so the store op writes
// the bytes KVFormat.encode(rotate(k)) gives. Why in C++: in torch it was a float32 cast and a 64 x 64 product
// for the new keys and the query in every layer of every decode step, small ops whose dispatch cost showed in decode
// tokens/s; the values and the attention output take the same transform.
#pragma once

#include <cmath>
#include <cstdint>

namespace radixserve_kv {

inline bool is_pow2(int64_t n) { return n > 0 && (n & (n - 1)) == 0; }

inline void fwht(float* x, int64_t n) {
  for (int64_t h = 1; h < n; h *= 2)
    for (int64_t i = 0; i < n; i += 2 * h)
      for (int64_t j = i; j < i + h; j++) {
        const float a = x[j], b = x[j + h];
        x[j] = a + b;
        x[j + h] = a - b;
      }
  const float norm = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int64_t j = 0; j < n; j++) x[j] *= norm;
}

// Value rows are rotated by H S (S: these channels negated first, bit d % 64 for channel d) and read back by S H;
// kv_format.VALUE_SIGNS is the same constant (tests/test_kv_quant.py compares the ops with the torch encoder).
constexpr uint64_t kValueSigns = 0x9D5C26DD7FEBC391ull;

inline void flip_value_signs(float* x, int64_t n) {
  for (int64_t d = 0; d < n; d++)
    if ((kValueSigns >> (d % 64)) & 1) x[d] = -x[d];
}

// Values per float16 scale of an int8 row of W bytes holding D values (then 2 bytes per group), or 0 when W is no
// such row: the group is read off each pool buffer's row width (keys a scale per 16, values one a row: 72 and 66
// bytes at D 64), so the ops follow kv_format.scale_group without a copy of it.
inline int64_t scale_group(int64_t D, int64_t W) {
  const int64_t scale_bytes = W - D;
  if (scale_bytes <= 0 || scale_bytes % 2 || D % (scale_bytes / 2)) return 0;
  return D / (scale_bytes / 2);
}

}  // namespace radixserve_kv
