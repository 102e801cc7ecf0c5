// Portable kernels: correct on any CPU, one scalar std::fma chain per output. Each column is decoded with the
// layout code of quant_layout.cpp (the same decoding `dequantize` uses), then applied to every row.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "quant.h"

namespace eagle::quant {

namespace {

// Carves a canonical column and its a / b / w buffers out of the caller's scratch (scratch_floats(t, k) floats).
struct ColumnScratch {
  Column column;
  float *a, *b, *w;
  ColumnScratch(const TypeInfo& t, int64_t k, float* scratch) {
    const int64_t groups = t.group ? k / t.group : 0;
    a = scratch;
    b = a + groups;
    w = b + groups;
    auto* bytes = reinterpret_cast<uint8_t*>(w + k);
    column.u = bytes;
    column.sc = bytes + k;
    column.mn = column.sc + groups;
    // fp16 entries: one per unit (k / unit <= k / 16), 2-byte aligned after the k + 2 groups bytes
    auto* halves = reinterpret_cast<uint16_t*>(bytes + (k + 2 * groups + 1) / 2 * 2);
    column.d = halves;
    column.m = halves + k / 16 + 1;
  }
};

void decode_k_column(const TypeInfo& t, const uint8_t* row, int64_t k, ColumnScratch& s) {
  if (is_float_type(t)) {
    float_row_weights(t, row, k, s.w);
    return;
  }
  k_to_column(t, row, k, s.column);
  column_params(t, s.column, k, s.a, s.b);
  column_weights(t, s.column, k, s.a, s.b, s.w);
}

// int8 numerics for one column and one row (see quant.h: the formula every path computes)
float int8_dot(const TypeInfo& t, const Column& c, const float* a, const float* b, const QuantizedRows& xq,
               int64_t r) {
  const int64_t k = xq.k, groups = k / t.group;
  const int8_t* q = xq.q + r * k;
  const float* dx = xq.d + r * (k / 32);
  const float* sx = xq.s + r * (k / 32);
  const int32_t* sum16 = xq.sum16 + r * (k / 16);
  float acc = 0.0f, accb = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    int32_t isum = 0;
    for (int64_t i = g * t.group; i < (g + 1) * t.group; ++i) isum += static_cast<int32_t>(q[i]) * c.u[i];
    const int64_t block = g * t.group / 32;
    if (t.offset >= 0) {
      const int32_t xsum = t.group == 16 ? sum16[g] : sum16[2 * g] + sum16[2 * g + 1];
      isum -= t.offset * xsum;
    }
    acc = std::fma(static_cast<float>(isum), a[g] * dx[block], acc);
    if (t.offset < 0) accb = std::fma(b[g], sx[block], accb);
  }
  return t.offset < 0 ? acc + accb : acc;
}

}  // namespace

bool linear_k_portable(const LinearArgs& args, int64_t n_begin, int64_t n_end, float* scratch) {
  const TypeInfo& t = *args.type;
  const int64_t k = args.k, row_bytes = packed_row_bytes(t, k);
  ColumnScratch s(t, k, scratch);
  for (int64_t n = n_begin; n < n_end; ++n) {
    decode_k_column(t, args.payload + n * row_bytes, k, s);
    for (int64_t r = 0; r < args.m; ++r) {
      const float* x = args.x + r * k;
      float acc = 0.0f;
      for (int64_t i = 0; i < k; ++i) acc = std::fma(x[i], s.w[i], acc);
      args.y[r * args.n + n] = args.bias ? acc + args.bias[n] : acc;
    }
  }
  return true;
}

bool linear_n_portable(const LinearArgs& args, int64_t n_begin, int64_t n_end, float* scratch) {
  const TypeInfo& t = *args.type;
  if (is_float_type(t)) return false;
  const int64_t k = args.k, group_bytes = kColumnsPerGroup * packed_row_bytes(t, k);
  ColumnScratch s(t, k, scratch);
  for (int64_t n = n_begin; n < std::min(n_end, args.n); ++n) {
    n_to_column(t, args.payload + n / kColumnsPerGroup * group_bytes, static_cast<int>(n % kColumnsPerGroup), k,
                s.column);
    column_params(t, s.column, k, s.a, s.b);
    for (int64_t r = 0; r < args.m; ++r) {
      const float v = int8_dot(t, s.column, s.a, s.b, *args.xq, r);
      args.y[r * args.n + n] = args.bias ? v + args.bias[n] : v;
    }
  }
  return true;
}

}  // namespace eagle::quant
