// AVX-512 kernels (F, BW, VL, DQ, VNNI), compiled for that target in this file only and called only on a CPU that
// has it (ops.cpp checks at run time).
//
// float32 numerics (LAYOUT_K): vector lanes along K. For each output, one accumulator of 16 lanes takes
// fma(x[16 inputs], w[16 inputs], acc) for the column's 16-input vectors in input order; then a fixed horizontal
// sum and the bias. Weights are decoded exactly (gguf-py's values, see quant.h): 4-bit codes through a 16-entry
// table of the group's weights (vpermps), 5-bit codes through two tables and the high-bit mask, 6- and 8-bit codes
// by conversion. A tile of R rows x C columns decodes each column's vectors once and applies them to its R rows;
// the tile shape changes how often a weight is decoded, never what an output computes.
//
// int8 numerics (LAYOUT_N): vector lanes along N (16 columns). Per group of G inputs, vpdpbusd multiplies 4 code
// bytes of each column with 4 activation bytes; the exact integer sum becomes float through
// acc = fma(float(isum), a * dx, acc) (and accb = fma(b, sx, accb) for asymmetric types), in group order.
#include "quant.h"

#if defined(__x86_64__) || defined(_M_X64)

// GCC 12 warns about _mm512_undefined_* inside its own intrinsics headers (false positives)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,fma,f16c,bmi,bmi2,lzcnt,popcnt")

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
inline uint64_t ld64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}
inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

// ============================================================================================ float32 numerics
// Per-group a and b of one LAYOUT_K column (quant.h), exactly as column_params computes them.
inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << count) - 1);
}

inline __m512 load_halves(const uint8_t* p, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
}

// Per-group a and b of one LAYOUT_K column (quant.h), exactly as column_params computes them, 16 groups at a time.
template <int TYPE>
__attribute__((always_inline)) inline void k_params(const TypeInfo& t, const uint8_t* col, const Offsets& o,
                                                    int64_t k, float* a, float* b) {
  const int64_t groups = k / t.group;
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 mask = first_lanes(groups - g);
    __m512 av, bv = _mm512_setzero_ps();
    using T = TypeTraits<TYPE>;
    if constexpr (!T::kScales) {  // one group per unit
      av = load_halves(col + o.d + 2 * g, mask);
      if constexpr (T::kAsym) bv = load_halves(col + o.m + 2 * g, mask);
    } else {
      // the unit (super-block) of each group: the fp16 d (and dmin) of the one or two units these 16 groups lie
      // in (groups start at a unit's first group: K is a multiple of the unit), each spread over its groups' lanes
      // by a permutation (a gather per lane took more time than the tiles that use the parameters)
      constexpr int kPerUnit = T::kUnit / T::kGroup;
      static_assert(kPerUnit == 8 || kPerUnit == 16, "8 or 16 groups per unit");
      const int64_t unit = g / kPerUnit;
      const __mmask16 units = first_lanes((std::min<int64_t>(16, groups - g) + kPerUnit - 1) / kPerUnit);
      const __m512i lane_unit = kPerUnit == 16 ? _mm512_setzero_si512()
                                               : _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
      const __m512 d = _mm512_permutexvar_ps(lane_unit, load_halves(col + o.d + 2 * unit, units));
      const __m128i sc = _mm_maskz_loadu_epi8(mask, col + o.sc + g);
      if constexpr (!T::kAsym) {  // Q6_K: int8 scales
        av = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
      } else {
        const __m512 dmin = _mm512_permutexvar_ps(lane_unit, load_halves(col + o.m + 2 * unit, units));
        av = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
        const __m128i mn = _mm_maskz_loadu_epi8(mask, col + o.mn + g);
        bv = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))));
      }
    }
    _mm512_mask_storeu_ps(a + g, mask, av);
    _mm512_mask_storeu_ps(b + g, mask, bv);
  }
}

inline __m512 iota16() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

// table of the 16 weights of codes u = base .. base + 15: a * (u - o) (symmetric types) or fma(a, u, b)
template <int TYPE>
inline __m512 table(float a, float b, float base) {
  constexpr bool kSymmetric = !TypeTraits<TYPE>::kAsym;
  constexpr float kOffset = static_cast<float>(TypeTraits<TYPE>::kOffset);
  if constexpr (kSymmetric) {
    return _mm512_mul_ps(_mm512_set1_ps(a), _mm512_add_ps(iota16(), _mm512_set1_ps(base - kOffset)));
  } else {
    return _mm512_fmadd_ps(_mm512_set1_ps(a), _mm512_add_ps(iota16(), _mm512_set1_ps(base)), _mm512_set1_ps(b));
  }
}

// The weights of a column, one group of 32 inputs (Q6_K: two groups of 16) at a time, as two 16-input vectors.
// A chunk of codes is a pair of groups (64 inputs, 4 vectors) or a last single group (32 inputs, 2 vectors); its
// nibbles come out of one load (`lanes`: lane j, nibble s is input 16 s + j of the chunk).
template <int TYPE>
struct KDecoder {
  static constexpr int kBits = TypeTraits<TYPE>::kBits;

  const uint8_t* col;
  const Offsets* o;
  const float* a;
  const float* b;

  struct State {
    __m512i lanes;
    __m512 lo, hi;  // tables of the current group (4- and 5-bit codes)
  };

