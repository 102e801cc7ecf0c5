// The block types, their decoding from the GGUF file, and the two packed layouts (see quant.h). Plain portable
// C++: this is also what the portable kernels, `dequantize` and `quant_embedding` decode with.
#include "quant.h"

#include <cmath>
#include <cstring>

namespace eagle::quant {

namespace {

inline uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
inline void store_u16(uint8_t* p, uint16_t v) { p[0] = static_cast<uint8_t>(v); p[1] = static_cast<uint8_t>(v >> 8); }
inline uint32_t load_u32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}

float bits_to_float(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes (ggml's get_scale_min_k4)
void unpack_k4_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[j + 4] & 0x3F;
    sc[j + 4] = static_cast<uint8_t>((s[j + 8] & 0x0F) | ((s[j] >> 2) & 0x30));
    mn[j + 4] = static_cast<uint8_t>((s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30));
  }
}

// One native block (unit) -> codes and raw parameters of unit index `b` of the column.
// Inlined into the per-type loops below, where `t` is a compile-time constant and its branches fold away.
[[gnu::always_inline]] inline void native_unit(const TypeInfo& t, const uint8_t* p, int64_t b, Column& c) {
  uint8_t* u = c.u + b * t.unit;
  switch (t.type) {
    case Q4_0:
    case Q4_1: {
      c.d[b] = load_u16(p);
      if (t.has_m) c.m[b] = load_u16(p + 2);
      const uint8_t* qs = p + (t.has_m ? 4 : 2);
      for (int j = 0; j < 16; ++j) { u[j] = qs[j] & 0x0F; u[j + 16] = qs[j] >> 4; }
      break;
    }
    case Q5_0:
    case Q5_1: {
      c.d[b] = load_u16(p);
      if (t.has_m) c.m[b] = load_u16(p + 2);
      const uint8_t* qh = p + (t.has_m ? 4 : 2);
      const uint32_t h = load_u32(qh);
      const uint8_t* qs = qh + 4;
      for (int j = 0; j < 16; ++j) { u[j] = qs[j] & 0x0F; u[j + 16] = qs[j] >> 4; }
      for (int j = 0; j < 32; ++j) u[j] = static_cast<uint8_t>(u[j] | (((h >> j) & 1u) << 4));
      break;
    }
    case Q8_0: {
      c.d[b] = load_u16(p);
      for (int j = 0; j < 32; ++j) u[j] = static_cast<uint8_t>(p[2 + j] ^ 0x80);  // q + 128
      break;
    }
    case Q4_K:
    case Q5_K: {
      c.d[b] = load_u16(p);
      c.m[b] = load_u16(p + 2);
      unpack_k4_scales(p + 4, c.sc + 8 * b, c.mn + 8 * b);
      const uint8_t* qh = p + 16;
      const uint8_t* qs = p + 16 + (t.type == Q5_K ? 32 : 0);
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 32; ++l) {
          u[64 * i + l] = qs[32 * i + l] & 0x0F;
          u[64 * i + 32 + l] = qs[32 * i + l] >> 4;
        }
      if (t.type == Q5_K)
        for (int g = 0; g < 8; ++g)
          for (int l = 0; l < 32; ++l) u[32 * g + l] = static_cast<uint8_t>(u[32 * g + l] | (((qh[l] >> g) & 1) << 4));
      break;
    }
    case Q6_K: {
      const uint8_t* ql = p;
      const uint8_t* qh = p + 128;
      std::memcpy(c.sc + 16 * b, p + 192, 16);
      c.d[b] = load_u16(p + 208);
      for (int e = 0; e < 256; ++e) {
        const int h = e / 128, r = e % 128;
        const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
        const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
        u[e] = static_cast<uint8_t>(lo | (hi << 4));
      }
      break;
    }
    default:
      break;
  }
}

