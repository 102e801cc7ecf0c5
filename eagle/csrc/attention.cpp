// Position-ordered, batch-invariant attention on the CPU (ops eagle::tree_attention, eagle::visible_keys).
//
// Each query walks its visible keys in slot order (scores, the exact maximum, then the exponential sum and the
// weighted values in that order; attention_kernels.h gives the fixed lane structure). Its output depends only on its
// q row and its visible keys' rows, so a tree node's attention in a verification forward is bit-identical to the
// same token's attention in plain decoding, whatever T, B, the query's place in the call, the masked slots between
// its keys or the thread count. The AVX-512, AVX2 and portable paths compute the same bits; a call runs the
// extension's instruction set (isa.h: EAGLE_KERNELS_ISA, eagle::set_kernel_isa), or the one its `isa` names.
//
// The visible keys are given as lists (CSR): for query t of mask row b, indices[offsets[b * T + t] ..
// offsets[b * T + t + 1]) are its visible slots, strictly ascending, shared by all heads (and by all layers of one
// forward: eagle::visible_keys builds them once from a boolean or additive mask).
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_kernels.h"
#include "isa.h"
#include "ops.h"
#include "parallel.h"

namespace eagle {
namespace {

namespace kern = attention_kernels;

struct Kernels {
  void (*scores)(const kern::QueryJob*, int, int, int64_t, kern::Rows, const kern::ScoreParams&);
  float (*weights)(float*, int64_t, const float*);
  void (*values)(const kern::QueryJob*, int, int, kern::Rows, int64_t);
};

// the kernels of an instruction set (isa.h; all compute the same bits): the portable ones where this build has no
// x86 paths
Kernels kernels_for(Isa isa) {
#ifdef EAGLE_ATTENTION_X86
  if (isa == ISA_AVX512) return {kern::avx512::scores, kern::avx512::weights, kern::avx512::values};
  if (isa == ISA_AVX2) return {kern::avx2::scores, kern::avx2::weights, kern::avx2::values};
#endif
  (void)isa;
  return {kern::scalar::scores, kern::scalar::weights, kern::scalar::values};
}

// Everything one chunk (a query row, one key/value head, its group of query heads) reads and writes.
struct Problem {
  const float* q;
  int64_t q_stride[3];  // batch, head, position (the last dimension is contiguous)
  const float* k;
  int64_t k_stride[3];
  const float* v;
  int64_t v_stride[3];
  const int64_t* offsets;
  const int32_t* indices;
  int64_t mask_batch, batch, queries, q_heads, kv_heads, slots, value_dim;
  const float* sinks;  // (q_heads,) or nullptr
  kern::ScoreParams score;
  float* out;  // (batch, queries, q_heads, value_dim), contiguous
  int64_t query_blocks;  // the queries of one (batch row, key/value head) are split into this many chunks
};

// Refuses a visible-key list that is not strictly ascending within [0, slots) before anything reads through it.
void check_visible(const int32_t* idx, int64_t n, int64_t slots, int64_t b, int64_t t) {
  int64_t previous = -1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = idx[i];
    TORCH_CHECK(slot > previous && slot < slots, "tree_attention: the visible keys of query (batch ", b,
                ", position ", t, ") must be strictly ascending slots in [0, ", slots, "); entry ", i, " is ", slot,
                i > 0 ? " after " + std::to_string(previous) : std::string());
    previous = slot;
  }
}

// The queries [t0, t1) of one chunk (queries of a block share the key rows they have in common).
void query_range(const Problem& P, int64_t block, int64_t* t0, int64_t* t1) {
  *t0 = block * P.queries / P.query_blocks;
  *t1 = (block + 1) * P.queries / P.query_blocks;
}

// One chunk: a block of queries of batch row b, the query heads of key/value head g.
void run_chunk(const Problem& P, const Kernels& K, int64_t chunk) {
  const int64_t block = chunk % P.query_blocks;
  const int64_t g = (chunk / P.query_blocks) % P.kv_heads;
  const int64_t b = chunk / (P.query_blocks * P.kv_heads);
  const int group = static_cast<int>(P.q_heads / P.kv_heads);
  const int64_t head0 = g * group;
  int64_t t0, t1;
  query_range(P, block, &t0, &t1);
  kern::QueryJob jobs[kern::kMaxJobs];
  int count = 0;
  int64_t floats = 0;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t row = (P.mask_batch == 1 ? 0 : b) * P.queries + t;
    const int64_t begin = P.offsets[row], n = P.offsets[row + 1] - begin;
    check_visible(P.indices + begin, n, P.slots, b, t);
    float* out = P.out + ((b * P.queries + t) * P.q_heads + head0) * P.value_dim;
    if (n == 0) {  // nothing visible: zeros (the sink, if any, takes the whole weight)
      std::fill(out, out + group * P.value_dim, 0.0f);
      continue;
    }
    const int64_t stride = (n + 15) / 16 * 16;
    const float* q = P.q + b * P.q_stride[0] + head0 * P.q_stride[1] + t * P.q_stride[2];
    jobs[count++] = {q, P.indices + begin, n, nullptr, stride, nullptr, out};
    floats += group * (stride + 1);
  }
  thread_local std::vector<float> scratch;  // per job: scores (heads x stride), then l (heads)
  scratch.resize(static_cast<size_t>(floats));
  float* next = scratch.data();
  for (int j = 0; j < count; ++j) {
    jobs[j].s = next;
    jobs[j].l = next + group * jobs[j].s_stride;
    next += group * (jobs[j].s_stride + 1);
  }
  const kern::Rows keys{P.k + b * P.k_stride[0] + g * P.k_stride[1], P.k_stride[2]};
  const kern::Rows vals{P.v + b * P.v_stride[0] + g * P.v_stride[1], P.v_stride[2]};
  K.scores(jobs, count, group, P.q_stride[1], keys, P.score);
  for (int j = 0; j < count; ++j)
    for (int h = 0; h < group; ++h)
      jobs[j].l[h] = K.weights(jobs[j].s + h * jobs[j].s_stride, jobs[j].n, P.sinks ? P.sinks + head0 + h : nullptr);
  K.values(jobs, count, group, vals, P.value_dim);
}