  // the chunk starting at vector v0 (4 p for pair p): S = 4 (pair) or 2 (single)
  template <int S>
  inline void load(int64_t v0, State& st) const {
    if constexpr (kBits != 8) {
      if constexpr (S == 4) {
        st.lanes = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(col + o->codes + 8 * v0)));
      } else {
        st.lanes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(col + o->codes + 8 * v0)));
      }
    }
  }

  // before the vectors of group h (0 or 1) of the chunk at v0
  inline void group(int64_t v0, int h, State& st) const {
    if constexpr (kBits == 4 || kBits == 5) {
      const int64_t g = v0 / 2 + h;
      st.lo = table<TYPE>(a[g], b[g], 0.0f);
      if constexpr (kBits == 5) st.hi = table<TYPE>(a[g], b[g], 16.0f);
    }
  }

  // the weights of vector s of the chunk at v0
  inline __m512 vec(int64_t v0, int s, const State& st) const {
    const int64_t v = v0 + s;
    if constexpr (kBits == 8) {
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(col + o->codes + 16 * v));
      return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), _mm512_set1_ps(a[v / 2]));
    } else if constexpr (kBits == 6) {  // Q6_K: code = nibble + 16 bit4 + 32 bit5, w = a (code - 32)
      __m512i u = _mm512_sub_epi32(_mm512_and_si512(s == 0 ? st.lanes : _mm512_srli_epi32(st.lanes, 4 * s),
                                                    _mm512_set1_epi32(15)),
                                   _mm512_set1_epi32(32));
      u = _mm512_mask_add_epi32(u, ld16(col + o->plane + 2 * v), u, _mm512_set1_epi32(16));
      u = _mm512_mask_add_epi32(u, ld16(col + o->plane2 + 2 * v), u, _mm512_set1_epi32(32));
      return _mm512_mul_ps(_mm512_set1_ps(a[v]), _mm512_cvtepi32_ps(u));
    } else {
      const __m512i idx = s == 0 ? st.lanes : _mm512_srli_epi32(st.lanes, 4 * s);
      __m512 w = _mm512_permutexvar_ps(idx, st.lo);
      if constexpr (kBits == 5) w = _mm512_mask_permutexvar_ps(w, ld16(col + o->plane + 2 * v), idx, st.hi);
      return w;
    }
  }
};

struct Tile {
  const float* x;  // first row of the tile
  int64_t k;       // row stride of x
  float* y;        // y + row0 * n + col0
  int64_t n;       // row stride of y
  const float* bias;  // bias + col0 or nullptr
  // bytes to prefetch while the tile runs (columns kPrefetchAheadBytes ahead; nullptr: none; may point past the
  // weights: prefetches never fault): the kernel streams the weights once per call, faster than the hardware
  // prefetcher follows 4 interleaved columns
  const uint8_t* prefetch = nullptr;
  int64_t prefetch_bytes = 0;
};

// The horizontal sum of each output's 16 lanes, by one fixed tree for every output: lanes (l, l + 8) first, then
// (l, l + 4), (l, l + 2), (l, l + 1) (the order of _mm512_reduce_add_ps). reduce4 runs that tree on 4 outputs at
// once (a transposed reduction, a third of the instructions); both give the same bits, addition being commutative.
inline float reduce1(__m512 v) {
  const __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
  const __m128 t2 = _mm_add_ps(t4, _mm_permute_ps(t4, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ss(t2, _mm_movehdup_ps(t2)));
}

inline __m128 reduce4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));  // (l, l + 8)
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(c, d, _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));  // (l, l + 4)
  const __m512 v = _mm512_add_ps(u, _mm512_permute_ps(u, _MM_SHUFFLE(1, 0, 3, 2)));     // (l, l + 2)
  const __m512 w = _mm512_add_ps(v, _mm512_permute_ps(v, _MM_SHUFFLE(2, 3, 0, 1)));     // (l, l + 1)
  return _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, w));
}

inline void store4(float* y, const float* bias, __m128 sums) {
  _mm_storeu_ps(y, bias ? _mm_add_ps(sums, _mm_loadu_ps(bias)) : sums);
}

template <int R, int C>
__attribute__((always_inline)) inline void store_tile(const Tile& tile, __m512 (&acc)[R][C]) {
  if constexpr (C == 4) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      store4(tile.y + r * tile.n, tile.bias, reduce4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
  } else if constexpr (C == 2 && R % 2 == 0) {
#pragma GCC unroll 16
    for (int r = 0; r < R; r += 2) {
      float sums[4];
      _mm_storeu_ps(sums, reduce4(acc[r][0], acc[r][1], acc[r + 1][0], acc[r + 1][1]));
      for (int i = 0; i < 4; ++i) {
        const int c = i % 2;
        tile.y[(r + i / 2) * tile.n + c] = tile.bias ? sums[i] + tile.bias[c] : sums[i];
      }
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) {
        const float sum = reduce1(acc[r][c]);
        tile.y[r * tile.n + c] = tile.bias ? sum + tile.bias[c] : sum;
      }
  }
}

