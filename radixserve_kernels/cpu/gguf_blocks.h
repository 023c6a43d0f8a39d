// GGUF (ggml) block formats, unpacked one weight row at a time into one common form that the dot products of
// gguf_linear.cpp read: unsigned codes u[k] (uint8) and, per 16 weights, a float scale a and offset b, with
//     w[k] = a[k / 16] * u[k] - b[k / 16].
// Every format we read fits it: Q8_0 (u = q + 128, b = 128 d), Q4_0 / Q5_0 (codes 0..15 / 0..31 around 8 / 16),
// Q4_K and Q5_K (w = d sc q - dmin m per 32, codes 0..15 / 0..31), Q6_K (codes 0..63 around 32, an int8 scale per
// 16). Why one form: the integer dot product of u with the activations' int8 codes (vpdpbusd multiplies unsigned by
// signed bytes) is then the same code for every format, and the offsets fold into one short float dot product with
// the activations' block sums.
// Layouts follow ggml's block structs (ggml-common.h); products a * u are exact in float32 (fp16 d: 11 bits, scales
// at most 8 bits, codes at most 8 bits), so a * u - b rounds once, as ggml's own dequantizers do.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>

#include <bit>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

// The kernels' widest path: AVX-512 with VNNI (gguf_decode.h), else AVX2 + FMA (gguf_decode_avx2.h), else plain C++.
// RADIXSERVE_GGUF_AVX512: the AVX-512 (F and BW) code of the activations' rounding and the tiles' offsets.
// RADIXSERVE_GGUF_EMULATE_VNNI (tests only): both on a CPU without AVX-512, their intrinsics from vnni_emulated.h.
#if defined(RADIXSERVE_GGUF_EMULATE_VNNI)
#include "vnni_emulated.h"
#define RADIXSERVE_GGUF_VNNI 1
#define RADIXSERVE_GGUF_AVX512 1
#else
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RADIXSERVE_GGUF_VNNI 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RADIXSERVE_GGUF_AVX512 1
#endif
#endif

