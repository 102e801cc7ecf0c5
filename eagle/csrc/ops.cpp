// The extension's torch ops over GGUF quantized weights (namespace `eagle`; this file holds the one TORCH_LIBRARY
// block of the extension, other files add theirs with TORCH_LIBRARY_FRAGMENT):
//   repack(raw, type, n, k, numerics)                  GGUF blocks (N rows of K inputs) -> packed weight
//   quant_linear(x, weight, type, n, k, bias, numerics) x (M, K) float32 -> (M, N) float32
//   dequantize(weight, type, n, k)                     packed weight -> (N, K) float32
//   quant_embedding(ids, weight, type, n, k)           ids (...) int64 -> (..., K) float32 rows
//   quantize_rows(x)                                   the int8 activation quantizer: (q, d, s) of x (M, K)
//   packed_nbytes(type, n, k, numerics)
//   quant_types()                                      the types of quant.h's table: names, ids, block sizes
//   read_bandwidth(nbytes, threads)                    GB/s of a read of an nbytes buffer on the kernels' threads
// (the instruction-set ops are in isa.cpp)
// Every op checks its arguments (dtype, device, contiguity, shape, K a multiple of the type's block, the packed
// weight's header and byte count) before touching memory.
#include <Python.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <c10/util/StringUtil.h>

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "isa.h"
#include "ops.h"
#include "parallel.h"
#include "quant.h"