// Keeps v in a register: the compiler would otherwise fold the same load into each of the C multiply-adds.
inline __m512 in_register(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

// the S vectors of the chunk at vector v0, for every row and column of the tile
template <int TYPE, int R, int C, int S>
__attribute__((always_inline)) inline void k_chunk(const Tile& tile, const KDecoder<TYPE>* dec, int64_t v0, __m512 (&acc)[R][C]) {
  typename KDecoder<TYPE>::State st[C];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) dec[c].template load<S>(v0, st[c]);
#pragma GCC unroll 16
  for (int h = 0; h < S / 2; ++h) {
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) dec[c].group(v0, h, st[c]);
#pragma GCC unroll 16
    for (int s = 2 * h; s < 2 * h + 2; ++s) {
      __m512 w[C];
#pragma GCC unroll 16
      for (int c = 0; c < C; ++c) w[c] = dec[c].vec(v0, s, st[c]);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const __m512 xv = in_register(_mm512_loadu_ps(tile.x + r * tile.k + 16 * (v0 + s)));
#pragma GCC unroll 16
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
      }
    }
  }
}

template <int TYPE, int R, int C>
__attribute__((noinline)) void k_tile_quant(const Tile& tile, const KDecoder<TYPE>* dec) {
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t pairs = tile.k / 64;
  const int64_t lines = tile.prefetch_bytes / 64, per_pair = pairs ? (lines + pairs - 1) / pairs : 0;
  for (int64_t p = 0; p < pairs; ++p) {
    for (int64_t line = p * per_pair; line < (p + 1) * per_pair && line < lines; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(tile.prefetch + 64 * line), _MM_HINT_T1);
    k_chunk<TYPE, R, C, 4>(tile, dec, 4 * p, acc);
  }
  if (tile.k % 64) k_chunk<TYPE, R, C, 2>(tile, dec, 4 * pairs, acc);
  store_tile<R, C>(tile, acc);
}

// float weights (F32 / F16 / BF16): 16 inputs at a time, the last partial vector masked (zeros)
template <int TYPE>
inline __m512 float_weights(const uint8_t* col, int64_t i, __mmask16 mask) {
  if constexpr (TYPE == F32) {
    return _mm512_maskz_loadu_ps(mask, col + 4 * i);
  } else if constexpr (TYPE == F16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, col + 2 * i));
  } else {
    const __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, col + 2 * i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
  }
}

template <int TYPE, int R, int C>
__attribute__((always_inline)) inline void k_float_step(const Tile& tile, const uint8_t* const* cols, int64_t i,
                                                        __mmask16 mask, __m512 (&acc)[R][C]) {
  __m512 w[C];
#pragma GCC unroll 16
  for (int c = 0; c < C; ++c) w[c] = float_weights<TYPE>(cols[c], i, mask);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 xv = in_register(_mm512_maskz_loadu_ps(mask, tile.x + r * tile.k + i));
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, w[c], acc[r][c]);
  }
}

template <int TYPE, int R, int C>
__attribute__((noinline)) void k_tile_float(const Tile& tile, const uint8_t* const* cols) {
  __m512 acc[R][C];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= tile.k; i += 16) k_float_step<TYPE, R, C>(tile, cols, i, 0xFFFF, acc);
  if (i < tile.k) k_float_step<TYPE, R, C>(tile, cols, i, static_cast<__mmask16>((1u << (tile.k - i)) - 1), acc);
  store_tile<R, C>(tile, acc);
}

// Rows per tile: 4 (3 for 5-bit codes, whose decoding holds two tables per column), by C = 4 columns. A tile's
// rows share each decoded weight vector; its x rows (4 x K floats) stay in L1 across the columns of a work chunk.
template <int TYPE>
constexpr int kTileRows = TypeTraits<TYPE>::kBits == 5 ? 3 : 4;

struct Rows {
  template <int R, typename F>
  static void each(const LinearArgs& args, const Tile& base, const F& tile_fn) {
    int64_t r = 0;
    Tile tile = base;
    for (; r + R <= args.m; r += R) {
      tile.x = base.x + r * args.k;
      tile.y = base.y + r * args.n;
      tile_fn(tile, std::integral_constant<int, R>());
    }
    if constexpr (R > 1) {
      if (r < args.m) {
        Tile rest = base;
        rest.x = base.x + r * args.k;
        rest.y = base.y + r * args.n;
        LinearArgs tail = args;
        tail.m = args.m - r;
        each<R - 1>(tail, rest, tile_fn);
      }
    }
  }
};

constexpr int kMaxChunkColumns = 64;
// Columns k_run computes at once out of a wider chunk (at most kMaxChunkColumns): their parameters are decoded
// first, then their tiles run; 32 measured faster than 64 at one row (the parameter pass touches fewer lines ahead
// of the tiles).
constexpr int kStepColumns = 32;

// How far ahead of the columns being computed a call prefetches. A column of a 576-input Q4_1
// weight is 360 bytes and takes about 30 ns at one row: prefetching only the next tile's columns (1.4 KB, about
// one DRAM latency ahead) left a 1536 x 576 weight streaming at 6 GB/s from memory against 13 GB/s with 16 KB
// (and 28 ns per column, what it takes when the weight sits in L3). Measured on the 2-core AMD EPYC, 1 thread:
// 4 KB 9 GB/s, 8 KB 12 GB/s, 16 KB 13 GB/s; and 3 rows took 55 us instead of 124 us.
constexpr int64_t kPrefetchAheadBytes = 16384;

inline Tile at_column(const Tile& tile, int64_t c) {
  Tile shifted = tile;
  shifted.y += c;
  if (shifted.bias) shifted.bias += c;
  return shifted;
}

