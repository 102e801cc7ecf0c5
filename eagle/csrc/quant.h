// Quantized weights of GGUF files: the block types, the two packed layouts the linear kernels read, and the kernels'
// entry points. No torch types here: the kernels see raw pointers, already validated by ops.cpp.
//
// Every quantized type is described by one formula. A weight matrix of N output columns and K inputs is split, per
// column, into groups of G consecutive inputs (G = 32; 16 for Q6_K). Element k of column n has an unsigned integer
// code u and its group has float32 numbers a (and b), and
//     w = a * float(u - o)           symmetric types (integer offset o)
//     w = fma(a, float(u), b)        asymmetric types
// Both are what gguf-py's `gguf.quants.dequantize` computes, bit for bit (the float32 weights transformers builds
// from a GGUF file), signed zeros included: a * u is exact in float32 (a holds at most 19 significant bits, u at
// most 8), so the product of the symmetric types is exact and the fused multiply-add rounds once, as gguf-py's
// `d * q + m` does.
//   Q4_0  u = q (0..15)        o = 8     a = d               (w = d (q - 8))
//   Q4_1  u = q (0..15)                  a = d      b = m    (w = d q + m)
//   Q5_0  u = q (0..31)        o = 16    a = d
//   Q5_1  u = q (0..31)                  a = d      b = m
//   Q8_0  u = q + 128 (0..255) o = 128   a = d               (w = d q)
//   Q4_K  u = q (0..15)                  a = d sc_g b = -(dmin m_g)   (sc_g, m_g: 6-bit, per group of 32)
//   Q5_K  u = q (0..31)                  a = d sc_g b = -(dmin m_g)
//   Q6_K  u = q (0..63)        o = 32    a = d sc_g                   (sc_g: int8, per group of 16)
// F32, F16 and BF16 weights are stored as they are (no groups).
//
// The packed tensor is a 64-byte header (magic, version, type, layout, N, K, payload size) followed by the payload,
// in one of two layouts (the header says which; every op checks it):
//   LAYOUT_K ("float32" numerics): column after column, each column's groups in input order, with the codes arranged
//     so that 16 consecutive inputs come out of one vector load (see quant_layout.cpp). Same byte count as the GGUF
//     file for every type except Q4_K / Q5_K (+4 bytes per 256 inputs: their 6-bit scales are stored unpacked).
//   LAYOUT_N ("int8" numerics): groups of 16 columns interleaved so that one 64-byte vector holds 4 consecutive
//     inputs of 16 columns (what VNNI's vpdpbusd multiplies with 4 bytes of activations); N is padded to a multiple
//     of 16 with zero columns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace eagle::quant {

// ggml type ids (gguf.GGMLQuantizationType)
enum Type : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

enum Layout : int32_t { LAYOUT_K = 0, LAYOUT_N = 1 };

constexpr uint32_t kMagic = 0x57514745u;  // "EGQW"
constexpr uint32_t kVersion = 2;  // 2: Q6_K's LAYOUT_N high bits in one vector per 16 inputs (was two bit planes)
constexpr int64_t kHeaderBytes = 64;
constexpr int kColumnsPerGroup = 16;  // LAYOUT_N interleaves this many columns

struct Header {
  uint32_t magic, version;
  int32_t type, layout;
  int64_t n, k, payload_bytes;
  uint8_t reserved[kHeaderBytes - 40];
};
static_assert(sizeof(Header) == kHeaderBytes, "header is 64 bytes");

// The facts of one GGUF type, for every kernel and the extension's ops: this table's entries are the types the
// extension handles (torch.ops.eagle.quant_types() reports them to Python).
struct TypeInfo {
  Type type;
  const char* name;
  int unit;             // inputs per unit: a native block (32), a K-quant super-block (256), 1 for float types
  int native_bytes;     // bytes of one unit in the GGUF file
  int packed_bytes;     // bytes of one unit of one column in either packed layout
  int group;            // inputs per (a, b) group; 0 for float types
  int code_bits;        // 4, 5, 6 or 8; 0 for float types
  int offset;           // symmetric types: w = a (u - offset) (an integer correction in int8 numerics); -1 otherwise
  bool has_m;           // a second fp16 per unit: m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K); the asymmetric types
  bool has_scales;      // K-quants: an integer scale per group (and a 6-bit min per group for Q4_K / Q5_K)
  constexpr int planes() const { return code_bits == 5 ? 1 : code_bits == 6 ? 2 : 0; }  // bit planes above 4 bits
  constexpr bool nibbles() const { return code_bits >= 4 && code_bits <= 6; }
  constexpr int groups_per_unit() const { return group ? unit / group : 0; }
};

