// AVX2 + FMA kernels, compiled for that target in this file only and called only on a CPU that has it.
//
// float32 numerics (LAYOUT_K): each column is decoded once per call into float32 weights (gguf-py's values, 8
// inputs at a time), then every row takes one 8-lane accumulator through fma(x[8 inputs], w[8 inputs], acc) in input
// order, a fixed horizontal sum and the bias.
// int8 numerics (LAYOUT_N): the integer group sums of the AVX-512 kernels (vpmaddubsw + vpmaddwd instead of
// vpdpbusd; 8-bit codes through the sign trick, which gives the same exact integers), combined in float by the
// same operations in the same order: its outputs are bit-identical to the AVX-512 and portable int8 kernels'.
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
void k_params(const TypeInfo& t, const uint8_t* col, const Offsets& o, int64_t k, float* a, float* b) {
  const int64_t groups = k / t.group;
  for (int64_t g = 0; g < groups; ++g) {
    if (!t.has_scales) {
      a[g] = h2f(ld16(col + o.d + 2 * g));
      b[g] = t.has_m ? h2f(ld16(col + o.m + 2 * g)) : 0.0f;
    } else if (t.type == Q6_K) {
      a[g] = h2f(ld16(col + o.d + 2 * (g / 16))) * static_cast<float>(static_cast<int8_t>(col[o.sc + g]));
      b[g] = 0.0f;
    } else {
      a[g] = h2f(ld16(col + o.d + 2 * (g / 8))) * static_cast<float>(col[o.sc + g]);
      b[g] = -(h2f(ld16(col + o.m + 2 * (g / 8))) * static_cast<float>(col[o.mn + g]));
    }
  }
}

// The column's weights w[K] (quant types), 16 inputs (vector v) at a time, in two halves of 8.
void k_decode(const TypeInfo& t, const uint8_t* col, const Offsets& o, int64_t k, const float* a, const float* b,
              float* w) {
  const int64_t vectors = k / 16, pairs = k / 64;
  const __m256i fifteen = _mm256_set1_epi32(15);
  for (int64_t v = 0; v < vectors; ++v) {
    const int64_t g = v * 16 / t.group;
    const __m256 av = _mm256_set1_ps(a[g]), bv = _mm256_set1_ps(b[g]);
    for (int half = 0; half < 2; ++half) {
      __m256 wv;
      if (t.code_bits == 8) {
        const __m256i q = _mm256_cvtepi8_epi32(ld64x(col + o.codes + 16 * v + 8 * half));
        wv = _mm256_mul_ps(_mm256_cvtepi32_ps(q), av);
      } else {
        const int64_t chunk = v / 4, s = v % 4;  // pair chunk and nibble (the last odd group: a single chunk)
        __m256i lanes;
        if (chunk < pairs) {
          lanes = _mm256_cvtepu16_epi32(ld128(col + o.codes + 32 * chunk + 16 * half));
        } else {
          lanes = _mm256_cvtepu8_epi32(ld64x(col + o.codes + 32 * chunk + 8 * half));
        }
        __m256i u = _mm256_and_si256(_mm256_srlv_epi32(lanes, _mm256_set1_epi32(static_cast<int>(4 * s))), fifteen);
        for (int plane = 0; plane < t.planes(); ++plane) {
          const uint32_t bits = (ld16(col + (plane ? o.plane2 : o.plane) + 2 * v) >> (8 * half)) & 0xFF;
          u = _mm256_add_epi32(u, bits_to_lanes(bits, 16 << plane));
        }
        if (t.offset >= 0) {  // symmetric: a (u - o), exact like gguf-py's d * (q - o), signed zeros included
          wv = _mm256_mul_ps(av, _mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(t.offset))));
        } else {
          wv = _mm256_fmadd_ps(av, _mm256_cvtepi32_ps(u), bv);
        }
      }
      _mm256_storeu_ps(w + 16 * v + 8 * half, wv);
    }
  }
}

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
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < C; ++c) {
      const float sum = hsum(acc[r][c]);
      args.y[(r0 + r) * args.n + n + c] = args.bias ? sum + args.bias[n + c] : sum;
    }
}