// Columns [n_begin, n_end) (at most kMaxChunkColumns) for every row: row tiles outside, tiles of 4 columns inside,
// so that a tile's rows of x stay in L1 while the chunk's columns go by.
template <int TYPE>
void k_run(const LinearArgs& args, int64_t n_begin, int64_t n_end, float* scratch) {
  const TypeInfo& t = *args.type;
  const int64_t row_bytes = packed_row_bytes(t, args.k), columns = n_end - n_begin;
  const Tile base{args.x, args.k, args.y + n_begin, args.n, args.bias ? args.bias + n_begin : nullptr};
  const uint8_t* cols[kMaxChunkColumns];
  for (int64_t c = 0; c < columns; ++c) cols[c] = args.payload + (n_begin + c) * row_bytes;
  if constexpr (TypeTraits<TYPE>::kFloat) {
    Rows::each<4>(args, base, [&](const Tile& tile, auto rows) {
      int64_t c = 0;
      for (; c + 4 <= columns; c += 4) k_tile_float<TYPE, rows.value, 4>(at_column(tile, c), cols + c);
      for (; c < columns; ++c) k_tile_float<TYPE, rows.value, 1>(at_column(tile, c), cols + c);
    });
  } else {
    const Offsets o = offsets(t, LAYOUT_K, args.k);
    const int64_t groups = args.k / t.group;
    KDecoder<TYPE> dec[kMaxChunkColumns];
    // a column's parameters are decoded just before its first tile (the first row tile's), when the prefetch of the
    // earlier tiles has brought its bytes in; decoding the whole chunk's first waited on memory for the columns
    // beyond the prefetch distance
    int64_t ready = 0;
    const auto decode_params = [&](int64_t end) {
      for (; ready < end; ++ready) {
        float* a = scratch + 2 * ready * groups;
        k_params<TYPE>(t, cols[ready], o, args.k, a, a + groups);
        dec[ready] = KDecoder<TYPE>{cols[ready], &o, a, a + groups};
      }
    };
    // each tile prefetches its columns' bytes about kPrefetchAheadBytes ahead (past the chunk's end: the next
    // chunk's); with more rows than one tile takes, the later row tiles find the chunk's columns in cache
    const int64_t ahead = std::max<int64_t>(4, (kPrefetchAheadBytes + row_bytes - 1) / row_bytes);  // columns
    // tiles of C columns over the chunk for one row tile, then single columns
    const auto run_columns = [&](const Tile& tile, auto rows, auto width) {
      constexpr int C = decltype(width)::value;
      int64_t c = 0;
      for (; c + C <= columns; c += C) {
        decode_params(c + C);
        Tile at = at_column(tile, c);
        at.prefetch = cols[c] + ahead * row_bytes;
        at.prefetch_bytes = C * row_bytes;
        k_tile_quant<TYPE, decltype(rows)::value, C>(at, dec + c);
      }
      for (; c < columns; ++c) {
        decode_params(c + 1);
        k_tile_quant<TYPE, decltype(rows)::value, 1>(at_column(tile, c), dec + c);
      }
    };
    if (args.m > kTileRows<TYPE>) {  // more rows than one 4-column tile takes: tiles of up to 8 rows by 2 columns
      // decode each weight once for 8 rows (5 to 8 rows: once for all of them, not for a full tile and the rest)
      Rows::each<8>(args, base, [&](const Tile& tile, auto rows) {
        run_columns(tile, rows, std::integral_constant<int, 2>());
      });
    } else {
      Rows::each<kTileRows<TYPE>>(args, base, [&](const Tile& tile, auto rows) {
        run_columns(tile, rows, std::integral_constant<int, 4>());
      });
    }
  }
}

// ============================================================================================ int8 numerics
// a GGUF type's constants (quant.h's table); vpdpbusd multiplies the unsigned codes u, so every symmetric type,
// 8-bit codes included (u = q + 128), takes the integer correction of its offset
template <int TYPE>
using NTraits = TypeTraits<TYPE>;

inline __m512 load_halves16(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// the fp16 numbers of a unit record's 16 columns, the same for all its groups: d, and m (Q4_1, Q5_1) or dmin
// (Q4_K, Q5_K)
struct NUnit {
  __m512 d, m;
};

template <int TYPE>
__attribute__((always_inline)) inline NUnit n_unit(const uint8_t* rec, const Offsets& o) {
  NUnit u{load_halves16(rec + o.d), _mm512_setzero_ps()};
  if constexpr (NTraits<TYPE>::kAsym) u.m = load_halves16(rec + o.m);
  return u;
}

// a (and b) of the 16 columns for group gi of a unit record whose fp16 numbers are u
template <int TYPE>
__attribute__((always_inline)) inline void n_params(const uint8_t* rec, const Offsets& o, const NUnit& u, int gi,
                                                    __m512& a, __m512& b) {
  using T = NTraits<TYPE>;
  if constexpr (T::kScales && T::kAsym) {  // Q4_K, Q5_K: 6-bit scales and mins
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + o.sc + 16 * gi));
    const __m128i mn = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + o.mn + 16 * gi));
    a = _mm512_mul_ps(u.d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sc)));
    b = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(u.m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn))));
  } else if constexpr (T::kScales) {  // Q6_K: int8 scales
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + o.sc + 16 * gi));
    a = _mm512_mul_ps(u.d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)));
  } else {
    a = u.d;
    if constexpr (T::kAsym) b = u.m;
  }
}