// nibble pairs of LAYOUT_K: 64 codes -> 32 bytes, 32 codes -> 16 bytes (see Offsets)
void put_pair(const uint8_t* e, uint8_t* out) {
  for (int j = 0; j < 16; ++j) {
    store_u16(out + 2 * j, static_cast<uint16_t>((e[j] & 0xF) | ((e[16 + j] & 0xF) << 4) | ((e[32 + j] & 0xF) << 8) |
                                                 ((e[48 + j] & 0xF) << 12)));
  }
}
void get_pair(const uint8_t* in, uint8_t* e) {
  for (int j = 0; j < 16; ++j) {
    const uint16_t w = load_u16(in + 2 * j);
    e[j] = w & 0xF;
    e[16 + j] = (w >> 4) & 0xF;
    e[32 + j] = (w >> 8) & 0xF;
    e[48 + j] = (w >> 12) & 0xF;
  }
}
void put_single(const uint8_t* e, uint8_t* out) {
  for (int j = 0; j < 16; ++j) out[j] = static_cast<uint8_t>((e[j] & 0xF) | ((e[16 + j] & 0xF) << 4));
}
void get_single(const uint8_t* in, uint8_t* e) {
  for (int j = 0; j < 16; ++j) { e[j] = in[j] & 0xF; e[16 + j] = in[j] >> 4; }
}

void copy_params_out(const TypeInfo& t, const Column& c, int64_t units, int64_t groups, uint8_t* out,
                     const Offsets& o) {
  for (int64_t b = 0; b < units; ++b) {
    store_u16(out + o.d + 2 * b, c.d[b]);
    if (t.has_m) store_u16(out + o.m + 2 * b, c.m[b]);
  }
  if (t.has_scales) std::memcpy(out + o.sc, c.sc, groups);
  if (t.has_scales && t.has_m) std::memcpy(out + o.mn, c.mn, groups);
}

void copy_params_in(const TypeInfo& t, const uint8_t* in, int64_t units, int64_t groups, Column& c,
                    const Offsets& o) {
  for (int64_t b = 0; b < units; ++b) {
    c.d[b] = load_u16(in + o.d + 2 * b);
    if (t.has_m) c.m[b] = load_u16(in + o.m + 2 * b);
  }
  if (t.has_scales) std::memcpy(c.sc, in + o.sc, groups);
  if (t.has_scales && t.has_m) std::memcpy(c.mn, in + o.mn, groups);
}

}  // namespace

const TypeInfo* type_info(int32_t type) {
  for (const TypeInfo& t : kTypes)
    if (t.type == type) return &t;
  return nullptr;
}

const TypeInfo* type_info_by_name(const char* name) {
  for (const TypeInfo& t : kTypes)
    if (std::strcmp(t.name, name) == 0) return &t;
  return nullptr;
}

int64_t payload_bytes(const TypeInfo& t, Layout layout, int64_t n, int64_t k) {
  const int64_t columns = layout == LAYOUT_N && !is_float_type(t) ? padded_columns(n) : n;
  return columns * packed_row_bytes(t, k);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const uint32_t exponent = (h >> 10) & 0x1F;
  uint32_t mantissa = h & 0x3FF;
  if (exponent == 0x1F) return bits_to_float(sign | 0x7F800000u | (mantissa << 13));  // inf / nan
  if (exponent != 0) return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
  if (mantissa == 0) return bits_to_float(sign);
  int e = 113;  // subnormal: normalise (exact in float32)
  while (!(mantissa & 0x400)) { mantissa <<= 1; --e; }
  return bits_to_float(sign | (static_cast<uint32_t>(e) << 23) | ((mantissa & 0x3FF) << 13));
}

namespace {

template <int TYPE>
void native_to_column_of(const uint8_t* row, int64_t k, Column& c) {
  constexpr const TypeInfo& t = TypeTraits<TYPE>::kInfo;
  const int64_t units = k / t.unit;
  for (int64_t b = 0; b < units; ++b) native_unit(t, row + b * t.native_bytes, b, c);
}

}  // namespace

