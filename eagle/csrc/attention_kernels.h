// The three steps of one query's attention over its visible keys, once per instruction set:
//
//   scores   s_i = scale * q . k_{idx_i}   (then cap * tanh(s_i / cap) with soft-capping), i = 0..n-1
//   weights  m = max(s_0.., s_{n-1}, sink); p_i = exp(s_i - m); l = sum_i p_i (+ exp(sink - m))
//   values   o = (sum_i p_i v_{idx_i}) / l
//
// Every path follows one lane structure (attention_math.h), so the three paths give identical bits:
//   - the dot product keeps 16 partial sums (lane l takes d = l, l + 16, ..., zero beyond D), one FMA each in
//     increasing d, reduced by tree16;
//   - the sum of the p_i keeps 16 partial sums (lane l takes i = l, l + 16, ... in increasing i), reduced by tree16;
//   - each output element accumulates p_i v_{idx_i}[d] by one FMA per visible key in increasing i.
// What a query computes thus depends on its q row, its list of visible keys and their rows only: never on the other
// queries of the call, on the masked slots between its keys, on which lanes of a vector it landed in, or on threads.
// Where an implementation differs (AVX-512 scores a key block shared by many queries from a transposed copy), it
// performs the same operations on the same operands in the same order.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "attention_math.h"