// code bytes of the 16 columns for the G inputs of group gi: codes[h] holds inputs 4 h .. 4 h + 3 of the group
template <int TYPE>
__attribute__((always_inline)) inline void n_codes(const uint8_t* rec, const Offsets& o, int gi, __m512i* codes) {
  constexpr int G = NTraits<TYPE>::kGroup;
  constexpr int bits = NTraits<TYPE>::kBits;
  const int h0 = gi * G / 4;  // first 4-input step of the group inside the unit
  if constexpr (bits == 8) {
#pragma GCC unroll 16
    for (int h = 0; h < G / 4; ++h) codes[h] = _mm512_loadu_si512(rec + o.codes + 64 * (h0 + h));
    return;
  }
  const __m512i low = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 16
  for (int t = 0; t < G / 8; ++t) {
    const __m512i v = _mm512_loadu_si512(rec + o.codes + 64 * (h0 / 2 + t));
    codes[2 * t] = _mm512_and_si512(v, low);
    codes[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  if constexpr (bits == 5) {
#pragma GCC unroll 16
    for (int h = 0; h < G / 4; ++h) {
      const __mmask64 m = ld64(rec + o.plane + 8 * (h0 + h));
      codes[h] = _mm512_mask_add_epi8(codes[h], m, codes[h], _mm512_set1_epi8(16));
    }
  }
  // 6-bit codes: step h's bits 4-5 at bits 2 (h % 4) of its high vector, shifted to 4-5 and ORed in. Against two bit
  // planes (a mask load and a masked add per plane and step), Q6_K computes 1.6x as fast at one row and 1.19x at
  // four in the cache (2-core AMD EPYC Zen 4, one thread, 8192x1024; docs/PERFORMANCE.md), the same bits
  if constexpr (bits == 6) {
    static_assert(G % 16 == 0, "a group of 6-bit codes covers whole high vectors");
    const __m512i mask = _mm512_set1_epi8(0x30);
#pragma GCC unroll 16
    for (int q = 0; q < G / 16; ++q) {
      const __m512i hv = _mm512_loadu_si512(rec + o.plane + 64 * (h0 / 4 + q));
      const __m512i at[4] = {_mm512_slli_epi16(hv, 4), _mm512_slli_epi16(hv, 2), hv, _mm512_srli_epi16(hv, 2)};
#pragma GCC unroll 4
      for (int s = 0; s < 4; ++s)  // codes | (at & 0x30): each byte's shifted bits 4-5 are its own (16-bit shifts)
        codes[4 * q + s] = _mm512_ternarylogic_epi32(codes[4 * q + s], at[s], mask, 0xF8);
    }
  }
}

// How a tile streams its weights into L2 ahead of use: each group of a unit record prefetches its share of the
// record kPrefetchUnits units ahead, so that the prefetches flow at the pace of the arithmetic (the types of one
// group per unit prefetch their whole record at once). Q4_K's 1- and 2-row tiles issue none inside a tile: the
// hardware prefetcher alone streams their records fastest. Prefetches may point past the weights: they never fault.
// Measured on a 2-core AMD EPYC Zen 4, 2 threads, 40 random weights of 2048x8192 (more than the L3 cache) called
// in turn, GB/s of weights (the machine read 31-34 GB/s), separate processes interleaved, against the earlier
// prefetch of the whole record at a unit's first group, 4 units ahead:
//   1 row:  Q6_K 25.7-26.4 against 20.4-20.9 (4 or 6 units ahead: 24.4-25.8); Q5_K 28-36 against 20-25; Q4_K
//           without a prefetch 28.7-29.8, spread 28.0-28.8 (and plain decoding of a ~2B Q4_K_M file 23.0-23.5
//           tokens/s without, 20.7-20.8 with the earlier one). The one-group types keep 4 units (Q4_1 at the
//           embedded model's shapes: 20.7-23.3 against 19.5-22.2 GB/s two units ahead; Q8_0 mixed);
//   3 rows: Q6_K 27.3-28.2 against 23.6-25.8, Q4_K 26.0-27.2 against 24.9-26.1; 4 rows: Q6_K 23.3-27.6 against
//           21.8-22.7, Q4_K 24.1-25.4 against 23.2-24.7, Q5_K alike; 8 rows: Q6_K 16.5-17.1 against
//           15.2-16.7. Prefetching into L1 instead (T0) was far slower (Q6_K 4 rows 11.5).
template <int TYPE, int CG>
constexpr int64_t kPrefetchUnits = CG == 4 && TypeTraits<TYPE>::kUnit > TypeTraits<TYPE>::kGroup ? 2 : 4;
template <int TYPE, int CG>
constexpr bool kPrefetches = !(TYPE == Q4_K && CG == 4);

// The record kPrefetchUnits units after unit `unit` of the column group at `group` (`units` records of o.total
// bytes) in a tile of CG groups, or nullptr where that tile issues no prefetch there. Past the group's last unit it
// is the record of the next tile's group (CG groups further on: the groups of a weight lie one after another), so
// that the stream runs on across the tiles of a chunk. Pointing one group further instead (into the same tile's
// next group, which that tile reads already) left each tile of CG > 1 groups to start its streams cold: over
// weights of 2048 inputs (8 units) the 1-row tiles streamed up to 7% slower (2-core AMD EPYC Zen 4, 2 threads, 40
// random weights called in turn, medians of 40 interleaved passes, two runs: 8192x2048 Q4_K 23.8 / 27.5 against
// 25.0 / 28.1 GB/s, Q6_K 24.9 / 25.9 against 26.8 / 27.6; 1-5% at 2048x2048 and 2048x8192; plain decoding of the
// ~2B widened file 4% faster, a 2-row forward 10%). Q4_K's wide tiles (no prefetch inside a tile: the hardware
// prefetcher streams them fastest) prefetch across that boundary only.
template <int TYPE, int CG>
__attribute__((always_inline)) inline const uint8_t* prefetch_target(const uint8_t* group, const Offsets& o,
                                                                     int64_t unit, int64_t units) {
  const int64_t ahead = unit + kPrefetchUnits<TYPE, CG>;
  if (ahead >= units) return group + (ahead + (CG - 1) * units) * o.total;
  return kPrefetches<TYPE, CG> ? group + ahead * o.total : nullptr;
}

// group gi's share of the prefetches of the record at target (o.total bytes; none for nullptr)
template <int TYPE>
__attribute__((always_inline)) inline void prefetch_record(const uint8_t* target, const Offsets& o, int gi) {
  if (target == nullptr) return;
  constexpr int kGroupsPerUnit = TypeTraits<TYPE>::kUnit / TypeTraits<TYPE>::kGroup;
  const int64_t share = (o.total + 64 * kGroupsPerUnit - 1) / (64 * kGroupsPerUnit) * 64;  // whole lines
  const int64_t end = std::min<int64_t>((gi + 1) * share, o.total);
  for (int64_t line = gi * share; line < end; line += 64)
    _mm_prefetch(reinterpret_cast<const char*>(target + line), _MM_HINT_T1);
}

// Rows per 1-group tile: each group's a (and b) and code vectors are decoded once for up to 16 rows. The 16
// accumulators (and, for the asymmetric types, the 16 second accumulators, which the compiler keeps partly in memory:
// loads and stores, not the multiply pipes that bound these tiles) are what a tile holds across the groups.
constexpr int kNTileRows = 16;

// A call's activations rearranged for its row tiles (tiles of kNTileRows rows from row 0, the last one shorter):
// inside a tile of R rows, the values of group g (G inputs) of its row r lie at fixed offsets from one pointer per
// array, so that a tile addresses all its rows from three registers:
//   q     the G int8 values at q + (g R + r) G
//   corr  the symmetric types' integer offset correction, -offset * (sum of the group's q), at corr[g R + r]
//   ds    d and s of 32-input block b at ds[2 (b R + r)] and ds[2 (b R + r) + 1]
// Copies of the quantizer's numbers: the outputs are the same bits as from the rows as the quantizer wrote them.
struct NRows {
  const uint8_t* q;
  const int32_t* corr;
  const float* ds;
};

template <int TYPE>
inline NRows n_tile_rows(const uint8_t* buf, int64_t k, int64_t row0, int64_t rows) {
  const uint8_t* base = buf + row0 * interleaved_row_bytes(k);
  const int64_t groups = k / NTraits<TYPE>::kGroup;
  return {base, reinterpret_cast<const int32_t*>(base + rows * k),
          reinterpret_cast<const float*>(base + rows * k + 4 * rows * groups)};
}

// writes the activations of every row tile of a call (m rows of k inputs) into buf (m interleaved_row_bytes(k) bytes),
// laid out as n_tile_rows reads them (once per call and weight type: ops.cpp, interleave_rows_avx512)
template <int TYPE>
void n_interleave(const QuantizedRows& xq, int64_t m, int64_t k, uint8_t* buf) {
  using T = NTraits<TYPE>;
  constexpr int G = T::kGroup;
  const int64_t groups = k / G, blocks = k / 32;
  for (int64_t row0 = 0; row0 < m; row0 += kNTileRows) {
    const int64_t rows = std::min<int64_t>(kNTileRows, m - row0);
    uint8_t* q = buf + row0 * interleaved_row_bytes(k);
    uint8_t* corr = q + rows * k;
    uint8_t* ds = corr + 4 * rows * groups;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t row = row0 + r;
      const int32_t* s16 = xq.sum16 + row * (k / 16);
      for (int64_t g = 0; g < groups; ++g) {
        std::memcpy(q + (g * rows + r) * G, xq.q + row * k + g * G, G);
        const int32_t xsum = G == 16 ? s16[g] : s16[2 * g] + s16[2 * g + 1];
        const int32_t c = T::kOffset > 0 ? -T::kOffset * xsum : 0;
        std::memcpy(corr + 4 * (g * rows + r), &c, 4);
      }
      for (int64_t blk = 0; blk < blocks; ++blk) {
        std::memcpy(ds + 8 * (blk * rows + r), xq.d + row * blocks + blk, 4);
        std::memcpy(ds + 8 * (blk * rows + r) + 4, xq.s + row * blocks + blk, 4);
      }
    }
  }
}

// The exact integer sum of row r's G products with the 16 columns' codes of group g (the symmetric types' offset
// correction included; integer sums are exact, so their order is free): two chains of vpdpbusd, then their sum.
template <int TYPE, int R>
__attribute__((always_inline)) inline __m512i n_isum(const NRows& x, int64_t g, int r, const __m512i* codes) {
  using T = NTraits<TYPE>;
  constexpr int G = T::kGroup;
  const uint8_t* q = x.q + (g * R + r) * G;
  __m512i isum0 = _mm512_setzero_si512(), isum1 = _mm512_setzero_si512();
  if constexpr (T::kOffset > 0) isum0 = _mm512_set1_epi32(x.corr[g * R + r]);
#pragma GCC unroll 16
  for (int h = 0; h < G / 4; h += 2) {
    isum0 = _mm512_dpbusd_epi32(isum0, codes[h], _mm512_set1_epi32(static_cast<int>(ld32(q + 4 * h))));
    isum1 = _mm512_dpbusd_epi32(isum1, codes[h + 1], _mm512_set1_epi32(static_cast<int>(ld32(q + 4 * h + 4))));
  }
  return _mm512_add_epi32(isum0, isum1);
}

// One group g of one 16-column group for the tile's R rows: acc = fma(float(isum), a * dx, acc) and, for the
// asymmetric types, accb = fma(b, sx, accb).
template <int TYPE, int R>
__attribute__((always_inline)) inline void n_group(const NRows& x, int64_t g, const __m512i* codes, __m512 a,
                                                   __m512 b, __m512 (&acc)[R], __m512 (&accb)[R]) {
  const float* ds = x.ds + 2 * R * (g * NTraits<TYPE>::kGroup / 32);
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512i isum = n_isum<TYPE, R>(x, g, r, codes);
    const __m512 s = _mm512_mul_ps(a, _mm512_set1_ps(ds[2 * r]));
    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), s, acc[r]);
    if constexpr (NTraits<TYPE>::kAsym) accb[r] = _mm512_fmadd_ps(b, _mm512_set1_ps(ds[2 * r + 1]), accb[r]);
  }
}