namespace eagle {

namespace {

using quant::Header;
using quant::Layout;
using quant::TypeInfo;

// ------------------------------------------------------------------------------------------------ checks
// the names of quant::kTypes, in its order
std::vector<std::string> type_names() {
  std::vector<std::string> names;
  for (const TypeInfo& t : quant::kTypes) names.emplace_back(t.name);
  return names;
}

const TypeInfo& checked_type(const std::string& name, const char* op) {
  const TypeInfo* t = quant::type_info_by_name(name.c_str());
  TORCH_CHECK_VALUE(t != nullptr, op, ": weight type '", name, "' is not handled by the kernels (handled: ",
                    c10::Join(", ", type_names()), ")");
  return *t;
}

Layout layout_for(const TypeInfo& t, const std::string& numerics, const char* op) {
  TORCH_CHECK_VALUE(numerics == "float32" || numerics == "int8", op, ": numerics must be 'float32' or 'int8', got '",
              numerics, "'");
  return numerics == "int8" && !quant::is_float_type(t) ? quant::LAYOUT_N : quant::LAYOUT_K;
}

void check_shape(const TypeInfo& t, int64_t n, int64_t k, const char* op) {
  TORCH_CHECK_VALUE(n >= 1 && k >= 1, op, ": N and K must be positive, got N=", n, ", K=", k);
  TORCH_CHECK_VALUE(n <= (int64_t{1} << 31) && k <= (int64_t{1} << 31), op, ": N=", n, ", K=", k, " is too large");
  TORCH_CHECK_VALUE(k % t.unit == 0, op, ": K=", k, " is not a multiple of the ", t.name, " block size (", t.unit, ")");
}

void check_bytes_tensor(const at::Tensor& w, const char* what, const char* op) {
  TORCH_CHECK_TYPE(w.device().is_cpu(), op, ": ", what, " must be a CPU tensor, got ", w.device());
  TORCH_CHECK_TYPE(w.scalar_type() == at::kByte, op, ": ", what, " must be a uint8 tensor, got ", w.scalar_type());
  TORCH_CHECK_VALUE(w.is_contiguous(), op, ": ", what, " must be contiguous");
}

// Validates a packed weight against (type, N, K) and returns its layout.
Layout check_packed(const at::Tensor& w, const TypeInfo& t, int64_t n, int64_t k, const char* op) {
  check_bytes_tensor(w, "the packed weight", op);
  check_shape(t, n, k, op);
  TORCH_CHECK_VALUE(w.numel() >= quant::kHeaderBytes, op, ": the packed weight holds ", w.numel(),
              " bytes, less than its 64-byte header: pass a tensor made by eagle::repack");
  Header h;
  std::memcpy(&h, w.data_ptr<uint8_t>(), sizeof(h));
  TORCH_CHECK_VALUE(h.magic == quant::kMagic && h.version == quant::kVersion, op,
              ": the tensor is not a packed weight of this version (bad header): pass a tensor made by eagle::repack");
  TORCH_CHECK_VALUE(h.type == t.type, op, ": the packed weight holds type ",
              quant::type_info(h.type) ? quant::type_info(h.type)->name : "?", ", not ", t.name);
  TORCH_CHECK_VALUE(h.n == n && h.k == k, op, ": the packed weight is N=", h.n, ", K=", h.k, ", not N=", n, ", K=", k);
  TORCH_CHECK_VALUE(h.layout == quant::LAYOUT_K || h.layout == quant::LAYOUT_N, op, ": bad layout in the header");
  const Layout layout = static_cast<Layout>(h.layout);
  TORCH_CHECK_VALUE(layout == quant::LAYOUT_K || !quant::is_float_type(t), op, ": bad layout for a float weight");
  const int64_t payload = quant::payload_bytes(t, layout, n, k);
  TORCH_CHECK_VALUE(h.payload_bytes == payload && w.numel() == quant::kHeaderBytes + payload, op, ": the packed ", t.name,
              " weight (N=", n, ", K=", k, ") must hold 64 + ", payload, " bytes, it holds ", w.numel());
  return layout;
}

at::Tensor check_rows(const at::Tensor& x, int64_t k, const char* op) {
  TORCH_CHECK_TYPE(x.device().is_cpu(), op, ": x must be a CPU tensor, got ", x.device());
  TORCH_CHECK_TYPE(x.scalar_type() == at::kFloat, op, ": x must be float32, got ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() == 2 && x.size(1) == k, op, ": x must have shape (M, ", k, "), got ", x.sizes());
  TORCH_CHECK_VALUE(x.is_contiguous(), op, ": x must be contiguous");
  return x;
}

// ------------------------------------------------------------------------------------------------ scratch
float* thread_scratch(int64_t floats) {
  thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < floats) buffer.resize(floats);
  return buffer.data();
}

// columns per work chunk: results never depend on it, only the split of work over threads does.
// LAYOUT_K: the kernel streams the weights, prefetching far ahead of the columns it computes (quant_avx512.cpp):
// each chunk a long run of consecutive columns keeps that prefetch on what the same thread computes next; two
// chunks per thread still let a thread that falls behind hand work over.
// LAYOUT_N (int8): the same long runs (with chunks of 16-column groups claimed alternately by two threads, each
// thread's reads skip every other group and its stream runs at half the speed of one thread reading them all: a
// 1536 x 576 Q4_1 weight at 4 rows took 30-36 us on two threads against 22 us on one); 1 or 2 rows in multiples of
// 64 columns, whose 4-group tiles keep more independent work in flight.
int64_t chunk_columns(Layout layout, int64_t n, int64_t m) {
  const int64_t wide = layout == quant::LAYOUT_N ? 64 : 32;
  if (n < 4 * wide) return 16;
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t per_chunk = (n + 2 * threads - 1) / (2 * threads);
  const int64_t unit = layout == quant::LAYOUT_N && m <= 2 ? 64 : 16;
  return std::max<int64_t>(layout == quant::LAYOUT_N ? unit : wide, (per_chunk + unit - 1) / unit * unit);
}

// Calls below this many multiply-adds run on the calling thread: waking torch's other threads costs more than they
// save (and on a busy machine a descheduled thread delays the whole call).
constexpr int64_t kParallelMacs = int64_t{1} << 17;

template <typename F>
void for_chunks(int64_t chunks, int64_t work, const F& fn) {
  if (work < kParallelMacs) {
    for (int64_t c = 0; c < chunks; ++c) fn(c);
  } else {
    dynamic_for(chunks, fn);
  }
}

// An uninitialised byte tensor for a packed weight. On Linux, weights of 2 MiB and more get their own anonymous mapping
// that starts on a 2 MiB boundary and asks for transparent huge pages (MADV_HUGEPAGE: the kernel's default `madvise`
// mode gives them only to regions that ask): every whole 2 MiB of it then takes one TLB entry instead of 512, and a
// weight streamed from memory crosses a page boundary every 2 MiB instead of every 4 KiB. The tail beyond the last
// whole 2 MiB stays in 4 KiB pages, so the resident size is the tensor's. Measured on a 2-core AMD EPYC Zen 4 VM, 2
// threads, 40 random Q4_K weights of 8192 x 2048 called in turn from DRAM, the same packed bytes in both kinds of
// pages in one process, medians of 10 interleaved passes, either kind allocated first: one row 35.0 / 36.9 -> 38.8 /
// 39.8 GB/s, four rows 28.5 / 31.0 -> 33.2 / 35.2 (docs/PERFORMANCE.md). Elsewhere, or where the mapping fails:
// at::empty.
at::Tensor weight_bytes(int64_t nbytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr int64_t kHuge = int64_t{2} << 20;
  if (nbytes >= kHuge) {
    const size_t span = static_cast<size_t>(nbytes + kHuge);  // room to move the start to a 2 MiB boundary
    void* base = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base != MAP_FAILED) {
      const uintptr_t start = reinterpret_cast<uintptr_t>(base);
      const uintptr_t aligned = (start + kHuge - 1) & ~static_cast<uintptr_t>(kHuge - 1);
      const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));  // munmap takes whole pages (64 KiB on some)
      const size_t length = (static_cast<size_t>(nbytes) + page - 1) / page * page;
      if (aligned > start) munmap(base, aligned - start);
      const uintptr_t end = aligned + length, span_end = start + span;
      if (span_end > end) munmap(reinterpret_cast<void*>(end), span_end - end);
      void* data = reinterpret_cast<void*>(aligned);
      madvise(data, length, MADV_HUGEPAGE);  // a hint: where the kernel says no, the pages stay 4 KiB
      return at::from_blob(
          data, {nbytes}, [length](void* p) { munmap(p, length); }, at::TensorOptions().dtype(at::kByte));
    }
  }