// ============================================================================================ int8 numerics
struct NGroup {
  __m256i codes[2][8];  // [half: columns 0-7 / 8-15][4-input step]
  __m256 a[2], b[2];
};

void n_group(const TypeInfo& t, const uint8_t* rec, const Offsets& o, int gi, NGroup& ng) {
  const int G = t.group, h0 = gi * G / 4;
  for (int half = 0; half < 2; ++half) {
    const __m256 d = _mm256_cvtph_ps(ld128(rec + o.d + 16 * half));
    if (t.type == Q4_K || t.type == Q5_K) {
      const __m256 dmin = _mm256_cvtph_ps(ld128(rec + o.m + 16 * half));
      const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ld64x(rec + o.sc + 16 * gi + 8 * half)));
      const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(ld64x(rec + o.mn + 16 * gi + 8 * half)));
      ng.a[half] = _mm256_mul_ps(d, sc);
      ng.b[half] = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(dmin, mn));
    } else if (t.type == Q6_K) {
      ng.a[half] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(ld64x(rec + o.sc + 16 * gi + 8 * half))));
      ng.b[half] = _mm256_setzero_ps();
    } else {
      ng.a[half] = d;
      ng.b[half] = t.has_m ? _mm256_cvtph_ps(ld128(rec + o.m + 16 * half)) : _mm256_setzero_ps();
    }
    for (int h = 0; h < G / 4; ++h) {
      __m256i c;
      if (t.code_bits == 8) {
        c = ld256(rec + o.codes + 64 * (h0 + h) + 32 * half);
      } else {
        const __m256i v = ld256(rec + o.codes + 64 * ((h0 + h) / 2) + 32 * half);
        c = _mm256_and_si256((h0 + h) % 2 ? _mm256_srli_epi16(v, 4) : v, _mm256_set1_epi8(0x0F));
        for (int plane = 0; plane < t.planes(); ++plane) {
          // bits 32 half .. 32 half + 31 of the step's 64-bit mask -> one byte each
          const uint32_t bits = ld32(rec + (plane ? o.plane2 : o.plane) + 8 * (h0 + h) + 4 * half);
          const __m256i spread = _mm256_shuffle_epi8(
              _mm256_set1_epi32(static_cast<int>(bits)),
              _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
                               3, 3, 3));
          const __m256i select = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
          const __m256i hit = _mm256_cmpeq_epi8(_mm256_and_si256(spread, select), select);
          c = _mm256_add_epi8(c, _mm256_and_si256(hit, _mm256_set1_epi8(static_cast<char>(16 << plane))));
        }
      }
      ng.codes[half][h] = c;
    }
  }
}

// exact integer sums of the group for one row: (sum over the group of x q) per column
inline __m256i n_isum(const TypeInfo& t, const NGroup& ng, int half, const int8_t* q, int32_t correction) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i isum = _mm256_set1_epi32(correction);
  for (int h = 0; h < t.group / 4; ++h) {
    const __m256i x4 = _mm256_set1_epi32(static_cast<int>(ld32(reinterpret_cast<const uint8_t*>(q) + 4 * h)));
    __m256i p16;
    if (t.code_bits == 8) {  // signed codes q: |q| (128 fits as unsigned) times x with q's sign, no saturation
      const __m256i signed_codes = _mm256_xor_si256(ng.codes[half][h], _mm256_set1_epi8(static_cast<char>(0x80)));
      p16 = _mm256_maddubs_epi16(_mm256_abs_epi8(signed_codes), _mm256_sign_epi8(x4, signed_codes));
    } else {
      p16 = _mm256_maddubs_epi16(ng.codes[half][h], x4);
    }
    isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, ones));
  }
  return isum;
}

constexpr int kRowTile = 4;