namespace eagle {
namespace attention_kernels {

// Where one (batch row, key/value head)'s keys or values lie: row `slot` starts at base + slot * stride.
struct Rows {
  const float* base;
  int64_t stride;
  const float* row(int32_t slot) const { return base + static_cast<int64_t>(slot) * stride; }
};

struct ScoreParams {
  int64_t head_dim;  // D
  float scale;
  bool has_softcap;
  float softcap;
};

// One query of a chunk: its heads' q rows (head h at q + h * q_stride), its visible keys, where its scores go (head
// h's at s + h * s_stride).
struct QueryJob {
  const float* q;
  const int32_t* idx;
  int64_t n;
  float* s;         // scores, then weights
  int64_t s_stride;
  float* l;         // (heads,) softmax denominators
  float* out;       // head h's output row at out + h * value_dim
};

constexpr int kMaxJobs = 16;  // queries per chunk at most

// Up to this many query heads of a group accumulate their weighted values from one load of each value row.
constexpr int kHeadsPerPass = 4;

namespace scalar {

// s[h * s_stride + i] for heads h < heads, whose q rows are q + h * q_stride.
inline void scores(const float* q, int64_t q_stride, int heads, Rows keys, const int32_t* idx, int64_t n,
                   const ScoreParams& p, float* s, int64_t s_stride) {
  namespace m = attention_math;
  const int64_t chunks = (p.head_dim + m::kLanes - 1) / m::kLanes;
  for (int64_t i = 0; i < n; ++i) {
    const float* k = keys.row(idx[i]);
    for (int h = 0; h < heads; ++h) {
      const float* qh = q + h * q_stride;
      float acc[m::kLanes] = {};
      for (int64_t c = 0; c < chunks; ++c) {
        for (int l = 0; l < m::kLanes; ++l) {
          const int64_t d = c * m::kLanes + l;
          const float qd = d < p.head_dim ? qh[d] : 0.0f;
          const float kd = d < p.head_dim ? k[d] : 0.0f;
          acc[l] = std::fma(qd, kd, acc[l]);
        }
      }
      const float score = m::scalar::tree16(acc) * p.scale;
      s[h * s_stride + i] = p.has_softcap ? m::scalar::softcap(score, p.softcap) : score;
    }
  }
}

inline void scores(const QueryJob* jobs, int count, int heads, int64_t q_stride, Rows keys, const ScoreParams& p) {
  for (int j = 0; j < count; ++j)
    scores(jobs[j].q, q_stride, heads, keys, jobs[j].idx, jobs[j].n, p, jobs[j].s, jobs[j].s_stride);
}

// Turns s[0..n) (n >= 1) into p_i = exp(s_i - m) in place; returns l.
inline float weights(float* s, int64_t n, const float* sink) {
  namespace m = attention_math;
  float mx = s[0];
  for (int64_t i = 1; i < n; ++i) mx = m::scalar::max_like_simd(mx, s[i]);
  if (sink) mx = m::scalar::max_like_simd(mx, *sink);
  float acc[m::kLanes] = {};
  for (int64_t i = 0; i < n; ++i) {
    s[i] = m::scalar::exp(s[i] - mx);
    acc[i % m::kLanes] = acc[i % m::kLanes] + s[i];
  }
  float l = m::scalar::tree16(acc);
  if (sink) l = l + m::scalar::exp(*sink - mx);
  return l;
}

// out[h][d] = (sum_i p[h][i] v_{idx_i}[d]) / l[h] for `heads` heads; p[h] = p + h * p_stride.
inline void values(const float* p, int64_t p_stride, int heads, const float* l, Rows vals, const int32_t* idx,
                   int64_t n, int64_t value_dim, float* out, int64_t out_stride) {
  std::vector<float> acc(static_cast<size_t>(heads) * value_dim, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* v = vals.row(idx[i]);
    for (int h = 0; h < heads; ++h) {
      const float w = p[h * p_stride + i];
      float* a = acc.data() + h * value_dim;
      for (int64_t d = 0; d < value_dim; ++d) a[d] = std::fma(w, v[d], a[d]);
    }
  }
  for (int h = 0; h < heads; ++h)
    for (int64_t d = 0; d < value_dim; ++d) out[h * out_stride + d] = acc[h * value_dim + d] / l[h];
}

inline void values(const QueryJob* jobs, int count, int heads, Rows vals, int64_t value_dim) {
  for (int j = 0; j < count; ++j)
    values(jobs[j].s, jobs[j].s_stride, heads, jobs[j].l, vals, jobs[j].idx, jobs[j].n, value_dim, jobs[j].out,
           value_dim);
}

}  // namespace scalar

#ifdef EAGLE_ATTENTION_X86
namespace avx512 {

// Scores come 16 visible keys (a block) at a time. A partial last block repeats its last key and keeps only the
// real scores. Two ways compute a block's scores, with identical bits (the same FMAs per lane, the same tree16):
//   - "horizontal": per (query, head), 16 accumulators (one per key, lanes l = d mod 16), reduced by
//     tree16_transposed: best for few query heads on a block;
//   - "transposed": the block's rows transposed once (lanes = keys), then per (query, head) 16 accumulators (one per
//     l) and tree16 as vertical adds: no shuffles per head, best when many query heads share the block (the queries
//     of a verification tree share the committed prefix).
// CH > 0: head_dim is 16 CH (full vectors); CH == 0: any head_dim (the last chunk masked, zeros beyond head_dim).

template <int CH>
EAGLE_TARGET_AVX512 inline __m512 finish_block(__m512 sums, const ScoreParams& p) {
  __m512 block = _mm512_mul_ps(sums, _mm512_set1_ps(p.scale));
  return p.has_softcap ? attention_math::avx512::softcap(block, p.softcap) : block;
}

template <int CH>
EAGLE_TARGET_AVX512 inline void block_horizontal(const float* q, int64_t q_stride, int heads,
                                                 const float* const* rows, const ScoreParams& p, float* s,
                                                 int64_t s_stride, __mmask16 store) {
  namespace m = attention_math;
  const int64_t chunks = CH ? CH : (p.head_dim + 15) / 16;
  const __mmask16 tail = CH ? static_cast<__mmask16>(0xFFFF) : m::avx512::first_lanes(p.head_dim - (chunks - 1) * 16);
  for (int h = 0; h < heads; ++h) {
    const float* qh = q + h * q_stride;
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; ++c) {
      if (CH) {
        const __m512 qc = _mm512_loadu_ps(qh + c * 16);
        for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(qc, _mm512_loadu_ps(rows[j] + c * 16), acc[j]);
      } else {
        const __mmask16 lanes = c == chunks - 1 ? tail : static_cast<__mmask16>(0xFFFF);
        const __m512 qc = _mm512_maskz_loadu_ps(lanes, qh + c * 16);
        for (int j = 0; j < 16; ++j)
          acc[j] = _mm512_fmadd_ps(qc, _mm512_maskz_loadu_ps(lanes, rows[j] + c * 16), acc[j]);
      }
    }
    _mm512_mask_storeu_ps(s + h * s_stride, store, finish_block<CH>(m::avx512::tree16_transposed(acc), p));
  }
}

// r[j] = 16 floats of key j  ->  r[l] = element l of the 16 keys (lane j = key j).
EAGLE_TARGET_AVX512 inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int j = 0; j < 8; ++j) {
    t[2 * j] = _mm512_unpacklo_ps(r[2 * j], r[2 * j + 1]);
    t[2 * j + 1] = _mm512_unpackhi_ps(r[2 * j], r[2 * j + 1]);
  }
  for (int j = 0; j < 4; ++j) {
    r[4 * j + 0] = _mm512_shuffle_ps(t[4 * j + 0], t[4 * j + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * j + 1] = _mm512_shuffle_ps(t[4 * j + 0], t[4 * j + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * j + 2] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * j + 3] = _mm512_shuffle_ps(t[4 * j + 1], t[4 * j + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int j = 0; j < 4; ++j) {
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xDD);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xDD);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xDD);
  }
}