#endif
  return at::empty({nbytes}, at::kByte);
}

// ------------------------------------------------------------------------------------------------ ops
at::Tensor repack(const at::Tensor& raw, const std::string& type, int64_t n, int64_t k, const std::string& numerics) {
  const char* op = "eagle::repack";
  const TypeInfo& t = checked_type(type, op);
  const Layout layout = layout_for(t, numerics, op);
  check_bytes_tensor(raw, "the GGUF blocks", op);
  check_shape(t, n, k, op);
  const int64_t native = quant::native_row_bytes(t, k);
  TORCH_CHECK_VALUE(raw.numel() == n * native, op, ": ", t.name, " blocks of N=", n, ", K=", k, " take ", n * native,
              " bytes (", native, " per row), the tensor holds ", raw.numel());
  const int64_t payload = quant::payload_bytes(t, layout, n, k);
  // not zeroed here: each work chunk zeroes the bytes it writes, so the pages are first touched on every thread
  at::Tensor out = weight_bytes(quant::kHeaderBytes + payload);
  Header h{};
  h.magic = quant::kMagic;
  h.version = quant::kVersion;
  h.type = t.type;
  h.layout = layout;
  h.n = n;
  h.k = k;
  h.payload_bytes = payload;
  uint8_t* dst = out.data_ptr<uint8_t>();
  std::memset(dst, 0, quant::kHeaderBytes);
  std::memcpy(dst, &h, sizeof(h));
  dst += quant::kHeaderBytes;
  const uint8_t* src = raw.data_ptr<uint8_t>();
  if (quant::is_float_type(t)) {
    std::memcpy(dst, src, payload);
    return out;
  }
  const int64_t row_bytes = quant::packed_row_bytes(t, k);
  const int64_t lanes = layout == quant::LAYOUT_N ? quant::kColumnsPerGroup : 1;
  const int64_t groups = (n + lanes - 1) / lanes;
  // groups per work chunk: about 1 MiB of packed bytes, so that a chunk's scratch is reused and few chunks are claimed
  const int64_t per_chunk = std::max<int64_t>(1, (int64_t{1} << 20) / (lanes * row_bytes));
  for_chunks((groups + per_chunk - 1) / per_chunk, n * k, [&](int64_t chunk) {
    // canonical columns of a group: codes (k), fp16 d / m (k / 32 each), scales / mins (k / 16 each)
    std::vector<uint8_t> codes(lanes * k), sc(lanes * k / 16 + 1), mn(lanes * k / 16 + 1);
    std::vector<uint16_t> d(lanes * (k / 32 + 1)), m(lanes * (k / 32 + 1));
    std::vector<quant::Column> cols(lanes);
    for (int64_t g = chunk * per_chunk; g < std::min(groups, (chunk + 1) * per_chunk); ++g) {
      std::vector<const quant::Column*> ptrs(lanes, nullptr);
      for (int64_t j = 0; j < lanes && g * lanes + j < n; ++j) {
        cols[j] = {codes.data() + j * k, d.data() + j * (k / 32 + 1), m.data() + j * (k / 32 + 1),
                   sc.data() + j * (k / 16), mn.data() + j * (k / 16)};
        quant::native_to_column(t, src + (g * lanes + j) * native, k, cols[j]);
        ptrs[j] = &cols[j];
      }
      uint8_t* group_out = dst + g * lanes * row_bytes;
      std::memset(group_out, 0, lanes * row_bytes);
      if (layout == quant::LAYOUT_K) {
        quant::column_to_k(t, cols[0], k, group_out);
      } else {
        quant::columns_to_n(t, ptrs.data(), k, group_out);
      }
    }
  });
  return out;
}

