// Elementwise math and reductions of the attention kernel, written once per instruction set so that every path
// computes the same bits.
//
// Each function below is a fixed sequence of IEEE operations (add, multiply, divide, fused multiply-add, round to
// nearest even, min/max, bit operations) applied lane by lane. The scalar versions (namespace scalar) perform the
// same sequence with std::fma and std::nearbyint, so a value computed in an AVX-512 vector body, an AVX2 body or a
// scalar tail is bit-identical: the kernel never needs "one exp for bodies and another for tails".
//
// This file must be compiled with -ffp-contract=off (the pragma in attention.cpp sets it for the translation unit):
// otherwise the compiler may fuse a multiply and an add of one path into an FMA and not those of another.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

// EAGLE_ATTENTION_PORTABLE_ONLY builds the portable path alone (what a non-x86 CPU gets), for testing it on x86.
#if (defined(__x86_64__) || defined(__i386__)) && !defined(EAGLE_ATTENTION_PORTABLE_ONLY)
#define EAGLE_ATTENTION_X86 1
#include <immintrin.h>
#define EAGLE_TARGET_AVX2 __attribute__((target("avx2,fma")))
#define EAGLE_TARGET_AVX512 __attribute__((target("avx512f,avx2,fma")))
#endif

namespace eagle {
namespace attention_math {

// exp(x) for x in [kExpMin, kExpMax]: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so that n ln2 is exact
// enough), e^r by a degree-7 polynomial (minimax coefficients of the classical single-precision expf), times 2^n
// built in the exponent bits. Below kExpMin the result is 0; above kExpMax it saturates at e^kExpMax (the kernel
// calls it with x <= 0 for softmax and x <= 18 for tanh).
constexpr float kExpMin = -87.0f;
constexpr float kExpMax = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kExpP0 = 1.9875691500e-4f;
constexpr float kExpP1 = 1.3981999507e-3f;
constexpr float kExpP2 = 8.3334519073e-3f;
constexpr float kExpP3 = 4.1665795894e-2f;
constexpr float kExpP4 = 1.6666665459e-1f;
constexpr float kExpP5 = 5.0000001201e-1f;

// tanh(x): for |x| < kTanhSmall an odd polynomial x + x^3 P(x^2) (classical single-precision coefficients), else
// 1 - 2 / (e^(2|x|) + 1) with the sign of x; |x| is clamped at kTanhClamp, where tanh is 1 in float32.
constexpr float kTanhSmall = 0.625f;
constexpr float kTanhClamp = 9.0f;
constexpr float kTanhP0 = -5.70498872745e-3f;
constexpr float kTanhP1 = 2.06390887954e-2f;
constexpr float kTanhP2 = -5.37397155531e-2f;
constexpr float kTanhP3 = 1.33314422036e-1f;
constexpr float kTanhP4 = -3.33332819422e-1f;

// The width of the lane structure every path follows: a dot product over D keeps 16 partial sums (lane l takes
// d = l, l + 16, ...), a sum over visible keys keeps 16 partial sums (lane l takes keys l, l + 16, ...), and both
// end with tree16.
constexpr int kLanes = 16;

namespace scalar {

// max/min with the operand order of x86 maxps/minps: the second operand when the comparison is false (NaN).
inline float max_like_simd(float a, float b) { return a > b ? a : b; }
inline float min_like_simd(float a, float b) { return a < b ? a : b; }

inline float exp(float x) {
  const bool underflow = !(x >= kExpMin);
  x = min_like_simd(max_like_simd(x, kExpMin), kExpMax);
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = std::fma(kExpP0, r, kExpP1);
  p = std::fma(p, r, kExpP2);
  p = std::fma(p, r, kExpP3);
  p = std::fma(p, r, kExpP4);
  p = std::fma(p, r, kExpP5);
  const float r2 = r * r;
  float y = std::fma(p, r2, r);
  y = y + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  y = y * scale;
  return underflow ? 0.0f : y;
}

inline float tanh(float x) {
  const float t = min_like_simd(std::fabs(x), kTanhClamp);
  const float z = x * x;
  float p = std::fma(kTanhP0, z, kTanhP1);
  p = std::fma(p, z, kTanhP2);
  p = std::fma(p, z, kTanhP3);
  p = std::fma(p, z, kTanhP4);
  const float small = std::fma(p * z, x, x);
  const float e = exp(t + t);
  const float large = std::copysign(1.0f - 2.0f / (e + 1.0f), x);
  return t < kTanhSmall ? small : large;
}

// cap * tanh(s / cap) (Gemma 2's attention logit soft-capping).
inline float softcap(float s, float cap) { return cap * tanh(s / cap); }

// The fixed reduction of 16 partial sums: halve (l + 8), halve (l + 4), halve (l + 2), last pair.
inline float tree16(const float* x) {
  float y[8], z[4];
  for (int l = 0; l < 8; ++l) y[l] = x[l] + x[l + 8];
  for (int l = 0; l < 4; ++l) z[l] = y[l] + y[l + 4];
  const float w0 = z[0] + z[2];
  const float w1 = z[1] + z[3];
  return w0 + w1;
}

}  // namespace scalar

#ifdef EAGLE_ATTENTION_X86
namespace avx512 {

EAGLE_TARGET_AVX512 inline __m512 exp(__m512 x) {
  const __mmask16 underflow = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kExpMin), _CMP_NGE_UQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpMin)), _mm512_set1_ps(kExpMax));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Hi), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Lo), r);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kExpP0), r, _mm512_set1_ps(kExpP1));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpP5));
  const __m512 r2 = _mm512_mul_ps(r, r);
  __m512 y = _mm512_fmadd_ps(p, r2, r);
  y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  return _mm512_mask_mov_ps(y, underflow, _mm512_setzero_ps());
}