// kt[16 c + l] = element 16 c + l of the block's 16 keys (zero beyond head_dim).
template <int CH>
EAGLE_TARGET_AVX512 inline void transpose_block(const float* const* rows, const ScoreParams& p, __m512* kt) {
  namespace m = attention_math;
  const int64_t chunks = CH ? CH : (p.head_dim + 15) / 16;
  for (int64_t c = 0; c < chunks; ++c) {
    const __mmask16 lanes = CH ? static_cast<__mmask16>(0xFFFF) : m::avx512::first_lanes(p.head_dim - c * 16);
    __m512* r = kt + c * 16;
    for (int j = 0; j < 16; ++j) r[j] = _mm512_maskz_loadu_ps(lanes, rows[j] + c * 16);
    transpose16(r);
  }
}

template <int CH>
EAGLE_TARGET_AVX512 inline void block_transposed(const float* q, const __m512* kt, const ScoreParams& p, float* s,
                                                 __mmask16 store) {
  const int64_t chunks = CH ? CH : (p.head_dim + 15) / 16;
  __m512 x[16];
  for (int l = 0; l < 16; ++l) x[l] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    for (int l = 0; l < 16; ++l) {
      const int64_t d = c * 16 + l;
      const float qd = (CH || d < p.head_dim) ? q[d] : 0.0f;
      x[l] = _mm512_fmadd_ps(_mm512_set1_ps(qd), kt[d], x[l]);
    }
  }
  for (int l = 0; l < 8; ++l) x[l] = _mm512_add_ps(x[l], x[l + 8]);  // tree16, every key at once
  for (int l = 0; l < 4; ++l) x[l] = _mm512_add_ps(x[l], x[l + 4]);
  const __m512 w0 = _mm512_add_ps(x[0], x[2]), w1 = _mm512_add_ps(x[1], x[3]);
  _mm512_mask_storeu_ps(s, store, finish_block<CH>(_mm512_add_ps(w0, w1), p));
}

// At least this many (query, head) pairs on one block make transposing it worth it.
constexpr int kTransposeMin = 6;

// Block i0 of every job: the jobs whose block holds the same keys as the first one's share one transposed copy (or
// its L1-resident rows); the others get their own rows.
template <int CH>
EAGLE_TARGET_AVX512 void scores_block(const QueryJob* jobs, int count, int heads, int64_t q_stride, Rows keys,
                                      const ScoreParams& p, int64_t i0, __m512* kt) {
  namespace m = attention_math;
  bool done[kMaxJobs] = {};
  for (int lead = 0; lead < count; ++lead) {
    if (done[lead] || jobs[lead].n <= i0) continue;
    const QueryJob& L = jobs[lead];
    const int64_t valid = std::min<int64_t>(16, L.n - i0);
    int members[kMaxJobs], size = 0;
    for (int j = lead; j < count; ++j) {
      if (done[j] || std::min<int64_t>(16, jobs[j].n - i0) != valid) continue;
      if (j != lead && std::memcmp(jobs[j].idx + i0, L.idx + i0, valid * sizeof(int32_t)) != 0) continue;
      members[size++] = j;
      done[j] = true;
    }
    const float* rows[16];
    for (int j = 0; j < 16; ++j) rows[j] = keys.row(L.idx[i0 + std::min<int64_t>(j, valid - 1)]);
    const __mmask16 store = m::avx512::first_lanes(valid);
    if (size * heads >= kTransposeMin) {
      transpose_block<CH>(rows, p, kt);
      for (int u = 0; u < size; ++u)
        for (int h = 0; h < heads; ++h)
          block_transposed<CH>(jobs[members[u]].q + h * q_stride, kt, p,
                               jobs[members[u]].s + h * jobs[members[u]].s_stride + i0, store);
    } else {
      for (int u = 0; u < size; ++u)
        block_horizontal<CH>(jobs[members[u]].q, q_stride, heads, rows, p, jobs[members[u]].s + i0,
                             jobs[members[u]].s_stride, store);
    }
  }
}