// How many chunks the queries of one (batch row, key/value head) form: at most kMaxJobs queries each, and enough
// chunks to keep the threads busy. (The split never changes the bits: a query's arithmetic is the same in any.)
int64_t query_blocks(int64_t batch, int64_t kv_heads, int64_t queries) {
  const int64_t threads = at::get_num_threads();
  int64_t blocks = (queries + kern::kMaxJobs - 1) / kern::kMaxJobs;
  const int64_t wanted = (2 * threads + batch * kv_heads - 1) / (batch * kv_heads);
  return std::min(queries, std::max(blocks, wanted));
}

void check_tensor(const at::Tensor& x, const char* name, at::ScalarType dtype, int64_t dim, const char* layout) {
  TORCH_CHECK(x.defined(), "tree_attention: ", name, " is undefined");
  TORCH_CHECK(x.device().is_cpu(), "tree_attention: ", name, " must be a CPU tensor, got one on ", x.device());
  TORCH_CHECK(x.scalar_type() == dtype, "tree_attention: ", name, " must be ", dtype, ", got ", x.scalar_type());
  TORCH_CHECK(x.dim() == dim, "tree_attention: ", name, " must be ", layout, ", got shape ", x.sizes());
}

// Checks the CSR lists against the query count and slot count; returns the mask's batch (1 or `batch`).
int64_t check_lists(const at::Tensor& offsets, const at::Tensor& indices, int64_t batch, int64_t queries,
                    int64_t slots) {
  check_tensor(offsets, "offsets", at::kLong, 1, "1-D (mask_batch * T + 1,)");
  check_tensor(indices, "indices", at::kInt, 1, "1-D (number of visible entries,)");
  TORCH_CHECK(offsets.is_contiguous() && indices.is_contiguous(),
              "tree_attention: offsets and indices must be contiguous");
  const int64_t rows = offsets.numel() - 1;
  const int64_t mask_batch = rows / queries;
  TORCH_CHECK(rows >= 0 && rows % queries == 0 && (mask_batch == 1 || mask_batch == batch),
              "tree_attention: offsets must hold mask_batch * T + 1 entries with mask_batch 1 or B = ", batch,
              " (T = ", queries, "), got ", offsets.numel());
  const int64_t* o = offsets.data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0, "tree_attention: offsets[0] must be 0, got ", o[0]);
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(o[r + 1] >= o[r] && o[r + 1] - o[r] <= slots, "tree_attention: offsets must be non-decreasing with "
                "at most S = ", slots, " keys per query; row ", r, " spans [", o[r], ", ", o[r + 1], ")");
  TORCH_CHECK(o[rows] == indices.numel(), "tree_attention: offsets[-1] = ", o[rows], " but indices holds ",
              indices.numel(), " entries");
  return mask_batch;
}

at::Tensor last_dim_contiguous(const at::Tensor& x) { return x.stride(3) == 1 ? x : x.contiguous(); }