// The one table of the types (see the formula above), indexed by type id through type_index. Adding a GGUF type
// takes its id in Type and its entry here (the ops, the packed layouts, TypeTraits, the kernels' instantiations and
// eagle.kernels.quant_types() follow), plus its kernels: its decoding from the GGUF block (native_unit in
// quant_layout.cpp) and, where its parameters or codes differ from those of the types here (scales, mins, code
// widths), the branches of column_params and of the SIMD kernels' parameter and code loads; and its slow reference
// decoder (eagle/kernels/reference.py), which the tests compare it with.
//   type, name, unit, native bytes, packed bytes, group, code bits, offset, has_m, has_scales
inline constexpr TypeInfo kTypes[] = {
    {F32, "F32", 1, 4, 4, 0, 0, -1, false, false},
    {F16, "F16", 1, 2, 2, 0, 0, -1, false, false},
    {BF16, "BF16", 1, 2, 2, 0, 0, -1, false, false},
    {Q4_0, "Q4_0", 32, 18, 18, 32, 4, 8, false, false},
    {Q4_1, "Q4_1", 32, 20, 20, 32, 4, -1, true, false},
    {Q5_0, "Q5_0", 32, 22, 22, 32, 5, 16, false, false},
    {Q5_1, "Q5_1", 32, 24, 24, 32, 5, -1, true, false},
    {Q8_0, "Q8_0", 32, 34, 34, 32, 8, 128, false, false},
    {Q4_K, "Q4_K", 256, 144, 148, 32, 4, -1, true, true},
    {Q5_K, "Q5_K", 256, 176, 180, 32, 5, -1, true, true},
    {Q6_K, "Q6_K", 256, 210, 210, 16, 6, 32, false, true},
};
inline constexpr int kTypeCount = static_cast<int>(sizeof(kTypes) / sizeof(kTypes[0]));

// index of type id `type` in kTypes (kTypeCount when it is not there)
constexpr int type_index(int type) {
  for (int i = 0; i < kTypeCount; ++i)
    if (kTypes[i].type == type) return i;
  return kTypeCount;
}

// A type's facts as compile-time constants, for the SIMD kernels' per-type templates: read from kTypes.
template <int TYPE>
struct TypeTraits {
  static_assert(type_index(TYPE) < kTypeCount, "TypeTraits of a type that is not in kTypes");
  static constexpr TypeInfo kInfo = kTypes[type_index(TYPE)];
  static constexpr int kBits = kInfo.code_bits;
  static constexpr int kGroup = kInfo.group;
  static constexpr int kUnit = kInfo.unit;
  static constexpr bool kAsym = kInfo.has_m;
  static constexpr bool kScales = kInfo.has_scales;
  static constexpr int kOffset = kInfo.offset > 0 ? kInfo.offset : 0;  // w = a (u - kOffset); 0: asymmetric
  static constexpr int kPlanes = kInfo.planes();
  static constexpr bool kFloat = kInfo.group == 0;
};