// y of a tile: acc (+ accb for the asymmetric types) (+ the bias), the padding columns left out
template <int TYPE, int R, int CG>
__attribute__((always_inline)) inline void n_store(const LinearArgs& args, int64_t row0, int64_t n0,
                                                   const __m512 (&acc)[CG][R], const __m512 (&accb)[CG][R]) {
#pragma GCC unroll 16
  for (int c = 0; c < CG; ++c) {
    const int64_t col = n0 + 16 * c;
    const int64_t live = args.n - col < 16 ? args.n - col : 16;
    const __mmask16 mask = live >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << live) - 1);
    const __m512 bias = args.bias ? _mm512_maskz_loadu_ps(mask, args.bias + col) : _mm512_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      __m512 out = NTraits<TYPE>::kAsym ? _mm512_add_ps(acc[c][r], accb[c][r]) : acc[c][r];
      if (args.bias) out = _mm512_add_ps(out, bias);
      _mm512_mask_storeu_ps(args.y + (row0 + r) * args.n + col, mask, out);
    }
  }
}

// R rows by CG groups of 16 columns: per group, its a (and b) and code vectors are decoded once and applied to the R
// rows (the unit's fp16 numbers, n_unit, do not change within a unit: the compiler converts them once per unit). Each
// column group's prefetches (prefetch_record) are issued just before that group's work (issuing the CG groups'
// prefetches together first streamed 8-bit codes at one row 20-25% slower).
template <int TYPE, int R, int CG>
__attribute__((noinline)) void n_tile(const LinearArgs& args, const NRows& x, const uint8_t* const* groups,
                                      int64_t row0, int64_t n0) {
  using T = NTraits<TYPE>;
  constexpr int G = T::kGroup;
  const int64_t k = args.k;
  const Offsets o = offsets(*args.type, LAYOUT_N, k);
  __m512 acc[CG][R], accb[CG][R];
#pragma GCC unroll 16
  for (int c = 0; c < CG; ++c)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) acc[c][r] = accb[c][r] = _mm512_setzero_ps();
  const int64_t units = k / T::kUnit;
  for (int64_t unit = 0; unit < units; ++unit) {
    for (int gi = 0; gi < T::kUnit / G; ++gi) {
#pragma GCC unroll 16
      for (int c = 0; c < CG; ++c) {
        const uint8_t* rec = groups[c] + unit * o.total;
        prefetch_record<TYPE>(prefetch_target<TYPE, CG>(groups[c], o, unit, units), o, gi);
        __m512 a, b = _mm512_setzero_ps();
        n_params<TYPE>(rec, o, n_unit<TYPE>(rec, o), gi, a, b);
        __m512i codes[G / 4];
        n_codes<TYPE>(rec, o, gi, codes);
        n_group<TYPE, R>(x, unit * (T::kUnit / G) + gi, codes, a, b, acc[c], accb[c]);
      }
    }
  }
  n_store<TYPE, R, CG>(args, row0, n0, acc, accb);
}

