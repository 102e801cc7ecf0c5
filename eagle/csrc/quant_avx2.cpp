// AVX2 + FMA kernels, compiled for that target in this file only and called only on a CPU that has it.
//
// float32 numerics (LAYOUT_K): quantized weights are decoded in registers, 8 inputs at a time (gguf-py's values),
// and every row of a tile takes one 8-lane accumulator through fma(x[8 inputs], w[8 inputs], acc) in input order,
// then a fixed horizontal sum and the bias; float weights (F32 / F16 / BF16) are decoded once per call into scratch
// and take the same accumulation.
// int8 numerics (LAYOUT_N): the integer group sums of the AVX-512 kernels (vpmaddubsw + vpmaddwd instead of
// vpdpbusd; 8-bit codes through the sign trick, which gives the same exact integers), combined in float by the
// same operations in the same order: its outputs are bit-identical to the AVX-512 and portable int8 kernels'.
// The int8 activation quantizer gives the portable quantizer's bits.
#include "quant.h"

#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include <cstring>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt")

namespace eagle::quant {

namespace {

inline uint16_t ld16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t ld32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline __m128i ld64x(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return _mm_cvtsi64_si128(v);
}
inline __m128i ld128(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i ld256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// 8 bits -> 8 dword lanes: `value` where bit i is set, 0 elsewhere
inline __m256i bits_to_lanes(uint32_t bits8, int value) {
  const __m256i select = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256i hit = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32(static_cast<int>(bits8)), select), select);
  return _mm256_and_si256(hit, _mm256_set1_epi32(value));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// ============================================================================================ float32 numerics
void float_decode(const TypeInfo& t, const uint8_t* col, int64_t k, float* w) {
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    const __m128i h = ld128(col + 2 * i);
    const __m256 v = t.type == F16 ? _mm256_cvtph_ps(h) : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    _mm256_storeu_ps(w + i, v);
  }
  for (; i < k; ++i) {
    const uint16_t h = ld16(col + 2 * i);
    if (t.type == F16) {
      w[i] = h2f(h);
    } else {
      const uint32_t bits = static_cast<uint32_t>(h) << 16;
      std::memcpy(w + i, &bits, 4);
    }
  }
}

// y[r0 + r][n + c] = the horizontal sum of acc[r][c] (+ bias), for the float32 tiles of both weight kinds
template <int R, int C>
__attribute__((always_inline)) inline void store_sums(const LinearArgs& args, const __m256 (&acc)[R][C], int64_t r0,
                                                      int64_t n) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float sum = hsum(acc[r][c]);
      args.y[(r0 + r) * args.n + n + c] = args.bias ? sum + args.bias[n + c] : sum;
    }
}

// rows [r0, r0 + R) of columns [n, n + C), weights w[c][K]; the last partial vector of 8 is masked (zeros).
// R x C accumulators: 2 x 4 leaves room in the 16 ymm registers for the 4 weight vectors and one x vector.
template <int R, int C>
void k_rows(const LinearArgs& args, const float* const* w, int64_t r0, int64_t n) {
  const int64_t k = args.k;
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < k; i += 8) {
    const int64_t live = k - i < 8 ? k - i : 8;
    const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)),
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    __m256 wv[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) wv[c] = _mm256_maskload_ps(w[c] + i, mask);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_maskload_ps(args.x + (r0 + r) * k + i, mask);
#pragma GCC unroll 8
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  store_sums<R, C>(args, acc, r0, n);
}

// a GGUF type's constants (quant.h's table), and the rules of this instruction set derived from them:
//   kIntOffset: the integer correction of the int8 kernel, sum(q_x) * offset subtracted per group; none for 8-bit
//     codes, which the sign trick multiplies as the signed q = u - 128 itself (vpdpbusd's kernels take u and 128)
//   kSteps16: the int8 kernel's 4-input steps summed in int16 before widening (exact: see n_tile)
template <int TYPE>
struct Traits : TypeTraits<TYPE> {
  using Base = TypeTraits<TYPE>;
  static constexpr int kIntOffset = Base::kBits == 8 ? 0 : Base::kOffset;
  static constexpr int kSteps16 = Base::kBits == 4 ? 8 : Base::kBits == 5 ? 4 : Base::kBits == 6 ? 2 : 1;
};