// Byte offsets inside one column (LAYOUT_K) or one unit record of a 16-column group (LAYOUT_N).
//   LAYOUT_K column: d[units] m[units] sc[groups] mn[groups] codes planes
//     codes: 4/5/6-bit: pairs of 32-input groups in 32 bytes (word j = e[j] | e[16+j] << 4 | e[32+j] << 8 |
//       e[48+j] << 12), a last odd group in 16 bytes (byte j = e[j] | e[16+j] << 4); 8-bit: int8 q in input order.
//     planes: one 16-bit word per 16 inputs (bit i: bit 4, then bit 5, of the code of input 16 v + i).
//   LAYOUT_N unit record: d[16] m[16] sc[groups][16] mn[groups][16] codes planes
//     codes: 4/5/6-bit: 64 bytes per 8 inputs t: byte 4 j + i = nib(j, 8t + i) | nib(j, 8t + 4 + i) << 4;
//       8-bit: 64 bytes per 4 inputs h: byte 4 j + i = u(j, 4h + i)   (j: column lane 0..15)
//     planes: 5-bit: 8 bytes per 4 inputs h: bit 4 j + i = bit 4 of u(j, 4h + i); 6-bit (both planes' bytes, one
//       high vector per 16 inputs q): 64 bytes per 16 inputs: byte 4 j + i = bits 4-5 of u(j, 16q + 4s + i) at bits
//       2s, 2s + 1 (s = 0..3), so that one shift and one logic operation put a step's high bits in its code bytes.
struct Offsets {
  int64_t d, m, sc, mn, codes, plane, plane2, total;
};
inline Offsets offsets(const TypeInfo& t, Layout layout, int64_t k) {
  Offsets o{};
  const int64_t units = layout == LAYOUT_K ? k / t.unit : kColumnsPerGroup;  // fp16 d/m entries
  const int64_t span = layout == LAYOUT_K ? k : t.unit;                        // inputs covered
  const int64_t lanes = layout == LAYOUT_K ? 1 : kColumnsPerGroup;
  const int64_t groups = t.group ? span / t.group : 0;
  o.d = 0;
  o.m = 2 * units;
  o.sc = o.m + (t.has_m ? 2 * units : 0);
  o.mn = o.sc + (t.has_scales ? groups * lanes : 0);
  o.codes = o.mn + (t.has_scales && t.has_m ? groups * lanes : 0);
  o.plane = o.codes + (t.nibbles() ? span / 2 : span) * lanes;
  o.plane2 = o.plane + span / 8 * lanes;
  o.total = o.plane + t.planes() * span / 8 * lanes;
  return o;
}

// Calls f(std::integral_constant<int, TYPE>{}) for the entry I.. of kTypes whose id is `type` (only the quantized
// entries when kQuantizedOnly) and returns true; false for any other type.
template <bool kQuantizedOnly, int I = 0, typename F>
bool with_type_from(int32_t type, const F& f) {
  if constexpr (I == kTypeCount) {
    return false;
  } else {
    if constexpr (!kQuantizedOnly || kTypes[I].group > 0) {
      if (type == kTypes[I].type) {
        f(std::integral_constant<int, kTypes[I].type>{});
        return true;
      }
    }
    return with_type_from<kQuantizedOnly, I + 1>(type, f);
  }
}

// f(std::integral_constant<int, TYPE>{}) for a quantized type of kTypes (TYPE a compile-time constant, for the SIMD
// kernels' per-type templates), returning true; false for any other type (the float types included).
template <typename F>
bool with_quant_type(int32_t type, const F& f) {
  return with_type_from<true>(type, f);
}

// the same for every type of kTypes, the float types included
template <typename F>
bool with_any_type(int32_t type, const F& f) {
  return with_type_from<false>(type, f);
}

// nullptr for a type the kernels do not handle
const TypeInfo* type_info(int32_t type);
const TypeInfo* type_info_by_name(const char* name);
inline bool is_float_type(const TypeInfo& t) { return t.group == 0; }

// bytes of one column of LAYOUT_K / of the native GGUF row (K must be a multiple of t.unit)
inline int64_t packed_row_bytes(const TypeInfo& t, int64_t k) { return k / t.unit * t.packed_bytes; }
inline int64_t native_row_bytes(const TypeInfo& t, int64_t k) { return k / t.unit * t.native_bytes; }
inline int64_t padded_columns(int64_t n) { return (n + kColumnsPerGroup - 1) / kColumnsPerGroup * kColumnsPerGroup; }
// payload bytes of a packed (type, layout, N, K) weight
int64_t payload_bytes(const TypeInfo& t, Layout layout, int64_t n, int64_t k);

// ---------------------------------------------------------------------------------------------------------------
// A column in canonical form: codes u[K], and the raw parameters as the file has them (fp16 bits of d and m per
// unit; 6-bit or int8 scales and 6-bit mins per group for the K-quants). Buffers sized by the caller with
// column_sizes().
struct Column {
  uint8_t* u;      // K codes
  uint16_t* d;     // per unit: d (fp16 bits)
  uint16_t* m;     // per unit: m (Q4_1, Q5_1) or dmin (Q4_K, Q5_K), fp16 bits
  uint8_t* sc;     // per group: scale (Q4_K, Q5_K: 6-bit; Q6_K: int8 bits)
  uint8_t* mn;     // per group: min (Q4_K, Q5_K: 6-bit)
};

float half_to_float(uint16_t h);