template <int CH>
EAGLE_TARGET_AVX512 void scores_jobs(const QueryJob* jobs, int count, int heads, int64_t q_stride, Rows keys,
                                     const ScoreParams& p) {
  int64_t longest = 0;
  for (int j = 0; j < count; ++j) longest = std::max(longest, jobs[j].n);
  // room for the transposed block, 64-byte aligned by hand (std::vector does not align __m512 everywhere)
  thread_local std::vector<float> buffer;
  buffer.resize(static_cast<size_t>((p.head_dim + 15) / 16 * 256 + 16));
  const uintptr_t address = reinterpret_cast<uintptr_t>(buffer.data());
  __m512* kt = reinterpret_cast<__m512*>((address + 63) & ~static_cast<uintptr_t>(63));
  for (int64_t i0 = 0; i0 < longest; i0 += 16) scores_block<CH>(jobs, count, heads, q_stride, keys, p, i0, kt);
}

// The scores of up to kMaxJobs queries of one key/value head (their `heads` query heads each).
EAGLE_TARGET_AVX512 inline void scores(const QueryJob* jobs, int count, int heads, int64_t q_stride, Rows keys,
                                       const ScoreParams& p) {
  switch (p.head_dim) {
    case 64: scores_jobs<4>(jobs, count, heads, q_stride, keys, p); break;
    case 128: scores_jobs<8>(jobs, count, heads, q_stride, keys, p); break;
    case 256: scores_jobs<16>(jobs, count, heads, q_stride, keys, p); break;
    default: scores_jobs<0>(jobs, count, heads, q_stride, keys, p); break;
  }
}

EAGLE_TARGET_AVX512 inline float weights(float* s, int64_t n, const float* sink) {
  namespace m = attention_math;
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const __mmask16 lanes = m::avx512::first_lanes(n - i0);
    mx = _mm512_mask_max_ps(mx, lanes, mx, _mm512_maskz_loadu_ps(lanes, s + i0));
  }
  float top = _mm512_reduce_max_ps(mx);
  if (sink) top = m::scalar::max_like_simd(top, *sink);
  const __m512 top_v = _mm512_set1_ps(top);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const __mmask16 lanes = m::avx512::first_lanes(n - i0);
    const __m512 e = m::avx512::exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, s + i0), top_v));
    _mm512_mask_storeu_ps(s + i0, lanes, e);
    acc = _mm512_mask_add_ps(acc, lanes, acc, e);
  }
  float l = m::avx512::tree16(acc);
  if (sink) l = l + m::scalar::exp(*sink - top);
  return l;
}