// Quantized weights (LAYOUT_K), decoded in registers: a tile of R rows x C columns walks the inputs 8 at a time in
// order; each column's 8 weights are decoded once (gguf-py's values: a (u - o) or fma(a, u, b)) and multiplied into
// its R accumulators, so an output is the same fma sequence over its inputs whatever the tile shape, then the same
// horizontal sum and bias as k_rows.

// a and b of group g of a LAYOUT_K column (as column_params computes them)
template <int TYPE>
__attribute__((always_inline)) inline void k_group_params(const uint8_t* col, const Offsets& o, int64_t g, __m256& a,
                                                          __m256& b) {
  using T = Traits<TYPE>;
  constexpr int kPerUnit = T::kUnit / T::kGroup;
  if constexpr (T::kScales && !T::kAsym) {  // Q6_K: int8 scales
    const float scale = static_cast<float>(static_cast<int8_t>(col[o.sc + g]));
    a = _mm256_set1_ps(h2f(ld16(col + o.d + 2 * (g / kPerUnit))) * scale);
  } else if constexpr (T::kScales) {  // Q4_K, Q5_K: 6-bit scales and mins
    a = _mm256_set1_ps(h2f(ld16(col + o.d + 2 * (g / kPerUnit))) * static_cast<float>(col[o.sc + g]));
    b = _mm256_set1_ps(-(h2f(ld16(col + o.m + 2 * (g / kPerUnit))) * static_cast<float>(col[o.mn + g])));
  } else {
    a = _mm256_set1_ps(h2f(ld16(col + o.d + 2 * g)));
    if constexpr (T::kAsym) b = _mm256_set1_ps(h2f(ld16(col + o.m + 2 * g)));
  }
}

// the 8 weights of inputs 16 v + 8 half .. + 7 of a column (v: 16-input vector; chunk = v / 4 of 64 inputs,
// `single`: the last chunk holds one group of 32 inputs)
template <int TYPE>
__attribute__((always_inline)) inline __m256 k_weights(const uint8_t* col, const Offsets& o, int64_t v, int half,
                                                       bool single, __m256 a, __m256 b) {
  using T = Traits<TYPE>;
  if constexpr (T::kBits == 8) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ld64x(col + o.codes + 16 * v + 8 * half))), a);
  } else {
    const int64_t chunk = v / 4;
    const int s = static_cast<int>(v % 4);
    const __m256i lanes = single ? _mm256_cvtepu8_epi32(ld64x(col + o.codes + 32 * chunk + 8 * half))
                                 : _mm256_cvtepu16_epi32(ld128(col + o.codes + 32 * chunk + 16 * half));
    __m256i u = _mm256_and_si256(_mm256_srlv_epi32(lanes, _mm256_set1_epi32(4 * s)), _mm256_set1_epi32(15));
#pragma GCC unroll 2
    for (int plane = 0; plane < T::kPlanes; ++plane) {
      const uint32_t bits = (ld16(col + (plane ? o.plane2 : o.plane) + 2 * v) >> (8 * half)) & 0xFF;
      u = _mm256_add_epi32(u, bits_to_lanes(bits, 16 << plane));
    }
    if constexpr (T::kAsym) {
      return _mm256_fmadd_ps(a, _mm256_cvtepi32_ps(u), b);
    } else {  // a (u - o), exact like gguf-py's d * (q - o), signed zeros included
      return _mm256_mul_ps(a, _mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(T::kOffset))));
    }
  }
}

// bytes ahead of the columns being computed that one- and two-row tiles prefetch (may point past the weights:
// prefetches never fault)
constexpr int64_t kPrefetchAheadBytes = 8192;