EAGLE_TARGET_AVX512 inline __m512 tanh(__m512 x) {
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(INT32_MIN));
  const __m512 abs = _mm512_castsi512_ps(_mm512_andnot_si512(_mm512_castps_si512(sign), _mm512_castps_si512(x)));
  const __m512 t = _mm512_min_ps(abs, _mm512_set1_ps(kTanhClamp));
  const __m512 z = _mm512_mul_ps(x, x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kTanhP0), z, _mm512_set1_ps(kTanhP1));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(kTanhP2));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(kTanhP3));
  p = _mm512_fmadd_ps(p, z, _mm512_set1_ps(kTanhP4));
  const __m512 small = _mm512_fmadd_ps(_mm512_mul_ps(p, z), x, x);
  const __m512 e = exp(_mm512_add_ps(t, t));
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 large = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  const __m512i x_sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_castps_si512(sign));
  large = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(large), x_sign));
  const __mmask16 is_small = _mm512_cmp_ps_mask(t, _mm512_set1_ps(kTanhSmall), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(large, is_small, small);
}

EAGLE_TARGET_AVX512 inline __m512 softcap(__m512 s, float cap) {
  const __m512 c = _mm512_set1_ps(cap);
  return _mm512_mul_ps(c, tanh(_mm512_div_ps(s, c)));
}

// tree16 of each of 16 vectors at once: lane j of the result is scalar::tree16 of acc[j]'s 16 lanes.
EAGLE_TARGET_AVX512 inline __m512 tree16_transposed(const __m512* acc) {
  __m512 halves[8], quarters[4], eighths[2];
  for (int j = 0; j < 8; ++j) {  // lanes 0-7: key 2j's y, lanes 8-15: key 2j+1's y
    const __m512 a = acc[2 * j], b = acc[2 * j + 1];
    halves[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
  }
  for (int j = 0; j < 4; ++j) {  // 128-bit block m: key 4j+m's z
    const __m512 a = halves[2 * j], b = halves[2 * j + 1];
    quarters[j] = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
  }
  for (int j = 0; j < 2; ++j) {  // block m: key 8j+m's (w0, w1), then key 8j+4+m's
    const __m512 a = quarters[2 * j], b = quarters[2 * j + 1];
    eighths[j] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                               _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // lane 4m + c: key 4c + m
  const __m512 sums = _mm512_add_ps(_mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_ps(eighths[0], eighths[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, sums);
}

EAGLE_TARGET_AVX512 inline float tree16(__m512 x) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, x);
  return scalar::tree16(lanes);
}

EAGLE_TARGET_AVX512 inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>(count <= 0 ? 0 : (1u << count) - 1u);
}

}  // namespace avx512