// native GGUF row (one column of the weight) <-> canonical column
void native_to_column(const TypeInfo& t, const uint8_t* row, int64_t k, Column& c);
// canonical column -> LAYOUT_K column bytes, and back
void column_to_k(const TypeInfo& t, const Column& c, int64_t k, uint8_t* out);
void k_to_column(const TypeInfo& t, const uint8_t* in, int64_t k, Column& c);
// 16 canonical columns (nullptr: a padding column) -> one LAYOUT_N column group; and lane j of a group back
void columns_to_n(const TypeInfo& t, const Column* const* cols, int64_t k, uint8_t* out);
void n_to_column(const TypeInfo& t, const uint8_t* group_base, int lane, int64_t k, Column& c);
// per-group a and b of a canonical column (K / t.group of each; b = 0 for symmetric types)
void column_params(const TypeInfo& t, const Column& c, int64_t k, float* a, float* b);
// w[K] of a canonical column: a * (u - o) or fma(a, u, b)
void column_weights(const TypeInfo& t, const Column& c, int64_t k, const float* a, const float* b, float* w);
// float-type column (F32 / F16 / BF16 bytes) -> w[K]
void float_row_weights(const TypeInfo& t, const uint8_t* row, int64_t k, float* w);

// ---------------------------------------------------------------------------------------------------------------
// int8 activations: each row of x quantized per block of 32 inputs, the same way on every path:
//   amax = max |x|, d = amax / 127, id = d != 0 ? 1 / d : 0, q = round-half-even(x * id) clamped to [-127, 127]
// with s = d * sum(q) per block and sum16 = sum(q) per 16 inputs (for the integer correction of symmetric types).
struct QuantizedRows {
  int64_t rows, k;      // k: inputs per row (multiple of 32)
  int8_t* q;            // rows * k
  float* d;             // rows * k/32
  float* s;             // rows * k/32
  int32_t* sum16;       // rows * k/16
};
void quantize_rows_portable(const float* x, int64_t row_begin, int64_t row_end, QuantizedRows& out);

// The AVX-512 int8 kernels read a call's quantized rows rearranged for their row tiles (quant_avx512.cpp, NRows):
// interleaved_row_bytes(k) bytes per row, written by interleave_rows_avx512 once per call and weight type (the layout
// follows the type's group size and code offset); false for a type the kernels do not handle.
inline int64_t interleaved_row_bytes(int64_t k) { return k + 4 * (k / 16) + 8 * (k / 32); }
bool interleave_rows_avx512(const TypeInfo& t, const QuantizedRows& xq, uint8_t* out);

// ---------------------------------------------------------------------------------------------------------------
// Kernels. A call computes columns [n_begin, n_end) (LAYOUT_N: a multiple of 16 wide) of y (M, N) for every row.
// What one output is depends only on its row of x and its column of weights: every path below computes it by one
// fixed sequence of operations whatever M, the row's position and the column range.
struct LinearArgs {
  const TypeInfo* type;
  const uint8_t* payload;
  int64_t n, k, m;
  const float* x;           // (M, K), float32 numerics
  const QuantizedRows* xq;  // int8 numerics
  const float* bias;        // N or nullptr
  float* y;                 // (M, N)
  const uint8_t* xn = nullptr;  // int8 numerics on AVX-512: xq interleaved for this type (interleave_rows_avx512)
};

// One set per instruction set (isa.h). Each returns false when it does not handle args.type (then ops.cpp refuses
// with the type named).
bool linear_k_portable(const LinearArgs& a, int64_t n_begin, int64_t n_end, float* scratch);
bool linear_n_portable(const LinearArgs& a, int64_t n_begin, int64_t n_end, float* scratch);
bool linear_k_avx2(const LinearArgs& a, int64_t n_begin, int64_t n_end, float* scratch);
bool linear_n_avx2(const LinearArgs& a, int64_t n_begin, int64_t n_end, float* scratch);
bool linear_k_avx512(const LinearArgs& a, int64_t n_begin, int64_t n_end, float* scratch);
bool linear_n_avx512(const LinearArgs& a, int64_t n_begin, int64_t n_end, float* scratch);
void quantize_rows_avx2(const float* x, int64_t row_begin, int64_t row_end, QuantizedRows& out);
void quantize_rows_avx512(const float* x, int64_t row_begin, int64_t row_end, QuantizedRows& out);

// floats of scratch a kernel call needs (per thread)
int64_t scratch_floats(const TypeInfo& t, int64_t k);

}  // namespace eagle::quant