void native_to_column(const TypeInfo& t, const uint8_t* row, int64_t k, Column& c) {
  with_quant_type(t.type, [&](auto type) { native_to_column_of<decltype(type)::value>(row, k, c); });
}

void column_to_k(const TypeInfo& t, const Column& c, int64_t k, uint8_t* out) {
  const Offsets o = offsets(t, LAYOUT_K, k);
  copy_params_out(t, c, k / t.unit, k / t.group, out, o);
  uint8_t* codes = out + o.codes;
  if (t.code_bits == 8) {
    for (int64_t i = 0; i < k; ++i) codes[i] = static_cast<uint8_t>(c.u[i] ^ 0x80);  // int8 q
    return;
  }
  const int64_t pairs = k / 64;
  for (int64_t p = 0; p < pairs; ++p) put_pair(c.u + 64 * p, codes + 32 * p);
  if (k % 64) put_single(c.u + 64 * pairs, codes + 32 * pairs);
  for (int plane = 0; plane < t.planes(); ++plane) {
    uint8_t* bits = out + (plane ? o.plane2 : o.plane);
    for (int64_t v = 0; v < k / 16; ++v) {
      uint16_t word = 0;
      for (int i = 0; i < 16; ++i) word = static_cast<uint16_t>(word | (((c.u[16 * v + i] >> (4 + plane)) & 1) << i));
      store_u16(bits + 2 * v, word);
    }
  }
}

void k_to_column(const TypeInfo& t, const uint8_t* in, int64_t k, Column& c) {
  const Offsets o = offsets(t, LAYOUT_K, k);
  copy_params_in(t, in, k / t.unit, k / t.group, c, o);
  const uint8_t* codes = in + o.codes;
  if (t.code_bits == 8) {
    for (int64_t i = 0; i < k; ++i) c.u[i] = static_cast<uint8_t>(codes[i] ^ 0x80);
    return;
  }
  const int64_t pairs = k / 64;
  for (int64_t p = 0; p < pairs; ++p) get_pair(codes + 32 * p, c.u + 64 * p);
  if (k % 64) get_single(codes + 32 * pairs, c.u + 64 * pairs);
  for (int plane = 0; plane < t.planes(); ++plane) {
    const uint8_t* bits = in + (plane ? o.plane2 : o.plane);
    for (int64_t v = 0; v < k / 16; ++v) {
      const uint16_t word = load_u16(bits + 2 * v);
      for (int i = 0; i < 16; ++i) c.u[16 * v + i] = static_cast<uint8_t>(c.u[16 * v + i] | (((word >> i) & 1) << (4 + plane)));
    }
  }
}