namespace radixserve::gguf {

// ggml's type ids (GGMLQuantizationType in gguf-py).
enum Type : int64_t { kQ4_0 = 2, kQ5_0 = 6, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// The formats with per sub-block minima (w = d sc u - dmin m): their offsets are floats, the others' a zero point.
constexpr bool has_minima(int64_t type) { return type == kQ4_K || type == kQ5_K; }

// Codes around a fixed zero point (w = a (u - zero), zero = 2^Shift: Q4_0 8, Q5_0 16, Q6_K 32, Q8_0 128) take the
// zero out in the integer dot products (VNNI: vpdpbusd starts from -zero * (sum of the activation codes), exact in
// int32), so no float offsets remain. Q4_K's and Q5_K's minima are per sub-block floats (Shift < 0): an offsets term
// serves them.
constexpr int zero_shift(int64_t type) {
  return type == kQ4_0 ? 3 : type == kQ5_0 ? 4 : type == kQ6_K ? 5 : type == kQ8_0 ? 7 : -1;
}

// The formats of 32 weights per block with one scale (Q4_0, Q5_0, Q8_0): the activations' blocks of 32 line up
// with theirs, so the VNNI kernels take one float step per block (gguf_decode32.h) where the K-quants take one per 16.
constexpr bool is_block32(int64_t type) { return type == kQ4_0 || type == kQ5_0 || type == kQ8_0; }

constexpr int64_t kSub = 16;  // weights per (a, b) pair: the finest scale granularity of the formats (Q6_K)

struct Format {
  int64_t weights;  // per block
  int64_t bytes;    // per block
};

constexpr int64_t format_bytes(int64_t type) {
  return type == kQ4_0 ? 18 : type == kQ5_0 ? 22 : type == kQ8_0 ? 34 : type == kQ4_K ? 144 : type == kQ5_K ? 176 : 210;
}

inline Format format_of(int64_t type) {
  switch (type) {
    case kQ4_0: return {32, 18};
    case kQ5_0: return {32, 22};
    case kQ8_0: return {32, 34};
    case kQ4_K: return {256, 144};
    case kQ5_K: return {256, 176};
    case kQ6_K: return {256, 210};
    default: TORCH_CHECK(false, "GGML block type ", type, " is not supported (Q4_0, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K are)");
  }
}

// A part's blocks as the linears take them (gguf_linear.cpp, gguf_dense.cpp): uint8 [N, bytes], contiguous, rows of K
// weights of `type`.
inline void check_blocks(const at::Tensor& w, int64_t type, int64_t K) {
  const Format f = format_of(type);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(), "blocks must be uint8 [N, bytes]");
  TORCH_CHECK(K % f.weights == 0 && w.size(1) == K / f.weights * f.bytes, "blocks of type ", type,
              " do not hold rows of ", K, " weights");
}

inline float fp16(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(bits);  // one instruction; c10::Half's portable conversion is ~20 (per block: it showed)
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

#if defined(__AVX2__)
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256i low4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high4(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }

// Bit `bit` of each byte of v moved to bit 4 (16), the rest zero (Q5_K's fifth bits): one 16-bit shift (what spills
// from the byte beside lands in other bits) and one and.
inline __m256i bit_to_16(__m256i v, int bit) {
  const __m256i moved = bit <= 4 ? _mm256_slli_epi16(v, 4 - bit) : _mm256_srli_epi16(v, bit - 4);
  return _mm256_and_si256(moved, _mm256_set1_epi8(16));
}
#endif

inline void sub_pair(float a, float b, float* as, float* bs) {  // one scale for a block of 32 = two of 16
  as[0] = as[1] = a;
  bs[0] = bs[1] = b;
}

// The formats of 32 weights per block with one fp16 d: codes u and the offset in steps of d (w = d (u - zero)).
struct Block32 {
  int64_t bytes, zero;
};
constexpr Block32 kQ4_0Block{18, 8}, kQ5_0Block{22, 16}, kQ8_0Block{34, 128};

#if defined(__AVX2__)
// A block's 32 codes in one register (the unpacking stores them, the AVX2 decode of Q8_0 reads them from here; that of
// Q4_0 and Q5_0 reads two rows at once: gguf_decode_avx2.h's codes_pair): Q4_0 / Q5_0 pack codes 0..15 in low
// nibbles, 16..31 in high ones; Q5_0's fifth bits are the uint32 qh.
inline __m256i nibbles32(const uint8_t* qs) {
  // The 16 bytes into both halves by the load itself, then the upper half's dwords shifted down to their high
  // nibbles: one vector operation fewer than shifting a copy and inserting it.
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return low4(_mm256_srlv_epi32(v, _mm256_set_epi32(4, 4, 4, 4, 0, 0, 0, 0)));
}

template <int64_t Type>
inline __m256i codes32(const uint8_t* blk) {
  if constexpr (Type == kQ8_0) return _mm256_xor_si256(load32(blk + 2), _mm256_set1_epi8(static_cast<char>(0x80)));
  if constexpr (Type == kQ4_0) return nibbles32(blk + 2);
  uint32_t qh;  // Q5_0; bit j: the fifth bit of code j
  std::memcpy(&qh, blk + 2, 4);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m256i fifth = _mm256_maskz_mov_epi8(static_cast<__mmask32>(qh), _mm256_set1_epi8(16));
#else
  // Bit j of qh to byte j: byte j takes qh's byte j / 8 (shuffle), tests its bit j % 8 (and + compare).
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)),
                                             _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                                               0x0101010101010101, 0x0000000000000000));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201));
  const __m256i fifth = _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
#endif
  return _mm256_or_si256(nibbles32(blk + 6), fifth);
}
#endif

template <int64_t Type>
inline void unpack_block32(const uint8_t* blk, uint8_t* u, float* a, float* b) {
  constexpr Block32 f = Type == kQ8_0 ? kQ8_0Block : Type == kQ5_0 ? kQ5_0Block : kQ4_0Block;
  const float d = fp16(blk);
#if defined(__AVX2__)
  store32(u, codes32<Type>(blk));
#else
  for (int j = 0; j < 16; j++) {
    if constexpr (Type == kQ8_0) {
      u[j] = blk[2 + j] ^ 0x80;  // int8 q -> uint8 q + 128
      u[j + 16] = blk[18 + j] ^ 0x80;
    } else {
      const uint8_t* qs = blk + f.bytes - 16;
      u[j] = qs[j] & 0x0F;
      u[j + 16] = qs[j] >> 4;
    }
  }
  if constexpr (Type == kQ5_0) {
    uint32_t qh;
    std::memcpy(&qh, blk + 2, 4);
    for (int j = 0; j < 32; j++) u[j] |= static_cast<uint8_t>(((qh >> j) & 1u) << 4);
  }
#endif
  sub_pair(d, f.zero * d, a, b);
}