int64_t packed_nbytes(const std::string& type, int64_t n, int64_t k, const std::string& numerics) {
  const TypeInfo& t = checked_type(type, "eagle::packed_nbytes");
  check_shape(t, n, k, "eagle::packed_nbytes");
  return quant::kHeaderBytes + quant::payload_bytes(t, layout_for(t, numerics, "eagle::packed_nbytes"), n, k);
}

// the int8 activation quantizer of an instruction set (all three give the same bits)
void quantize_rows_with(Isa isa, const float* x, int64_t m, quant::QuantizedRows& rows) {
  if (isa == ISA_AVX512) {
    quant::quantize_rows_avx512(x, 0, m, rows);
  } else if (isa == ISA_AVX2) {
    quant::quantize_rows_avx2(x, 0, m, rows);
  } else {
    quant::quantize_rows_portable(x, 0, m, rows);
  }
}

std::vector<at::Tensor> quantize_rows_op(const at::Tensor& x_in) {
  const char* op = "eagle::quantize_rows";
  TORCH_CHECK_VALUE(x_in.dim() == 2, op, ": x must have shape (M, K), got ", x_in.sizes());
  const at::Tensor x = check_rows(x_in, x_in.size(1), op);
  const int64_t m = x.size(0), k = x.size(1);
  TORCH_CHECK_VALUE(k % 32 == 0 && k > 0, op, ": K=", k, " is not a positive multiple of 32");
  at::Tensor q = at::empty({m, k}, at::kChar), d = at::empty({m, k / 32}, at::kFloat);
  at::Tensor s = at::empty({m, k / 32}, at::kFloat), sum16 = at::empty({m, k / 16}, at::kInt);
  quant::QuantizedRows rows{m, k, q.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(),
                            sum16.data_ptr<int32_t>()};
  quantize_rows_with(current_isa(), x.data_ptr<float>(), m, rows);
  return {q, d, s, sum16};
}

using Kernel = bool (*)(const quant::LinearArgs&, int64_t, int64_t, float*);