at::Tensor tree_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                          const at::Tensor& offsets, const at::Tensor& indices, double scale,
                          const std::optional<at::Tensor>& sinks_in, std::optional<double> softcap,
                          const std::optional<std::string>& isa) {
  check_tensor(q_in, "q", at::kFloat, 4, "(B, Hq, T, D)");
  check_tensor(k_in, "k", at::kFloat, 4, "(B, Hkv, S, D)");
  check_tensor(v_in, "v", at::kFloat, 4, "(B, Hkv, S, Dv)");
  TORCH_CHECK(!(at::GradMode::is_enabled() && (q_in.requires_grad() || k_in.requires_grad() || v_in.requires_grad())),
              "tree_attention has no backward; call it under torch.no_grad() or torch.inference_mode()");
  const int64_t B = q_in.size(0), Hq = q_in.size(1), T = q_in.size(2), D = q_in.size(3);
  const int64_t Hkv = k_in.size(1), S = k_in.size(2), Dv = v_in.size(3);
  TORCH_CHECK(k_in.size(0) == B && v_in.size(0) == B, "tree_attention: q, k and v must have the same batch; got ",
              q_in.sizes(), ", ", k_in.sizes(), ", ", v_in.sizes());
  TORCH_CHECK(Hkv >= 1 && Hq % Hkv == 0 && v_in.size(1) == Hkv, "tree_attention: k and v must have the same number of "
              "heads Hkv >= 1, dividing q's Hq; got q ", q_in.sizes(), ", k ", k_in.sizes(), ", v ", v_in.sizes());
  TORCH_CHECK(v_in.size(2) == S && k_in.size(3) == D && D >= 1 && Dv >= 1, "tree_attention: k must be (B, Hkv, S, D) "
              "and v (B, Hkv, S, Dv) with q's D; got q ", q_in.sizes(), ", k ", k_in.sizes(), ", v ", v_in.sizes());
  TORCH_CHECK(S <= INT32_MAX, "tree_attention: at most 2^31 - 1 key slots, got ", S);
  TORCH_CHECK(std::isfinite(scale), "tree_attention: scale must be finite, got ", scale);
  TORCH_CHECK(!softcap || (std::isfinite(*softcap) && *softcap > 0), "tree_attention: softcap must be a positive "
              "finite number or None, got ", softcap.value_or(0.0));
  at::Tensor out = at::empty({B, T, Hq, Dv}, q_in.options());
  if (B == 0 || T == 0 || Hq == 0) return out;
  const int64_t mask_batch = check_lists(offsets, indices, B, T, S);
  at::Tensor sinks;
  if (sinks_in && sinks_in->defined()) {
    check_tensor(*sinks_in, "sinks", at::kFloat, 1, "(Hq,)");
    TORCH_CHECK(sinks_in->numel() == Hq, "tree_attention: sinks must have Hq = ", Hq, " entries, got ",
                sinks_in->numel());
    sinks = sinks_in->contiguous();
  }
  const at::Tensor q = last_dim_contiguous(q_in), k = last_dim_contiguous(k_in), v = last_dim_contiguous(v_in);
  Problem P{q.data_ptr<float>(), {q.stride(0), q.stride(1), q.stride(2)},
            k.data_ptr<float>(), {k.stride(0), k.stride(1), k.stride(2)},
            v.data_ptr<float>(), {v.stride(0), v.stride(1), v.stride(2)},
            offsets.data_ptr<int64_t>(), indices.data_ptr<int32_t>(),
            mask_batch, B, T, Hq, Hkv, S, Dv,
            sinks.defined() ? sinks.data_ptr<float>() : nullptr,
            {D, static_cast<float>(scale), softcap.has_value(), static_cast<float>(softcap.value_or(1.0))},
            out.data_ptr<float>(), query_blocks(B, Hkv, T)};
  const Kernels K = kernels_for(isa ? parse_isa(*isa, "tree_attention") : current_isa());
  const int64_t chunks = B * Hkv * P.query_blocks;
  // Below ~this many multiply-adds, waking a second thread costs more than it saves (threads never change bits).
  constexpr int64_t kSerialWork = 1 << 15;
  if (indices.numel() * (B / mask_batch) * Hq * (D + Dv) < kSerialWork) {
    for (int64_t chunk = 0; chunk < chunks; ++chunk) run_chunk(P, K, chunk);
  } else {
    dynamic_for(chunks, [&](int64_t chunk) { run_chunk(P, K, chunk); });
  }
  return out;
}

// Mask entries: bool (nonzero = visible) or additive float32 (0 visible; masked_value or -inf masked).
inline bool entry_visible(uint8_t x) { return x != 0; }
inline bool entry_visible(float x) { return x == 0.0f; }