namespace {

// One column's codes of one unit into a LAYOUT_N record: code i at byte 64 * (i / 4) + 4 * j + i % 4 (8-bit), or as
// the low (i % 8 < 4) or high nibble of byte 64 * (i / 8) + 4 * j + i % 4, with its fifth bit (5-bit codes) at bit
// 4 * j + i % 4 of the plane's 8-byte word 8 * (i / 4), or its fifth and sixth bits (6-bit codes) at bits
// 2 ((i / 4) % 4) and up of high byte 64 * (i / 16) + 4 * j + i % 4. Every code and high byte is written whole; the
// plane bytes are shared by two columns, so a column ORs its four bits into them (the record starts zeroed).
[[gnu::always_inline]] inline void unit_codes_to_n(const TypeInfo& t, const uint8_t* u, int j, uint8_t* rec,
                                                  const Offsets& o) {
  uint8_t* codes = rec + o.codes + 4 * j;
  if (t.code_bits == 8) {
    for (int q = 0; q < t.unit / 4; ++q) {
      if (u) {
        std::memcpy(codes + 64 * q, u + 4 * q, 4);
      } else {
        std::memset(codes + 64 * q, 0x80, 4);
      }
    }
    return;
  }
  if (!u) return;  // a padding column: zero codes, zero bits
  for (int q = 0; q < t.unit / 8; ++q)
    for (int r = 0; r < 4; ++r)
      codes[64 * q + r] = static_cast<uint8_t>((u[8 * q + r] & 0xF) | ((u[8 * q + 4 + r] & 0xF) << 4));
  if (t.planes() == 2) {  // 6-bit: bits 4-5 of 4 steps' codes in one byte of the steps' 64-byte high vector
    uint8_t* high = rec + o.plane + 4 * j;
    for (int q = 0; q < t.unit / 16; ++q)
      for (int r = 0; r < 4; ++r) {
        int byte = 0;
        for (int s = 0; s < 4; ++s) byte |= ((u[16 * q + 4 * s + r] >> 4) & 3) << (2 * s);
        high[64 * q + r] = static_cast<uint8_t>(byte);
      }
    return;
  }
  if (t.planes() == 1) {  // 5-bit: bit 4 of each code in the plane, two columns' nibbles per byte
    const int shift = 4 * (j % 2);
    uint8_t* bits = rec + o.plane + j / 2;
    for (int v = 0; v < t.unit / 4; ++v) {
      int nibble = 0;
      for (int r = 0; r < 4; ++r) nibble |= ((u[4 * v + r] >> 4) & 1) << r;
      bits[8 * v] = static_cast<uint8_t>(bits[8 * v] | (nibble << shift));
    }
  }
}

template <int TYPE>
void columns_to_n_of(const Column* const* cols, int64_t k, uint8_t* out) {
  constexpr const TypeInfo& t = TypeTraits<TYPE>::kInfo;
  const Offsets o = offsets(t, LAYOUT_N, k);
  const int gpu = t.groups_per_unit();
  const int64_t units = k / t.unit;
  for (int64_t b = 0; b < units; ++b) {
    uint8_t* rec = out + b * o.total;
    for (int j = 0; j < kColumnsPerGroup; ++j) {
      const Column* c = cols[j];
      store_u16(rec + o.d + 2 * j, c ? c->d[b] : 0);
      if (t.has_m) store_u16(rec + o.m + 2 * j, c ? c->m[b] : 0);
      for (int g = 0; g < (t.has_scales ? gpu : 0); ++g) {
        rec[o.sc + 16 * g + j] = c ? c->sc[b * gpu + g] : 0;
        if (t.has_m) rec[o.mn + 16 * g + j] = c ? c->mn[b * gpu + g] : 0;
      }
      unit_codes_to_n(t, c ? c->u + b * t.unit : nullptr, j, rec, o);
    }
  }
}

}  // namespace

void columns_to_n(const TypeInfo& t, const Column* const* cols, int64_t k, uint8_t* out) {
  with_quant_type(t.type, [&](auto type) { columns_to_n_of<decltype(type)::value>(cols, k, out); });
}

void n_to_column(const TypeInfo& t, const uint8_t* group_base, int j, int64_t k, Column& c) {
  const Offsets o = offsets(t, LAYOUT_N, k);
  const int gpu = t.groups_per_unit();
  const int64_t units = k / t.unit;
  for (int64_t b = 0; b < units; ++b) {
    const uint8_t* rec = group_base + b * o.total;
    c.d[b] = load_u16(rec + o.d + 2 * j);
    if (t.has_m) c.m[b] = load_u16(rec + o.m + 2 * j);
    for (int g = 0; g < (t.has_scales ? gpu : 0); ++g) {
      c.sc[b * gpu + g] = rec[o.sc + 16 * g + j];
      if (t.has_m) c.mn[b * gpu + g] = rec[o.mn + 16 * g + j];
    }
    uint8_t* u = c.u + b * t.unit;
    for (int i = 0; i < t.unit; ++i) {
      if (t.code_bits == 8) {
        u[i] = rec[o.codes + 64 * (i / 4) + 4 * j + i % 4];
        continue;
      }
      const uint8_t byte = rec[o.codes + 64 * (i / 8) + 4 * j + i % 4];
      uint8_t v = static_cast<uint8_t>((i % 8 >= 4 ? byte >> 4 : byte) & 0xF);
      if (t.planes() == 2) {  // 6-bit: bits 4-5 from the high vector
        const uint8_t high = rec[o.plane + 64 * (i / 16) + 4 * j + i % 4];
        v = static_cast<uint8_t>(v | (((high >> (2 * ((i / 4) % 4))) & 3) << 4));
      } else if (t.planes() == 1) {  // 5-bit: bit 4 from the plane
        const int bit = 4 * j + i % 4;
        v = static_cast<uint8_t>(v | (((rec[o.plane + 8 * (i / 4) + bit / 8] >> (bit % 8)) & 1) << 4));
      }
      u[i] = v;
    }
  }
}