// Q4_K's eight 6-bit (scale, min) pairs of a super-block as bytes sc[0..7], m[0..7]: ggml's get_scale_min_k4 (the
// top two bits of 4..7 live in bytes 0..7), four words at once (the decode readers load the 16 bytes as a vector).
inline void q4_k_scales(const uint8_t* blk, uint8_t (&out)[16]) {
  uint32_t w[4];
  std::memcpy(w, blk + 4, 12);
  constexpr uint32_t low6 = 0x3f3f3f3f, low4 = 0x0f0f0f0f, top2 = 0x03030303;
  w[3] = ((w[2] >> 4) & low4) | (((w[1] >> 6) & top2) << 4);
  const uint32_t m03 = w[1] & low6;
  w[1] = (w[2] & low4) | (((w[0] >> 6) & top2) << 4);
  w[2] = m03;
  w[0] &= low6;
  std::memcpy(out, w, 16);
}

#if defined(__AVX2__)
// q4_k_scales's 16 bytes in a register, from the block's first 16 bytes (dwords (d, dmin), w0, w1, w2): sc 0-3 = w0
// & 63, sc 4-7 = (w2 & 15) | top two bits of w0's bytes, m 0-3 = w1 & 63, m 4-7 = (w2 >> 4) | top two bits of w1's.
// Eight vector operations (the 32-bit shifts' spill from the byte beside is masked off) where the scalar form took
// ~14 and two trips through memory (the AVX2 decode of a row reads it once per super-block).
inline __m128i q4_k_scales128(const uint8_t* blk) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk));
  const __m128i a = _mm_srlv_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(3, 2, 3, 1)), _mm_setr_epi32(0, 0, 0, 4));
  const __m128i top = _mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(2, 0, 1, 0)), 2);  // bits 6-7 to 4-5
  const __m128i low = _mm_and_si128(a, _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
  return _mm_or_si128(low, _mm_and_si128(top, _mm_setr_epi32(0, 0x30303030, 0, 0x30303030)));
}
#endif

// Q4_K: fp16 d, fp16 dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128 bytes of codes: 32-byte chunk j holds
// sub-block 2j in its low nibbles and 2j + 1 in its high ones. w = d sc q - dmin m per sub-block of 32.
inline void unpack_q4_k(const uint8_t* blk, uint8_t* u, float* a, float* b) {
  const float d = fp16(blk), dmin = fp16(blk + 2);
  const uint8_t* qs = blk + 16;
  uint8_t sm[16];
  q4_k_scales(blk, sm);
  for (int j = 0; j < 8; j++) sub_pair(d * sm[j], dmin * sm[8 + j], a + 2 * j, b + 2 * j);
  for (int c = 0; c < 4; c++) {
#if defined(__AVX2__)
    const __m256i v = load32(qs + 32 * c);
    store32(u + 64 * c, low4(v));
    store32(u + 64 * c + 32, high4(v));
#else
    for (int l = 0; l < 32; l++) {
      u[64 * c + l] = qs[32 * c + l] & 0x0F;
      u[64 * c + 32 + l] = qs[32 * c + l] >> 4;
    }
#endif
  }
}