// The number of visible slots of row p[0], p[stride], ..., p[(slots - 1) stride]; refuses an additive entry that is
// neither 0 nor masked.
template <typename E>
int64_t count_visible(const E* p, int64_t stride, int64_t slots, float masked_value, int64_t b, int64_t t) {
  int64_t count = 0;
  bool ok = true;
  for (int64_t j = 0; j < slots; ++j) {
    const E x = p[j * stride];
    count += entry_visible(x);
    if constexpr (std::is_same_v<E, float>) ok &= (x == 0.0f) | (x == masked_value) | (x == -INFINITY);
  }
  for (int64_t j = 0; !ok && j < slots; ++j) {
    const float x = static_cast<float>(p[j * stride]);
    TORCH_CHECK(x == 0.0f || x == masked_value || x == -INFINITY, "visible_keys: an additive mask may hold only 0 "
                "(visible) and ", masked_value, " or -inf (masked); entry [", b, ", ", t, ", ", j, "] is ", x,
                " (masks that add a bias to the scores are not supported)");
  }
  return count;
}

// Writes the visible slots of a row, ascending, to out (branch-free up to the last visible slot: each slot is
// written at the current count, which advances on the visible ones, so no write lands past the row's count).
template <typename E>
void fill_visible(const E* p, int64_t stride, int64_t slots, int32_t* out) {
  int64_t last = slots - 1;
  while (last >= 0 && !entry_visible(p[last * stride])) --last;
  int64_t c = 0;
  for (int64_t j = 0; j <= last; ++j) {
    out[c] = static_cast<int32_t>(j);
    c += entry_visible(p[j * stride]);
  }
}

template <typename E>
void mask_to_lists(const at::Tensor& mask, float masked_value, int64_t* o, at::Tensor* indices) {
  const int64_t T = mask.size(1), S = mask.size(2), rows = mask.size(0) * T, stride = mask.stride(2);
  const E* base = static_cast<const E*>(mask.data_ptr());
  auto row = [&](int64_t r) { return base + (r / T) * mask.stride(0) + (r % T) * mask.stride(1); };
  o[0] = 0;
  dynamic_for(rows, [&](int64_t r) {  // (a unit stride spelled out, so that the compiler vectorises the scan)
    o[r + 1] = stride == 1 ? count_visible(row(r), 1, S, masked_value, r / T, r % T)
                           : count_visible(row(r), stride, S, masked_value, r / T, r % T);
  });
  for (int64_t r = 0; r < rows; ++r) o[r + 1] += o[r];
  *indices = at::empty({o[rows]}, mask.options().dtype(at::kInt));
  int32_t* idx = indices->data_ptr<int32_t>();
  dynamic_for(rows, [&](int64_t r) {
    if (o[r + 1] == o[r]) return;
    stride == 1 ? fill_visible(row(r), 1, S, idx + o[r]) : fill_visible(row(r), stride, S, idx + o[r]);
  });
}

// For every (mask row b, query t): the visible slots j of mask[b, t, :], ascending, as CSR lists.
std::tuple<at::Tensor, at::Tensor> visible_keys(const at::Tensor& mask, double masked_value) {
  TORCH_CHECK(mask.defined() && mask.device().is_cpu(), "visible_keys: the mask must be a CPU tensor");
  TORCH_CHECK(mask.dim() == 3, "visible_keys: the mask must be (B, T, S), got shape ", mask.sizes());
  TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kFloat,
              "visible_keys: the mask must be bool (True = visible) or float32 (additive), got ", mask.scalar_type());
  TORCH_CHECK(mask.size(2) <= INT32_MAX, "visible_keys: at most 2^31 - 1 key slots, got ", mask.size(2));
  at::Tensor offsets = at::empty({mask.size(0) * mask.size(1) + 1}, mask.options().dtype(at::kLong));
  at::Tensor indices;
  if (mask.scalar_type() == at::kBool) {
    mask_to_lists<uint8_t>(mask, 0.0f, offsets.data_ptr<int64_t>(), &indices);
  } else {
    mask_to_lists<float>(mask, static_cast<float>(masked_value), offsets.data_ptr<int64_t>(), &indices);
  }
  return {offsets, indices};
}

}  // namespace

at::Tensor tree_attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& offsets, const at::Tensor& indices, double scale) {
  return tree_attention(q, k, v, offsets, indices, scale, std::nullopt, std::nullopt, std::nullopt);
}

}  // namespace eagle

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("tree_attention(Tensor q, Tensor k, Tensor v, Tensor offsets, Tensor indices, float scale, "
        "Tensor? sinks=None, float? softcap=None, str? isa=None) -> Tensor",
        &eagle::tree_attention);
  m.def("visible_keys(Tensor mask, float masked_value) -> (Tensor, Tensor)", &eagle::visible_keys);
}