// the tile of the `rows` (1..R) rows from row0 (a tile's first row) by CG 16-column groups
template <int TYPE, int R, int CG>
void n_rows(const LinearArgs& args, const uint8_t* xbuf, const uint8_t* const* groups, int64_t row0, int64_t rows,
            int64_t n0) {
  if constexpr (R > 1) {
    if (rows < R) return n_rows<TYPE, R - 1, CG>(args, xbuf, groups, row0, rows, n0);
  }
  n_tile<TYPE, R, CG>(args, n_tile_rows<TYPE>(xbuf, args.k, row0, R), groups, row0, n0);
}

template <int TYPE, int CG>
void n_columns(const LinearArgs& args, const uint8_t* xbuf, int64_t n0) {
  const int64_t group_bytes = kColumnsPerGroup * packed_row_bytes(*args.type, args.k);
  const uint8_t* groups[CG];
  for (int c = 0; c < CG; ++c) groups[c] = args.payload + (n0 / kColumnsPerGroup + c) * group_bytes;
  if constexpr (CG == 1) {  // tiles of kNTileRows rows, then one tile of the rest: each weight decoded once per tile
    constexpr int R = kNTileRows;
    for (int64_t r = 0; r < args.m; r += R)
      n_rows<TYPE, R, 1>(args, xbuf, groups, r, std::min<int64_t>(R, args.m - r), n0);
  } else {  // one tile of all the rows: 1 or 2 (CG = 4), 3 or 4 (CG = 2)
    n_rows<TYPE, CG == 4 ? 2 : 4, CG>(args, xbuf, groups, 0, args.m, n0);
  }
}