namespace avx2 {

EAGLE_TARGET_AVX2 inline __m256 exp(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMin), _CMP_NGE_UQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpMin)), _mm256_set1_ps(kExpMax));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kExpP0), r, _mm256_set1_ps(kExpP1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpP5));
  const __m256 r2 = _mm256_mul_ps(r, r);
  __m256 y = _mm256_fmadd_ps(p, r2, r);
  y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
  return _mm256_andnot_ps(underflow, y);
}

EAGLE_TARGET_AVX2 inline __m256 tanh(__m256 x) {
  const __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32(INT32_MIN));
  const __m256 t = _mm256_min_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(kTanhClamp));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kTanhP0), z, _mm256_set1_ps(kTanhP1));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kTanhP2));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kTanhP3));
  p = _mm256_fmadd_ps(p, z, _mm256_set1_ps(kTanhP4));
  const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(p, z), x, x);
  const __m256 e = exp(_mm256_add_ps(t, t));
  const __m256 one = _mm256_set1_ps(1.0f);
  __m256 large = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  large = _mm256_or_ps(large, _mm256_and_ps(x, sign));
  const __m256 is_small = _mm256_cmp_ps(t, _mm256_set1_ps(kTanhSmall), _CMP_LT_OQ);
  return _mm256_blendv_ps(large, small, is_small);
}

EAGLE_TARGET_AVX2 inline __m256 softcap(__m256 s, float cap) {
  const __m256 c = _mm256_set1_ps(cap);
  return _mm256_mul_ps(c, tanh(_mm256_div_ps(s, c)));
}

// A lane mask for _mm256_maskload_ps / _mm256_maskstore_ps: the first `count` lanes (clamped to 0..8).
EAGLE_TARGET_AVX2 inline __m256i first_lanes(int64_t count) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int c = count <= 0 ? 0 : (count >= 8 ? 8 : static_cast<int>(count));
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), lane);
}

// Steps 2 and 3 of tree16 for 4 keys whose step-1 sums (y, 8 lanes each) are y[0..3]: block m of the result holds
// key m's (w0, w1) then key 2+m's.
EAGLE_TARGET_AVX2 inline __m256 tree16_steps23(const __m256* y) {
  const __m256 z01 = _mm256_add_ps(_mm256_permute2f128_ps(y[0], y[1], 0x20), _mm256_permute2f128_ps(y[0], y[1], 0x31));
  const __m256 z23 = _mm256_add_ps(_mm256_permute2f128_ps(y[2], y[3], 0x20), _mm256_permute2f128_ps(y[2], y[3], 0x31));
  return _mm256_add_ps(_mm256_shuffle_ps(z01, z23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(z01, z23, _MM_SHUFFLE(3, 2, 3, 2)));
}

// The last step for 8 keys from the step-3 results of keys 0-3 (w_a) and 4-7 (w_b): lane j = key j's tree16.
EAGLE_TARGET_AVX2 inline __m256 tree16_step4(__m256 w_a, __m256 w_b) {
  // lane 4m + c: key 2c + m (in w_a's numbering: c = 0, 1 from w_a, c = 2, 3 from w_b)
  const __m256 sums = _mm256_add_ps(_mm256_shuffle_ps(w_a, w_b, _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm256_shuffle_ps(w_a, w_b, _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

EAGLE_TARGET_AVX2 inline float tree16(__m256 lo, __m256 hi) {
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, lo);
  _mm256_store_ps(lanes + 8, hi);
  return scalar::tree16(lanes);
}

}  // namespace avx2
#endif  // EAGLE_ATTENTION_X86

}  // namespace attention_math
}  // namespace eagle