// NH heads (<= kHeadsPerPass) over output elements [0, width) of a tile of NV vectors (width > 16 (NV - 1)).
// FULL: width == 16 NV (plain loads; the compiler keeps the sums in registers), else the last vector is masked.
template <int NH, int NV, bool FULL>
EAGLE_TARGET_AVX512 inline void values_tile(const float* p, int64_t p_stride, const float* l, Rows vals,
                                            const int32_t* idx, int64_t n, int64_t width, float* out,
                                            int64_t out_stride) {
  namespace m = attention_math;
  __mmask16 lanes[NV];
  for (int c = 0; c < NV; ++c)
    lanes[c] = FULL ? static_cast<__mmask16>(0xFFFF) : m::avx512::first_lanes(width - 16 * c);
  __m512 acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NV; ++c) acc[h][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const float* v = vals.row(idx[i]);
    __m512 x[NV];
    for (int c = 0; c < NV; ++c)
      x[c] = FULL ? _mm512_loadu_ps(v + 16 * c) : _mm512_maskz_loadu_ps(lanes[c], v + 16 * c);
    for (int h = 0; h < NH; ++h) {
      const __m512 w = _mm512_set1_ps(p[h * p_stride + i]);
      for (int c = 0; c < NV; ++c) acc[h][c] = _mm512_fmadd_ps(w, x[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m512 denom = _mm512_set1_ps(l[h]);
    for (int c = 0; c < NV; ++c)
      _mm512_mask_storeu_ps(out + h * out_stride + 16 * c, lanes[c], _mm512_div_ps(acc[h][c], denom));
  }
}

template <int NH>
EAGLE_TARGET_AVX512 inline void values_heads(const float* p, int64_t p_stride, const float* l, Rows vals,
                                             const int32_t* idx, int64_t n, int64_t width, float* out,
                                             int64_t out_stride) {
  if (width == 64) return values_tile<NH, 4, true>(p, p_stride, l, vals, idx, n, width, out, out_stride);
  if (width == 32) return values_tile<NH, 2, true>(p, p_stride, l, vals, idx, n, width, out, out_stride);
  switch ((width + 15) / 16) {
    case 1: values_tile<NH, 1, false>(p, p_stride, l, vals, idx, n, width, out, out_stride); break;
    case 2: values_tile<NH, 2, false>(p, p_stride, l, vals, idx, n, width, out, out_stride); break;
    case 3: values_tile<NH, 3, false>(p, p_stride, l, vals, idx, n, width, out, out_stride); break;
    default: values_tile<NH, 4, false>(p, p_stride, l, vals, idx, n, width, out, out_stride); break;
  }
}

EAGLE_TARGET_AVX512 inline void values(const float* p, int64_t p_stride, int heads, const float* l, Rows vals,
                                       const int32_t* idx, int64_t n, int64_t value_dim, float* out,
                                       int64_t out_stride) {
  for (int64_t d0 = 0; d0 < value_dim; d0 += 64) {
    const int64_t width = std::min<int64_t>(64, value_dim - d0);
    const Rows tile{vals.base + d0, vals.stride};
    for (int h0 = 0; h0 < heads; h0 += kHeadsPerPass) {
      const float* ph = p + h0 * p_stride;
      float* oh = out + h0 * out_stride + d0;
      switch (std::min(kHeadsPerPass, heads - h0)) {
        case 1: values_heads<1>(ph, p_stride, l + h0, tile, idx, n, width, oh, out_stride); break;
        case 2: values_heads<2>(ph, p_stride, l + h0, tile, idx, n, width, oh, out_stride); break;
        case 3: values_heads<3>(ph, p_stride, l + h0, tile, idx, n, width, oh, out_stride); break;
        default: values_heads<4>(ph, p_stride, l + h0, tile, idx, n, width, oh, out_stride); break;
      }
    }
  }
}

EAGLE_TARGET_AVX512 inline void values(const QueryJob* jobs, int count, int heads, Rows vals,
                                       int64_t value_dim) {
  for (int j = 0; j < count; ++j)
    values(jobs[j].s, jobs[j].s_stride, heads, jobs[j].l, vals, jobs[j].idx, jobs[j].n, value_dim, jobs[j].out,
           value_dim);
}

}  // namespace avx512

namespace avx2 {

// Step-1 sums (lanes l and l + 8 added) of 4 keys' dot products with q.
EAGLE_TARGET_AVX2 inline void dot4(const float* q, const float* const* rows, const ScoreParams& p, __m256* y) {
  namespace m = attention_math;
  const int64_t chunks = (p.head_dim + 15) / 16;
  const int64_t tail = p.head_dim - (chunks - 1) * 16;
  __m256 lo[4], hi[4];
  for (int j = 0; j < 4; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t valid = c == chunks - 1 ? tail : 16;
    const __m256i mlo = m::avx2::first_lanes(valid), mhi = m::avx2::first_lanes(valid - 8);
    const __m256 qlo = _mm256_maskload_ps(q + c * 16, mlo), qhi = _mm256_maskload_ps(q + c * 16 + 8, mhi);
    for (int j = 0; j < 4; ++j) {
      lo[j] = _mm256_fmadd_ps(qlo, _mm256_maskload_ps(rows[j] + c * 16, mlo), lo[j]);
      hi[j] = _mm256_fmadd_ps(qhi, _mm256_maskload_ps(rows[j] + c * 16 + 8, mhi), hi[j]);
    }
  }
  for (int j = 0; j < 4; ++j) y[j] = _mm256_add_ps(lo[j], hi[j]);
}

// 8 visible keys at a time, every head on one block while its key rows are in L1 (a partial last block repeats
// its last key and keeps only the real scores).
EAGLE_TARGET_AVX2 inline void scores(const float* q, int64_t q_stride, int heads, Rows keys, const int32_t* idx,
                                     int64_t n, const ScoreParams& p, float* s, int64_t s_stride) {
  namespace m = attention_math;
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const float* rows[8];
    for (int j = 0; j < 8; ++j) rows[j] = keys.row(idx[std::min<int64_t>(i0 + j, n - 1)]);
    const __m256i store = m::avx2::first_lanes(n - i0);
    for (int h = 0; h < heads; ++h) {
      const float* qh = q + h * q_stride;
      __m256 y[4];
      dot4(qh, rows, p, y);
      const __m256 w_a = m::avx2::tree16_steps23(y);
      dot4(qh, rows + 4, p, y);
      const __m256 w_b = m::avx2::tree16_steps23(y);
      __m256 block = _mm256_mul_ps(m::avx2::tree16_step4(w_a, w_b), _mm256_set1_ps(p.scale));
      if (p.has_softcap) block = m::avx2::softcap(block, p.softcap);
      _mm256_maskstore_ps(s + h * s_stride + i0, store, block);
    }
  }
}

EAGLE_TARGET_AVX2 inline void scores(const QueryJob* jobs, int count, int heads, int64_t q_stride, Rows keys,
                                     const ScoreParams& p) {
  for (int j = 0; j < count; ++j)
    scores(jobs[j].q, q_stride, heads, keys, jobs[j].idx, jobs[j].n, p, jobs[j].s, jobs[j].s_stride);
}

EAGLE_TARGET_AVX2 inline float weights(float* s, int64_t n, const float* sink) {
  namespace m = attention_math;
  __m256 mx = _mm256_set1_ps(-INFINITY);
  for (int64_t i0 = 0; i0 < n; i0 += 8) {
    const __m256i lanes = m::avx2::first_lanes(n - i0);
    const __m256 x = _mm256_blendv_ps(mx, _mm256_maskload_ps(s + i0, lanes), _mm256_castsi256_ps(lanes));
    mx = _mm256_max_ps(mx, x);
  }
  alignas(32) float lanes_max[8];
  _mm256_store_ps(lanes_max, mx);
  float top = lanes_max[0];
  for (int j = 1; j < 8; ++j) top = m::scalar::max_like_simd(top, lanes_max[j]);
  if (sink) top = m::scalar::max_like_simd(top, *sink);
  const __m256 top_v = _mm256_set1_ps(top);
  __m256 acc_lo = _mm256_setzero_ps(), acc_hi = _mm256_setzero_ps();
  for (int64_t i0 = 0; i0 < n; i0 += 16) {
    const __m256i mlo = m::avx2::first_lanes(n - i0), mhi = m::avx2::first_lanes(n - i0 - 8);
    const __m256 elo = m::avx2::exp(_mm256_sub_ps(_mm256_maskload_ps(s + i0, mlo), top_v));
    const __m256 ehi = m::avx2::exp(_mm256_sub_ps(_mm256_maskload_ps(s + i0 + 8, mhi), top_v));
    _mm256_maskstore_ps(s + i0, mlo, elo);
    _mm256_maskstore_ps(s + i0 + 8, mhi, ehi);
    acc_lo = _mm256_add_ps(acc_lo, _mm256_and_ps(elo, _mm256_castsi256_ps(mlo)));
    acc_hi = _mm256_add_ps(acc_hi, _mm256_and_ps(ehi, _mm256_castsi256_ps(mhi)));
  }
  float l = m::avx2::tree16(acc_lo, acc_hi);
  if (sink) l = l + m::scalar::exp(*sink - top);
  return l;
}

// NH heads (<= kHeadsPerPass) over output elements [0, width) of a tile of NV vectors (width > 8 (NV - 1)).
template <int NH, int NV, bool FULL>
EAGLE_TARGET_AVX2 inline void values_tile(const float* p, int64_t p_stride, const float* l, Rows vals,
                                          const int32_t* idx, int64_t n, int64_t width, float* out,
                                          int64_t out_stride) {
  namespace m = attention_math;
  __m256i lanes[NV];
  for (int c = 0; c < NV; ++c) lanes[c] = m::avx2::first_lanes(width - 8 * c);
  __m256 acc[NH][NV];
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < NV; ++c) acc[h][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const float* v = vals.row(idx[i]);
    __m256 x[NV];
    for (int c = 0; c < NV; ++c) x[c] = FULL ? _mm256_loadu_ps(v + 8 * c) : _mm256_maskload_ps(v + 8 * c, lanes[c]);
    for (int h = 0; h < NH; ++h) {
      const __m256 w = _mm256_set1_ps(p[h * p_stride + i]);
      for (int c = 0; c < NV; ++c) acc[h][c] = _mm256_fmadd_ps(w, x[c], acc[h][c]);
    }
  }
  for (int h = 0; h < NH; ++h) {
    const __m256 denom = _mm256_set1_ps(l[h]);
    for (int c = 0; c < NV; ++c)
      _mm256_maskstore_ps(out + h * out_stride + 8 * c, lanes[c], _mm256_div_ps(acc[h][c], denom));
  }
}