Kernel kernel_for(Layout layout, Isa isa) {
  if (layout == quant::LAYOUT_K)
    return isa == ISA_AVX512 ? quant::linear_k_avx512
           : isa == ISA_AVX2 ? quant::linear_k_avx2 : quant::linear_k_portable;
  return isa == ISA_AVX512 ? quant::linear_n_avx512
         : isa == ISA_AVX2 ? quant::linear_n_avx2 : quant::linear_n_portable;
}

// One weight of a call, checked, with its output allocated and its work split in chunks of columns.
struct Prepared {
  const TypeInfo* t;
  Layout layout;
  quant::LinearArgs args;
  at::Tensor y;
  int64_t width, chunks;
};

// The weight's checks (its type, header, byte count and layout for `numerics`); returns its layout.
Layout check_weight(const TypeInfo& t, const at::Tensor& weight, int64_t n, int64_t k, const std::string& numerics,
                    const char* op) {
  const Layout wanted = layout_for(t, numerics, op);
  const Layout layout = check_packed(weight, t, n, k, op);
  TORCH_CHECK_VALUE(layout == wanted, op, ": the weight was packed for ",
              layout == quant::LAYOUT_N ? "int8" : "float32", " numerics, the call asks for ", numerics,
              ": repack it with numerics='", numerics, "'");
  return layout;
}

// x: checked rows (M, K); the weight checked by check_weight, whose layout is `layout`.
Prepared prepare(const at::Tensor& x, const TypeInfo& t, Layout layout, const LinearSpec& w, const char* op) {
  const int64_t n = w.n, k = x.size(1);
  const float* bias_ptr = nullptr;
  if (w.bias != nullptr && w.bias->has_value() && (*w.bias)->defined()) {
    const at::Tensor& bias = **w.bias;
    TORCH_CHECK_VALUE(bias.device().is_cpu() && bias.scalar_type() == at::kFloat && bias.dim() == 1 &&
                    bias.size(0) == n && bias.is_contiguous(),
                op, ": bias must be a contiguous float32 CPU tensor of shape (", n, "), got ", bias.scalar_type(),
                " ", bias.sizes());
    bias_ptr = bias.data_ptr<float>();
  }
  const int64_t m = x.size(0);
  at::Tensor y = at::empty({m, n}, at::kFloat);
  const int64_t width = chunk_columns(layout, n, m);
  quant::LinearArgs args{&t, w.weight->data_ptr<uint8_t>() + quant::kHeaderBytes, n, k, m, x.data_ptr<float>(),
                         nullptr, bias_ptr, y.data_ptr<float>()};
  return {&t, layout, args, y, width, (n + width - 1) / width};
}

// The int8 activations of a call's rows x (M, K), made once for all its weights: quantized at the first weight that
// takes int8 activations and, on AVX-512, interleaved for the row tiles of each weight type met (the layout follows
// the type), instead of once per work chunk.
class Int8Rows {
 public:
  Int8Rows(const at::Tensor& x, Isa isa) : x_(x), isa_(isa) {}

  const quant::QuantizedRows* rows() {
    if (rows_.q == nullptr) {
      const int64_t m = x_.size(0), k = x_.size(1);
      q_.resize(m * k);
      d_.resize(m * k / 32);
      s_.resize(m * k / 32);
      sum16_.resize(m * k / 16);
      rows_ = {m, k, q_.data(), d_.data(), s_.data(), sum16_.data()};
      quantize_rows_with(isa_, x_.data_ptr<float>(), m, rows_);
    }
    return &rows_;
  }

  // the rows laid out for the AVX-512 tiles of a weight of type t; nullptr on the other instruction sets, whose
  // kernels read the quantized rows as they are
  const uint8_t* interleaved(const TypeInfo& t) {
    if (isa_ != ISA_AVX512) return nullptr;
    std::vector<uint8_t>& buffer = interleaved_[t.type];
    if (buffer.empty()) {
      const quant::QuantizedRows& xq = *rows();
      buffer.resize(xq.rows * quant::interleaved_row_bytes(xq.k));
      if (!quant::interleave_rows_avx512(t, xq, buffer.data())) {
        buffer.clear();  // not laid out: a second weight of this type must not get unwritten bytes
        return nullptr;
      }
    }
    return buffer.data();
  }

