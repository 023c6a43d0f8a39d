// A count known only at run time (1 to 8) as a template argument, so that a kernel's per-count accumulators stay in
// registers: the GGUF kernels' activation rows a pass (gguf_tiles.h, gguf_packed_avx2.h) and the attention paths'
// query heads a block (decode_attention.cpp's head_blocks).
#pragma once

#include <cstdint>
#include <type_traits>

namespace radixserve {

// f(std::integral_constant<int, n>{}) for n = count (1 to 8; larger counts take 8).
template <typename F>
inline void with_count(int64_t count, const F& f) {
  switch (count) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    case 6: return f(std::integral_constant<int, 6>{});
    case 7: return f(std::integral_constant<int, 7>{});
    default: return f(std::integral_constant<int, 8>{});
  }
}

}  // namespace radixserve