void column_params(const TypeInfo& t, const Column& c, int64_t k, float* a, float* b) {
  const int64_t groups = k / t.group;
  const int gpu = t.groups_per_unit();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t unit = g / gpu;
    const float d = half_to_float(c.d[unit]);
    if (!t.has_scales) {
      a[g] = d;
      b[g] = t.has_m ? half_to_float(c.m[unit]) : 0.0f;
    } else if (!t.has_m) {  // Q6_K: int8 scales
      a[g] = d * static_cast<float>(static_cast<int8_t>(c.sc[g]));
      b[g] = 0.0f;
    } else {
      a[g] = d * static_cast<float>(c.sc[g]);
      b[g] = -(half_to_float(c.m[unit]) * static_cast<float>(c.mn[g]));
    }
  }
}

void column_weights(const TypeInfo& t, const Column& c, int64_t k, const float* a, const float* b, float* w) {
  for (int64_t i = 0; i < k; ++i) {
    const int64_t g = i / t.group;
    if (t.offset >= 0) {
      w[i] = a[g] * static_cast<float>(static_cast<int>(c.u[i]) - t.offset);
    } else {
      w[i] = std::fma(a[g], static_cast<float>(c.u[i]), b[g]);
    }
  }
}

void float_row_weights(const TypeInfo& t, const uint8_t* row, int64_t k, float* w) {
  for (int64_t i = 0; i < k; ++i) {
    if (t.type == F32) {
      std::memcpy(w + i, row + 4 * i, 4);
    } else if (t.type == F16) {
      w[i] = half_to_float(load_u16(row + 2 * i));
    } else {
      w[i] = bits_to_float(static_cast<uint32_t>(load_u16(row + 2 * i)) << 16);
    }
  }
}

void quantize_rows_portable(const float* x, int64_t row_begin, int64_t row_end, QuantizedRows& out) {
  const int64_t k = out.k, blocks = k / 32;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t blk = 0; blk < blocks; ++blk) {
      const float* v = x + r * k + 32 * blk;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::fmax(amax, std::fabs(v[i]));
      const float d = amax / 127.0f;
      const float id = d != 0.0f ? 1.0f / d : 0.0f;
      int8_t* q = out.q + r * k + 32 * blk;
      int32_t sums[2] = {0, 0};
      for (int i = 0; i < 32; ++i) {
        // clamp first: defined for any input (NaN -> -127), and |x * id| <= 127 for finite x anyway
        const float scaled = std::fmin(std::fmax(v[i] * id, -127.0f), 127.0f);
        q[i] = static_cast<int8_t>(std::nearbyint(scaled));
        sums[i / 16] += q[i];
      }
      out.d[r * blocks + blk] = d;
      out.s[r * blocks + blk] = d * static_cast<float>(sums[0] + sums[1]);
      out.sum16[r * (k / 16) + 2 * blk] = sums[0];
      out.sum16[r * (k / 16) + 2 * blk + 1] = sums[1];
    }
  }
}

int64_t scratch_floats(const TypeInfo& t, int64_t k) {
  // portable kernels: codes (K bytes), fp16 d / m and scales (< K bytes each), a / b per group, weights K;
  // SIMD kernels: a / b per group for up to 64 columns (AVX-512), 4 decoded columns of K floats (AVX2)
  return 12 * k + 64;
}

}  // namespace eagle::quant