// Columns [n_begin, n_end) for every row: tiles of 4 groups of 16 columns for 1 or 2 rows (the weights stream; more
// independent work in flight), 2 groups for 3 or 4 rows of 8-bit codes (twice the bytes per multiply-add of the
// others: streaming bounds them), else 1 group with tiles of kNTileRows rows and one of the rest (a tile's rows share
// each decoded code vector; at 3 and 4 rows of the other types, 2-group tiles ran slower: their accumulators,
// parameters and codes overflowed the registers); a chunk's columns beyond its last wide tile run in 1-group tiles
// (the same bits: the tile shape never changes what an output computes).
template <int TYPE>
void n_run(const LinearArgs& args, int64_t n_begin, int64_t n_end) {
  const uint8_t* xbuf = args.xn;  // the rows interleaved for the tiles (NRows), once per call by ops.cpp
  int64_t n = n_begin;
  if (args.m <= 2) {
    for (; n + 64 <= n_end; n += 64) n_columns<TYPE, 4>(args, xbuf, n);
  } else if (NTraits<TYPE>::kBits == 8 && args.m <= 4) {
    for (; n + 32 <= n_end; n += 32) n_columns<TYPE, 2>(args, xbuf, n);
  }
  for (; n < n_end; n += 16) n_columns<TYPE, 1>(args, xbuf, n);
}

}  // namespace

bool linear_k_avx512(const LinearArgs& args, int64_t n_begin, int64_t n_end, float* scratch) {
  if (n_end - n_begin > kStepColumns) {  // a wide chunk (ops.cpp): runs of kStepColumns, in order
    for (int64_t n = n_begin; n < n_end; n += kStepColumns)
      if (!linear_k_avx512(args, n, n + kStepColumns < n_end ? n + kStepColumns : n_end, scratch)) return false;
    return true;
  }
  return with_any_type(args.type->type, [&](auto type) { k_run<decltype(type)::value>(args, n_begin, n_end, scratch); });
}

bool linear_n_avx512(const LinearArgs& args, int64_t n_begin, int64_t n_end, float*) {
  if (args.xn == nullptr) return false;  // the caller interleaves the rows (interleave_rows_avx512)
  return with_quant_type(args.type->type, [&](auto type) { n_run<decltype(type)::value>(args, n_begin, n_end); });
}

bool interleave_rows_avx512(const TypeInfo& t, const QuantizedRows& xq, uint8_t* out) {
  return with_quant_type(t.type, [&](auto type) { n_interleave<decltype(type)::value>(xq, xq.rows, xq.k, out); });
}

void quantize_rows_avx512(const float* x, int64_t row_begin, int64_t row_end, QuantizedRows& out) {
  const int64_t k = out.k, blocks = k / 32;
  const __m512 lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const float* v = x + r * k + 32 * blk;
      const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16);
      // max(|v|, acc) takes acc where |v| is NaN: NaNs count as 0, as std::fmax does in the portable quantizer
      __m512 amax = _mm512_max_ps(_mm512_abs_ps(v0), _mm512_setzero_ps());
      amax = _mm512_max_ps(_mm512_abs_ps(v1), amax);
      const float m = _mm512_reduce_max_ps(amax);
      const float d = m / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      const __m512 scale = _mm512_set1_ps(id);
      // max(NaN, -127) = -127 and min(., 127): the clamp of the portable quantizer
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v0, scale), lo), hi));
      const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v1, scale), lo), hi));
      int8_t* q = out.q + r * k + 32 * blk;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(q0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(q1));
      const int32_t s0 = _mm512_reduce_add_epi32(q0), s1 = _mm512_reduce_add_epi32(q1);
      out.d[r * blocks + blk] = d;
      out.s[r * blocks + blk] = d * static_cast<float>(s0 + s1);
      out.sum16[r * (k / 16) + 2 * blk] = s0;
      out.sum16[r * (k / 16) + 2 * blk + 1] = s1;
    }
  }
}

}  // namespace eagle::quant

#pragma GCC pop_options

#else  // not x86-64: never called (ops.cpp picks the portable kernels)

namespace eagle::quant {
bool linear_k_avx512(const LinearArgs&, int64_t, int64_t, float*) { return false; }
bool linear_n_avx512(const LinearArgs&, int64_t, int64_t, float*) { return false; }
bool interleave_rows_avx512(const TypeInfo&, const QuantizedRows&, uint8_t*) { return false; }
void quantize_rows_avx512(const float* x, int64_t row_begin, int64_t row_end, QuantizedRows& out) {
  quantize_rows_portable(x, row_begin, row_end, out);
}
}  // namespace eagle::quant

#endif