 private:
  const at::Tensor& x_;
  Isa isa_;
  std::vector<int8_t> q_;
  std::vector<float> d_, s_;
  std::vector<int32_t> sum16_;
  quant::QuantizedRows rows_{};
  std::map<int32_t, std::vector<uint8_t>> interleaved_;  // per weight type
};

// Computes every prepared weight over the same rows x in one parallel region (its chunks after one another), with
// x quantized (and interleaved) once when a weight takes int8 activations.
void run_prepared(std::vector<Prepared>& calls, const at::Tensor& x, const char* op) {
  const int64_t m = x.size(0), k = x.size(1);
  if (m == 0) return;
  const Isa isa = current_isa();
  Int8Rows int8(x, isa);
  int64_t total = 0, work = 0, scratch = 0;
  std::vector<int64_t> first(calls.size() + 1, 0);
  for (size_t i = 0; i < calls.size(); ++i) {
    if (calls[i].layout == quant::LAYOUT_N) {
      calls[i].args.xq = int8.rows();
      calls[i].args.xn = int8.interleaved(*calls[i].t);
    }
    first[i + 1] = total += calls[i].chunks;
    work += m * calls[i].args.n * k;
    scratch = std::max<int64_t>(scratch, quant::scratch_floats(*calls[i].t, k));
  }
  std::atomic<int> unhandled{-1};
  for_chunks(total, work, [&](int64_t c) {
    size_t i = 0;
    while (c >= first[i + 1]) ++i;
    const Prepared& p = calls[i];
    const int64_t begin = (c - first[i]) * p.width, end = std::min(p.args.n, begin + p.width);
    if (!kernel_for(p.layout, isa)(p.args, begin, end, thread_scratch(scratch))) unhandled.store(static_cast<int>(i));
  });
  TORCH_CHECK(unhandled.load() < 0, op, ": no ", isa_name(isa), " kernel for ",
              calls[std::max(0, unhandled.load())].t->name, " weights");
}

at::Tensor quant_linear(const at::Tensor& x_in, const at::Tensor& weight, const std::string& type, int64_t n,
                        int64_t k, const std::optional<at::Tensor>& bias, const std::string& numerics) {
  const char* op = "eagle::quant_linear";
  const TypeInfo& t = checked_type(type, op);  // the weight's checks before the input's, as always
  const Layout layout = check_weight(t, weight, n, k, numerics, op);
  const at::Tensor x = check_rows(x_in, k, op);
  std::vector<Prepared> calls{prepare(x, t, layout, LinearSpec{&weight, &type, n, &bias}, op)};
  run_prepared(calls, x, op);
  return calls[0].y;
}

// Decodes column n of a packed weight into w[K] float32 (what the float32 model holds).
void decode_column(const TypeInfo& t, Layout layout, const uint8_t* payload, int64_t n, int64_t k, float* scratch,
                   float* w) {
  const int64_t row_bytes = quant::packed_row_bytes(t, k);
  if (quant::is_float_type(t)) {
    quant::float_row_weights(t, payload + n * row_bytes, k, w);
    return;
  }
  const int64_t groups = k / t.group;
  float* a = scratch;
  float* b = a + groups;
  auto* bytes = reinterpret_cast<uint8_t*>(b + groups);
  auto* halves = reinterpret_cast<uint16_t*>(bytes + (k + 2 * groups + 1) / 2 * 2);
  quant::Column c{bytes, halves, halves + k / 16 + 1, bytes + k, bytes + k + groups};
  if (layout == quant::LAYOUT_K) {
    quant::k_to_column(t, payload + n * row_bytes, k, c);
  } else {
    const int64_t group_bytes = quant::kColumnsPerGroup * row_bytes;
    quant::n_to_column(t, payload + n / quant::kColumnsPerGroup * group_bytes,
                       static_cast<int>(n % quant::kColumnsPerGroup), k, c);
  }
  quant::column_params(t, c, k, a, b);
  quant::column_weights(t, c, k, a, b, w);
}