template <int TYPE, int R, int C>
__attribute__((noinline)) void k_tile(const LinearArgs& args, int64_t r0, int64_t n) {
  using T = Traits<TYPE>;
  const int64_t k = args.k, row_bytes = packed_row_bytes(*args.type, k);
  const Offsets o = offsets(*args.type, LAYOUT_K, k);
  const uint8_t* cols[C];
#pragma GCC unroll 8
  for (int c = 0; c < C; ++c) cols[c] = args.payload + (n + c) * row_bytes;
  __m256 acc[R][C];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t pairs = k / 64;
  constexpr int kVectorsPerGroup = T::kGroup / 16;
  for (int64_t g = 0; g < k / T::kGroup; ++g) {
    __m256 a[C], b[C];
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      b[c] = _mm256_setzero_ps();
      k_group_params<TYPE>(cols[c], o, g, a[c], b[c]);
      if (R <= 2) _mm_prefetch(reinterpret_cast<const char*>(cols[c] + kPrefetchAheadBytes + g * T::kGroup / 2), _MM_HINT_T0);
    }
#pragma GCC unroll 2
    for (int vv = 0; vv < kVectorsPerGroup; ++vv) {
      const int64_t v = g * kVectorsPerGroup + vv;
      const bool single = v / 4 >= pairs;
#pragma GCC unroll 2
      for (int half = 0; half < 2; ++half) {
        const int64_t i = 16 * v + 8 * half;
#pragma GCC unroll 8
        for (int c = 0; c < C; ++c) {
          const __m256 w = k_weights<TYPE>(cols[c], o, v, half, single, a[c], b[c]);
#pragma GCC unroll 8
          for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(args.x + (r0 + r) * k + i), w, acc[r][c]);
        }
      }
    }
  }
  store_sums<R, C>(args, acc, r0, n);
}

// columns [n_begin, n_end) for every row: tiles of 4 rows x 2 columns, then 2 or 1 rows x 4 columns (1 column at
// the end of the range)
template <int TYPE>
void k_run(const LinearArgs& args, int64_t n_begin, int64_t n_end) {
  int64_t n = n_begin;
  for (; n + 4 <= n_end; n += 4) {
    int64_t r = 0;
    for (; r + 4 <= args.m; r += 4) { k_tile<TYPE, 4, 2>(args, r, n); k_tile<TYPE, 4, 2>(args, r, n + 2); }
    if (r + 2 <= args.m) { k_tile<TYPE, 2, 4>(args, r, n); r += 2; }
    if (r < args.m) k_tile<TYPE, 1, 4>(args, r, n);
  }
  for (; n < n_end; ++n) {
    int64_t r = 0;
    for (; r + 4 <= args.m; r += 4) k_tile<TYPE, 4, 1>(args, r, n);
    for (; r < args.m; ++r) k_tile<TYPE, 1, 1>(args, r, n);
  }
}

// ============================================================================================ int8 numerics
// One tile: R rows x H halves (8 columns each) of a 16-column group, every unit and group of the inputs in order.
// Per group and row, the exact integer sum of each column: vpmaddubsw of 4 code bytes with 4 activation bytes
// (pairs summed in int16), kSteps16 such 4-input steps summed in int16 (no step pair exceeds 2 * 63 * 127 and no run
// of kSteps16 steps 32767, so the int16 sums are exact), then widened by vpmaddwd; 8-bit codes through the sign
// trick one step at a time. Then the float operations every int8 path does, in the same order.

// a (and b) of the 8 columns of half `half` for group gi of a unit record
template <int TYPE>
__attribute__((always_inline)) inline void n_params(const uint8_t* rec, const Offsets& o, int gi, int half, __m256& a,
                                                    __m256& b) {
  using T = Traits<TYPE>;
  const __m256 d = _mm256_cvtph_ps(ld128(rec + o.d + 16 * half));
  if constexpr (T::kScales && T::kAsym) {  // Q4_K, Q5_K: 6-bit scales and mins
    const __m256 dmin = _mm256_cvtph_ps(ld128(rec + o.m + 16 * half));
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ld64x(rec + o.sc + 16 * gi + 8 * half)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ld64x(rec + o.mn + 16 * gi + 8 * half)));
    a = _mm256_mul_ps(d, sc);
    b = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, mn));
  } else if constexpr (T::kScales) {  // Q6_K: int8 scales
    a = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ld64x(rec + o.sc + 16 * gi + 8 * half))));
  } else {
    a = d;
    if constexpr (T::kAsym) b = _mm256_cvtph_ps(ld128(rec + o.m + 16 * half));
  }
}