// rows [r0, r0 + rows) of the 16 columns of one column group
void n_rows(const LinearArgs& args, const uint8_t* base, int64_t n0, int64_t r0, int rows) {
  const TypeInfo& t = *args.type;
  const QuantizedRows& xq = *args.xq;
  const int64_t k = args.k;
  const Offsets o = offsets(t, LAYOUT_N, k);
  const bool asym = t.offset < 0;
  __m256 acc[kRowTile][2], accb[kRowTile][2];
  for (int r = 0; r < kRowTile; ++r)
    for (int half = 0; half < 2; ++half) acc[r][half] = accb[r][half] = _mm256_setzero_ps();
  for (int64_t unit = 0; unit < k / t.unit; ++unit) {
    for (int gi = 0; gi < t.groups_per_unit(); ++gi) {
      NGroup ng;
      n_group(t, base + unit * o.total, o, gi, ng);
      const int64_t kbase = unit * t.unit + gi * t.group;
      for (int r = 0; r < rows; ++r) {
        const int64_t row = r0 + r;
        const int8_t* q = xq.q + row * k + kbase;
        int32_t correction = 0;
        if (!asym && t.code_bits != 8) {
          const int32_t* s16 = xq.sum16 + row * (k / 16) + kbase / 16;
          correction = -t.offset * (t.group == 16 ? s16[0] : s16[0] + s16[1]);
        }
        const int64_t block = row * (k / 32) + kbase / 32;
        for (int half = 0; half < 2; ++half) {
          const __m256i isum = n_isum(t, ng, half, q, correction);
          const __m256 s = _mm256_mul_ps(ng.a[half], _mm256_set1_ps(xq.d[block]));
          acc[r][half] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, acc[r][half]);
          if (asym) accb[r][half] = _mm256_fmadd_ps(ng.b[half], _mm256_set1_ps(xq.s[block]), accb[r][half]);
        }
      }
    }
  }
  for (int r = 0; r < rows; ++r) {
    float out[16];
    for (int half = 0; half < 2; ++half)
      _mm256_storeu_ps(out + 8 * half, asym ? _mm256_add_ps(acc[r][half], accb[r][half]) : acc[r][half]);
    for (int j = 0; j < 16 && n0 + j < args.n; ++j)
      args.y[(r0 + r) * args.n + n0 + j] = args.bias ? out[j] + args.bias[n0 + j] : out[j];
  }
}

}  // namespace

bool linear_k_avx2(const LinearArgs& args, int64_t n_begin, int64_t n_end, float* scratch) {
  const TypeInfo& t = *args.type;
  const int64_t k = args.k, row_bytes = packed_row_bytes(t, k);
  const int64_t groups = t.group ? k / t.group : 0;
  float* a = scratch;
  float* b = a + groups;
  const Offsets o = offsets(t, LAYOUT_K, k);
  for (int64_t n = n_begin; n < n_end; n += 4) {
    const int columns = n_end - n < 4 ? static_cast<int>(n_end - n) : 4;
    const float* weights[4];
    for (int c = 0; c < columns; ++c) {  // each column decoded once per call, for every row
      const uint8_t* col = args.payload + (n + c) * row_bytes;
      float* w = b + groups + c * k;
      weights[c] = w;
      if (t.type == F32) {
        weights[c] = reinterpret_cast<const float*>(col);  // LAYOUT_K holds F32 columns as they are
      } else if (is_float_type(t)) {
        float_decode(t, col, k, w);
      } else {
        k_params(t, col, o, k, a, b);
        k_decode(t, col, o, k, a, b, w);
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
  const TypeInfo& t = *args.type;
  if (is_float_type(t)) return false;
  const int64_t group_bytes = kColumnsPerGroup * packed_row_bytes(t, args.k);
  for (int64_t n = n_begin; n < n_end; n += kColumnsPerGroup) {
    const uint8_t* base = args.payload + n / kColumnsPerGroup * group_bytes;
    for (int64_t r = 0; r < args.m; r += kRowTile)
      n_rows(args, base, n, r, static_cast<int>(args.m - r < kRowTile ? args.m - r : kRowTile));
  }
  return true;
}

}  // namespace eagle::quant

#pragma GCC pop_options

#else  // not x86-64: never called

namespace eagle::quant {
bool linear_k_avx2(const LinearArgs&, int64_t, int64_t, float*) { return false; }
bool linear_n_avx2(const LinearArgs&, int64_t, int64_t, float*) { return false; }
}  // namespace eagle::quant

#endif