at::Tensor dequantize(const at::Tensor& weight, const std::string& type, int64_t n, int64_t k) {
  const char* op = "eagle::dequantize";
  const TypeInfo& t = checked_type(type, op);
  const Layout layout = check_packed(weight, t, n, k, op);
  at::Tensor out = at::empty({n, k}, at::kFloat);
  const uint8_t* payload = weight.data_ptr<uint8_t>() + quant::kHeaderBytes;
  float* dst = out.data_ptr<float>();
  const int64_t scratch = quant::scratch_floats(t, k);
  for_chunks(n, n * k, [&](int64_t c) { decode_column(t, layout, payload, c, k, thread_scratch(scratch), dst + c * k); });
  return out;
}

at::Tensor quant_embedding(const at::Tensor& ids, const at::Tensor& weight, const std::string& type, int64_t n,
                           int64_t k) {
  const char* op = "eagle::quant_embedding";
  const TypeInfo& t = checked_type(type, op);
  const Layout layout = check_packed(weight, t, n, k, op);
  TORCH_CHECK_TYPE(ids.device().is_cpu() && ids.scalar_type() == at::kLong, op, ": ids must be an int64 CPU tensor, got ",
              ids.scalar_type(), " on ", ids.device());
  const at::Tensor flat = ids.contiguous().reshape({-1});
  const int64_t* id = flat.data_ptr<int64_t>();
  const int64_t count = flat.numel();
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK_INDEX(id[i] >= 0 && id[i] < n, op, ": token id ", id[i], " is out of range for a table of ", n, " rows");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, at::kFloat);
  const uint8_t* payload = weight.data_ptr<uint8_t>() + quant::kHeaderBytes;
  float* dst = out.data_ptr<float>();
  const int64_t scratch = quant::scratch_floats(t, k);
  for_chunks(count, count * k * 64, [&](int64_t i) {
    decode_column(t, layout, payload, id[i], k, thread_scratch(scratch), dst + i * k);
  });
  return out;
}

// The types of quant::kTypes: names, ggml type ids, elements and bytes per GGUF block.
std::tuple<std::vector<std::string>, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>> quant_types() {
  std::vector<int64_t> ids, elements, bytes;
  for (const TypeInfo& t : quant::kTypes) {
    ids.push_back(t.type);
    elements.push_back(t.unit);
    bytes.push_back(t.native_bytes);
  }
  return {type_names(), ids, elements, bytes};
}

// ------------------------------------------------------------------------------------------------ read bandwidth
// The machine's read bandwidth as the kernels see it: an nbytes buffer (allocated and written here, meant to be
// larger than the last-level cache) is read whole and summed, split in chunks of kReadChunkBytes that `threads` of
// torch's intra-op threads claim through dynamic_for (the kernels' pool and work splitting); GB/s (1e9 bytes per
// second) of the fastest of `passes` reads. torch's thread count is set to `threads` for the measurement and then
// restored.
constexpr int64_t kReadChunkBytes = int64_t{1} << 18;
volatile uint64_t read_sink = 0;

uint64_t sum_words(const uint64_t* p, int64_t words) {
  uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0, s4 = 0, s5 = 0, s6 = 0, s7 = 0;
  int64_t i = 0;
  for (; i + 8 <= words; i += 8) {
    s0 += p[i]; s1 += p[i + 1]; s2 += p[i + 2]; s3 += p[i + 3];
    s4 += p[i + 4]; s5 += p[i + 5]; s6 += p[i + 6]; s7 += p[i + 7];
  }
  for (; i < words; ++i) s0 += p[i];
  return s0 + s1 + s2 + s3 + s4 + s5 + s6 + s7;
}