// the fifth bits of 5-bit codes: bits 32 half .. 32 half + 31 of step h's 64-bit mask -> 16 << plane per byte
__attribute__((always_inline)) inline __m256i plane_bits(const uint8_t* p, int plane) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(ld32(p))),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
  const __m256i hit = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
  return _mm256_and_si256(hit, _mm256_set1_epi8(static_cast<char>(16 << plane)));
}

// code bytes of the 8 columns of `half` for the 4-input step h of the unit (4 bytes per column)
template <int TYPE>
__attribute__((always_inline)) inline __m256i n_codes(const uint8_t* rec, const Offsets& o, int h, int half) {
  using T = Traits<TYPE>;
  if constexpr (T::kBits == 8) {
    return ld256(rec + o.codes + 64 * h + 32 * half);
  } else {
    const __m256i v = ld256(rec + o.codes + 64 * (h / 2) + 32 * half);
    __m256i c = _mm256_and_si256(h % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
    if constexpr (T::kBits == 5) c = _mm256_add_epi8(c, plane_bits(rec + o.plane + 8 * h + 4 * half, 0));
    if constexpr (T::kBits == 6) {  // bits 2 (h % 4) and up of the high vector to bits 4-5 (quant.h)
      const __m256i hv = ld256(rec + o.plane + 64 * (h / 4) + 32 * half);
      const int s = h % 4;
      const __m256i at = s == 0   ? _mm256_slli_epi16(hv, 4)
                         : s == 1 ? _mm256_slli_epi16(hv, 2)
                         : s == 2 ? hv
                                  : _mm256_srli_epi16(hv, 2);
      c = _mm256_or_si256(c, _mm256_and_si256(at, _mm256_set1_epi8(0x30)));
    }
    return c;
  }
}

// units ahead of the one being computed that one- and two-row tiles prefetch (past the weights: prefetches never
// fault)
constexpr int64_t kPrefetchUnits = 4;

template <int TYPE, int R, int H>
__attribute__((noinline)) void n_tile(const LinearArgs& args, const uint8_t* base, int64_t row0, int64_t n0, int half0) {
  using T = Traits<TYPE>;
  constexpr int G = T::kGroup, S = G / 4;
  const QuantizedRows& xq = *args.xq;
  const int64_t k = args.k;
  const Offsets o = offsets(*args.type, LAYOUT_N, k);
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i sign_bit = _mm256_set1_epi8(static_cast<char>(0x80));
  __m256 acc[R][H], accb[R][H];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int hh = 0; hh < H; ++hh) acc[r][hh] = accb[r][hh] = _mm256_setzero_ps();
  for (int64_t unit = 0; unit < k / T::kUnit; ++unit) {
    const uint8_t* rec = base + unit * o.total;
    if (R <= 2) {  // one or two rows stream the weights: fetch a few units ahead into L2
      for (int64_t line = 0; line < o.total; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetchUnits * o.total + line), _MM_HINT_T1);
    }
    for (int gi = 0; gi < T::kUnit / G; ++gi) {
      const int64_t kbase = unit * T::kUnit + gi * G;  // first input of the group
      __m256i isum[R][H], s16[R][H];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        __m256i start = _mm256_setzero_si256();
        if constexpr (T::kIntOffset > 0) {
          const int32_t* sums = xq.sum16 + (row0 + r) * (k / 16) + kbase / 16;
          start = _mm256_set1_epi32(-T::kIntOffset * (G == 16 ? sums[0] : sums[0] + sums[1]));
        }
#pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh) { isum[r][hh] = start; s16[r][hh] = _mm256_setzero_si256(); }
      }
#pragma GCC unroll 8
      for (int h = 0; h < S; ++h) {
        __m256i codes[H], magnitude[H];
#pragma GCC unroll 2
        for (int hh = 0; hh < H; ++hh) {
          codes[hh] = n_codes<TYPE>(rec, o, gi * S + h, half0 + hh);
          if constexpr (T::kBits == 8) {  // signed q: |q| (128 fits as unsigned) times x with q's sign
            codes[hh] = _mm256_xor_si256(codes[hh], sign_bit);
            magnitude[hh] = _mm256_abs_epi8(codes[hh]);
          }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* q = xq.q + (row0 + r) * k + kbase + 4 * h;
          const __m256i x4 = _mm256_set1_epi32(static_cast<int>(ld32(reinterpret_cast<const uint8_t*>(q))));
#pragma GCC unroll 2
          for (int hh = 0; hh < H; ++hh) {
            if constexpr (T::kBits == 8) {
              const __m256i p = _mm256_maddubs_epi16(magnitude[hh], _mm256_sign_epi8(x4, codes[hh]));
              isum[r][hh] = _mm256_add_epi32(isum[r][hh], _mm256_madd_epi16(p, ones));
            } else {
              s16[r][hh] = _mm256_add_epi16(s16[r][hh], _mm256_maddubs_epi16(codes[hh], x4));
              if ((h + 1) % T::kSteps16 == 0) {
                isum[r][hh] = _mm256_add_epi32(isum[r][hh], _mm256_madd_epi16(s16[r][hh], ones));
                s16[r][hh] = _mm256_setzero_si256();
              }
            }
          }
        }
      }
#pragma GCC unroll 2
      for (int hh = 0; hh < H; ++hh) {
        __m256 a, b = _mm256_setzero_ps();
        n_params<TYPE>(rec, o, gi, half0 + hh, a, b);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int64_t block = (row0 + r) * (k / 32) + kbase / 32;
          const __m256 s = _mm256_mul_ps(a, _mm256_set1_ps(xq.d[block]));
          acc[r][hh] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][hh]), s, acc[r][hh]);
          if constexpr (T::kAsym) accb[r][hh] = _mm256_fmadd_ps(b, _mm256_set1_ps(xq.s[block]), accb[r][hh]);
        }
      }
    }
  }