template <int NH>
EAGLE_TARGET_AVX2 inline void values_heads(const float* p, int64_t p_stride, const float* l, Rows vals,
                                           const int32_t* idx, int64_t n, int64_t width, float* out,
                                           int64_t out_stride) {
  if (width == 32) return values_tile<NH, 4, true>(p, p_stride, l, vals, idx, n, width, out, out_stride);
  switch ((width + 7) / 8) {
    case 1: values_tile<NH, 1, false>(p, p_stride, l, vals, idx, n, width, out, out_stride); break;
    case 2: values_tile<NH, 2, false>(p, p_stride, l, vals, idx, n, width, out, out_stride); break;
    case 3: values_tile<NH, 3, false>(p, p_stride, l, vals, idx, n, width, out, out_stride); break;
    default: values_tile<NH, 4, false>(p, p_stride, l, vals, idx, n, width, out, out_stride); break;
  }
}

EAGLE_TARGET_AVX2 inline void values(const float* p, int64_t p_stride, int heads, const float* l, Rows vals,
                                     const int32_t* idx, int64_t n, int64_t value_dim, float* out,
                                     int64_t out_stride) {
  for (int64_t d0 = 0; d0 < value_dim; d0 += 32) {
    const int64_t width = std::min<int64_t>(32, value_dim - d0);
    const Rows tile{vals.base + d0, vals.stride};
    for (int h0 = 0; h0 < heads; h0 += kHeadsPerPass) {
      const float* ph = p + h0 * p_stride;
      float* oh = out + h0 * out_stride + d0;
      switch (std::min(kHeadsPerPass, heads - h0)) {
        case 1: values_heads<1>(ph, p_stride, l + h0, tile, idx, n, width, oh, out_stride); break;
        case 2: values_heads<2>(ph, p_stride, l + h0, tile, idx, n, width, oh, out_stride); break;
        case 3: values_heads<3>(ph, p_stride, l + h0, tile, idx, n, width, oh, out_stride); break;
        default: values_heads<4>(ph, p_stride, l + h0, tile, idx, n, width, oh, out_stride); break;
      }
    }
  }
}

EAGLE_TARGET_AVX2 inline void values(const QueryJob* jobs, int count, int heads, Rows vals,
                                     int64_t value_dim) {
  for (int j = 0; j < count; ++j)
    values(jobs[j].s, jobs[j].s_stride, heads, jobs[j].l, vals, jobs[j].idx, jobs[j].n, value_dim, jobs[j].out,
           value_dim);
}

}  // namespace avx2
#endif  // EAGLE_ATTENTION_X86

}  // namespace attention_kernels
}  // namespace eagle