double read_bandwidth(int64_t nbytes, int64_t threads, int64_t passes) {
  const char* op = "eagle::read_bandwidth";
  TORCH_CHECK_VALUE(nbytes >= kReadChunkBytes, op, ": nbytes must be at least ", kReadChunkBytes, ", got ", nbytes);
  TORCH_CHECK_VALUE(threads >= 1, op, ": threads must be positive, got ", threads);
  TORCH_CHECK_VALUE(passes >= 1, op, ": passes must be positive, got ", passes);
  const int64_t chunks = nbytes / kReadChunkBytes, words = kReadChunkBytes / 8;
  at::Tensor buffer = at::empty({chunks * words}, at::kLong);
  uint64_t* data = reinterpret_cast<uint64_t*>(buffer.data_ptr<int64_t>());
  const int previous = at::get_num_threads();
  at::set_num_threads(static_cast<int>(threads));
  dynamic_for(chunks, [&](int64_t c) {  // written by the threads that read it (first touch)
    for (int64_t i = 0; i < words; ++i) data[c * words + i] = static_cast<uint64_t>(c * words + i);
  });
  double best = 0;
  std::atomic<uint64_t> total{0};
  for (int64_t pass = 0; pass < passes; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    dynamic_for(chunks, [&](int64_t c) { total.fetch_add(sum_words(data + c * words, words), std::memory_order_relaxed); });
    const std::chrono::duration<double> seconds = std::chrono::steady_clock::now() - start;
    best = std::max(best, static_cast<double>(chunks * kReadChunkBytes) / seconds.count() / 1e9);
  }
  at::set_num_threads(previous);
  read_sink = total.load();  // keeps the sums, and so the reads, alive
  return best;
}

}  // namespace

at::Tensor quant_linear_call(const at::Tensor& x, const at::Tensor& weight, const std::string& type, int64_t n,
                             int64_t k, const std::optional<at::Tensor>& bias, const std::string& numerics) {
  return quant_linear(x, weight, type, n, k, bias, numerics);
}

std::vector<at::Tensor> quant_linear_group_call(const at::Tensor& x_in, const std::vector<LinearSpec>& weights,
                                                const std::string& numerics) {
  const char* op = "eagle::quant_linear";
  TORCH_CHECK_VALUE(x_in.dim() == 2, op, ": x must have shape (M, K), got ", x_in.sizes());
  const at::Tensor x = check_rows(x_in, x_in.size(1), op);
  std::vector<Prepared> calls;
  for (const LinearSpec& w : weights) {
    const TypeInfo& t = checked_type(*w.type, op);
    calls.push_back(prepare(x, t, check_weight(t, *w.weight, w.n, x.size(1), numerics, op), w, op));
  }
  run_prepared(calls, x, op);
  std::vector<at::Tensor> out;
  for (const Prepared& p : calls) out.push_back(p.y);
  return out;
}

TORCH_LIBRARY(eagle, m) {
  m.def("repack(Tensor raw, str type, int n, int k, str numerics='float32') -> Tensor", &repack);
  m.def("packed_nbytes(str type, int n, int k, str numerics='float32') -> int", &packed_nbytes);
  m.def("quant_linear(Tensor x, Tensor weight, str type, int n, int k, Tensor? bias=None, "
        "str numerics='float32') -> Tensor", &quant_linear);
  m.def("dequantize(Tensor weight, str type, int n, int k) -> Tensor", &dequantize);
  m.def("quant_embedding(Tensor ids, Tensor weight, str type, int n, int k) -> Tensor", &quant_embedding);
  m.def("quantize_rows(Tensor x) -> Tensor[]", &quantize_rows_op);
  m.def("quant_types() -> (str[], int[], int[], int[])", &quant_types);
  m.def("read_bandwidth(int nbytes, int threads, int passes=5) -> float", &read_bandwidth);
}

}  // namespace eagle

// A Python module, so that `import eagle._kernels` loads the library (and registers the ops above).
static PyModuleDef kernels_module = {PyModuleDef_HEAD_INIT, "_kernels",
                                     "eagle's native CPU kernels; the ops live in torch.ops.eagle", -1, nullptr};
PyMODINIT_FUNC PyInit__kernels(void) { return PyModule_Create(&kernels_module); }