#pragma GCC unroll 2
  for (int hh = 0; hh < H; ++hh) {
    const int64_t col = n0 + 8 * (half0 + hh);
    for (int r = 0; r < R; ++r) {
      float out[8];
      _mm256_storeu_ps(out, T::kAsym ? _mm256_add_ps(acc[r][hh], accb[r][hh]) : acc[r][hh]);
      float* y = args.y + (row0 + r) * args.n;
      for (int j = 0; j < 8 && col + j < args.n; ++j) y[col + j] = args.bias ? out[j] + args.bias[col + j] : out[j];
    }
  }
}

// every row of the 16 columns of one column group: 4-row tiles a half at a time, then a pair and a single row over
// both halves
template <int TYPE>
void n_columns(const LinearArgs& args, const uint8_t* base, int64_t n0) {
  int64_t r = 0;
  for (; r + 4 <= args.m; r += 4) {
    n_tile<TYPE, 4, 1>(args, base, r, n0, 0);
    if (n0 + 8 < args.n) n_tile<TYPE, 4, 1>(args, base, r, n0, 1);
  }
  if (r + 2 <= args.m) { n_tile<TYPE, 2, 2>(args, base, r, n0, 0); r += 2; }
  if (r < args.m) n_tile<TYPE, 1, 2>(args, base, r, n0, 0);
}

template <int TYPE>
void n_run(const LinearArgs& args, int64_t n_begin, int64_t n_end) {
  const int64_t group_bytes = kColumnsPerGroup * packed_row_bytes(*args.type, args.k);
  for (int64_t n = n_begin; n < n_end; n += kColumnsPerGroup)
    n_columns<TYPE>(args, args.payload + n / kColumnsPerGroup * group_bytes, n);
}

}  // namespace