// Q5_K: Q4_K's d, dmin and scales, then 32 bytes qh and Q4_K's 128 bytes of nibbles; sub-block j's code l takes bit
// j of qh[l] as its fifth bit (16). w = d sc q - dmin m per sub-block of 32, q in 0..31.
inline void unpack_q5_k(const uint8_t* blk, uint8_t* u, float* a, float* b) {
  const float d = fp16(blk), dmin = fp16(blk + 2);
  const uint8_t* qh = blk + 16;
  const uint8_t* qs = blk + 48;
  uint8_t sm[16];
  q4_k_scales(blk, sm);
  for (int j = 0; j < 8; j++) sub_pair(d * sm[j], dmin * sm[8 + j], a + 2 * j, b + 2 * j);
#if defined(__AVX2__)
  const __m256i h = load32(qh);
  for (int c = 0; c < 4; c++) {
    const __m256i v = load32(qs + 32 * c);
    store32(u + 64 * c, _mm256_or_si256(low4(v), bit_to_16(h, 2 * c)));
    store32(u + 64 * c + 32, _mm256_or_si256(high4(v), bit_to_16(h, 2 * c + 1)));
  }
#else
  for (int c = 0; c < 4; c++)
    for (int l = 0; l < 32; l++) {
      u[64 * c + l] = (qs[32 * c + l] & 0x0F) | (((qh[l] >> (2 * c)) & 1) << 4);
      u[64 * c + 32 + l] = (qs[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
    }
#endif
}

// Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d. Per 128-weight half, weight
// 32 t + l (t = 0..3, l = 0..31) takes the low nibble of ql[l] (t = 0, 2) or ql[l + 32] (t = 1, 3), high nibble for
// t >= 2, and bits 2t..2t+1 of qh[l]; scale j belongs to weights 16 j..16 j + 15. w = d sc (q - 32).
inline void unpack_q6_k(const uint8_t* blk, uint8_t* u, float* a, float* b) {
  const uint8_t* ql = blk;
  const uint8_t* qh = blk + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
  const float d = fp16(blk + 208);
  for (int j = 0; j < 16; j++) {
    a[j] = d * sc[j];
    b[j] = 32 * a[j];
  }
  for (int half = 0; half < 2; half++, ql += 64, qh += 32, u += 128) {
#if defined(__AVX2__)
    const __m256i l0 = load32(ql), l1 = load32(ql + 32), h = load32(qh), two = _mm256_set1_epi8(0x30);
    store32(u, _mm256_or_si256(low4(l0), _mm256_and_si256(_mm256_slli_epi16(h, 4), two)));
    store32(u + 32, _mm256_or_si256(low4(l1), _mm256_and_si256(_mm256_slli_epi16(h, 2), two)));
    store32(u + 64, _mm256_or_si256(high4(l0), _mm256_and_si256(h, two)));
    store32(u + 96, _mm256_or_si256(high4(l1), _mm256_and_si256(_mm256_srli_epi16(h, 2), two)));
#else
    for (int l = 0; l < 32; l++) {
      u[l] = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
      u[l + 32] = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
      u[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
      u[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
    }
#endif
  }
}

using BlockFn = void (*)(const uint8_t*, uint8_t*, float*, float*);

// The blocks of one row, the block function inlined into its own loop (a switch per block cost measurably).
template <int64_t Weights, int64_t Bytes, BlockFn Unpack>
void unpack_blocks(const uint8_t* row, int64_t K, uint8_t* u, float* a, float* b) {
  for (int64_t i = 0; i < K / Weights; i++) Unpack(row + i * Bytes, u + i * Weights, a + i * Weights / kSub, b + i * Weights / kSub);
}

// One row of K weights (K / format.weights blocks at `row`) into u[K], a[K / 16], b[K / 16].
inline void unpack_row(int64_t type, const uint8_t* row, int64_t K, uint8_t* u, float* a, float* b) {
  switch (type) {
    case kQ4_0: return unpack_blocks<32, 18, unpack_block32<kQ4_0>>(row, K, u, a, b);
    case kQ5_0: return unpack_blocks<32, 22, unpack_block32<kQ5_0>>(row, K, u, a, b);
    case kQ8_0: return unpack_blocks<32, 34, unpack_block32<kQ8_0>>(row, K, u, a, b);
    case kQ4_K: return unpack_blocks<256, 144, unpack_q4_k>(row, K, u, a, b);
    case kQ5_K: return unpack_blocks<256, 176, unpack_q5_k>(row, K, u, a, b);
    default: return unpack_blocks<256, 210, unpack_q6_k>(row, K, u, a, b);
  }
}

inline void put_weight(float w, float* out) { *out = w; }

// bf16 as bits, so that the compiler vectorizes the loop: round to nearest even (finite values), as torch does.
inline void put_weight(float w, at::BFloat16* out) {
  const uint32_t bits = std::bit_cast<uint32_t>(w);
  *reinterpret_cast<uint16_t*>(out) = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
// put_weight for 16 weights at once: the same bits.
inline void put_weights16(__m512 w, float* out) { _mm512_storeu_ps(out, w); }

inline void put_weights16(__m512 w, at::BFloat16* out) {
  const __m512i bits = _mm512_castps_si512(w);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
#endif

// An unpacked row's weights w = a u - b (u[K], a and b per 16), rounded once to T (float32 or bfloat16): the
// dequantized weights of gguf_dequantize.cpp and gguf_dense.cpp. With AVX-512 one register per 16 weights: what the
// compiler made of the plain loop took ~2.8x as long (the dense path's 64-row gate projection spent ~2.5 ms
// dequantizing beside a 1.2 ms matmul, ~0.9 ms after). A multiply then a subtraction either way: the same bits.
template <typename T>
void weights_row(const uint8_t* u, const float* a, const float* b, int64_t K, T* out) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < K / kSub; j++) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u + j * kSub));
    const __m512 codes = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
    put_weights16(_mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(a[j]), codes), _mm512_set1_ps(b[j])), out + j * kSub);
  }
#else
  for (int64_t j = 0; j < K / kSub; j++) {
    const float aj = a[j], bj = b[j];
    for (int64_t l = 0; l < kSub; l++) put_weight(aj * static_cast<float>(u[j * kSub + l]) - bj, out + j * kSub + l);
  }
#endif
}

}  // namespace radixserve::gguf