bool linear_k_avx2(const LinearArgs& args, int64_t n_begin, int64_t n_end, float* scratch) {
  if (with_quant_type(args.type->type, [&](auto type) { k_run<decltype(type)::value>(args, n_begin, n_end); }))
    return true;
  // float weights (F32 / F16 / BF16): each column decoded once per call into scratch, then every row
  const TypeInfo& t = *args.type;
  const int64_t k = args.k, row_bytes = packed_row_bytes(t, k);
  for (int64_t n = n_begin; n < n_end; n += 4) {
    const int columns = n_end - n < 4 ? static_cast<int>(n_end - n) : 4;
    const float* weights[4];
    for (int c = 0; c < columns; ++c) {
      const uint8_t* col = args.payload + (n + c) * row_bytes;
      float* w = scratch + c * k;
      weights[c] = w;
      if (t.type == F32) {
        weights[c] = reinterpret_cast<const float*>(col);  // LAYOUT_K holds F32 columns as they are
      } else {
        float_decode(t, col, k, w);
      }
    }
    for (int64_t r = 0; r < args.m; r += 2) {
      const bool pair = r + 2 <= args.m;
      if (columns == 4) {
        pair ? k_rows<2, 4>(args, weights, r, n) : k_rows<1, 4>(args, weights, r, n);
      } else {
        for (int c = 0; c < columns; ++c)
          pair ? k_rows<2, 1>(args, weights + c, r, n + c) : k_rows<1, 1>(args, weights + c, r, n + c);
      }
    }
  }
  return true;
}

bool linear_n_avx2(const LinearArgs& args, int64_t n_begin, int64_t n_end, float*) {
  return with_quant_type(args.type->type, [&](auto type) { n_run<decltype(type)::value>(args, n_begin, n_end); });
}

// The portable quantizer's bits (quant_layout.cpp): max(|v|, acc) keeps acc where |v| is NaN (std::fmax's NaN
// rule), max(NaN, -127) = -127 then min(., 127) (its clamp), vcvtps2dq rounds half to even (std::nearbyint under
// the default rounding mode); the codes, within [-127, 127], pack to bytes without saturating.
void quantize_rows_avx2(const float* x, int64_t row_begin, int64_t row_end, QuantizedRows& out) {
  const int64_t k = out.k, blocks = k / 32;
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const float* v = x + r * k + 32 * blk;
      __m256 vs[4];
      __m256 amax = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        vs[j] = _mm256_loadu_ps(v + 8 * j);
        amax = _mm256_max_ps(_mm256_and_ps(vs[j], abs_mask), amax);
      }
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
      const float d = _mm_cvtss_f32(m4) / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      const __m256 scale = _mm256_set1_ps(id);
      __m256i q[4];
      for (int j = 0; j < 4; ++j)
        q[j] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(vs[j], scale), lo), hi));
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q + r * k + 32 * blk), bytes);
      int32_t sums[2];
      for (int h = 0; h < 2; ++h) {
        const __m256i s8 = _mm256_add_epi32(q[2 * h], q[2 * h + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
        sums[h] = _mm_cvtsi128_si32(s4);
      }
      out.d[r * blocks + blk] = d;
      out.s[r * blocks + blk] = d * static_cast<float>(sums[0] + sums[1]);
      out.sum16[r * (k / 16) + 2 * blk] = sums[0];
      out.sum16[r * (k / 16) + 2 * blk + 1] = sums[1];
    }
  }
}

}  // namespace eagle::quant

#pragma GCC pop_options

#else  // not x86-64: never called

namespace eagle::quant {
bool linear_k_avx2(const LinearArgs&, int64_t, int64_t, float*) { return false; }
bool linear_n_avx2(const LinearArgs&, int64_t, int64_t, float*) { return false; }
void quantize_rows_avx2(const float* x, int64_t row_begin, int64_t row_end, QuantizedRows& out) {
  quantize_rows_portable(x, row_begin, row_end, out);
}
}  // namespace eagle::quant

#endif
