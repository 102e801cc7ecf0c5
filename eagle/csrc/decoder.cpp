// eagle::spec_layers: the decoder layers of a model that a LayerSpec describes (eagle/model/base/layer_spec.py:
// Llama, Mistral, Qwen2, Qwen3, Gemma 3, Qwen2-MoE, Qwen3-MoE) over the GGUF kernels, in one call.
// eagle::decoder_layers is the same layers with the Llama options (no q/k or sandwich norms, one rotary table,
// SiLU), and eagle::eagle3_layer the EAGLE-3 head's layer; all three run one layer body (project_qkv, finish_layer).
//
// Per layer, for the M = B * T rows of the call ([...]: where the layer has it):
//   n = rms_norm(x, w_in)                     one fixed summation order per row (rms_norm_row)
//   q, k, v = n W_q (+ b_q), n W_k (+ b_k), n W_v (+ b_v)          eagle::quant_linear, the three in one call
//   [q, k = rms_norm(q, w_q), rms_norm(k, w_k)]                    per head (Qwen3, Gemma 3)
//   [q, k = rotary(q), rotary(k)]             the layer's cos/sin table (none: NoPE); transformers' rotate_half
//                                             form, each product and sum rounded alone
//   cache[:, :, start : start + T] = k, v     the preallocated TreeKVCache tensors, written in place
//   a = attention(q, cache[:, :, : start + T]) over the visible-key lists of the layer's mask (eagle::tree_attention)
//   h = x + [rms_norm](a W_o, w_attn_out)     the sandwich's post-attention norm (Gemma 3)
//   n = rms_norm(h, w_ffw_in)
//   x' = h + [rms_norm]((act(n W_gate) * (n W_up)) W_down, w_ffw_out)   act: ATen's silu or tanh-approximated gelu,
//                                                                   as transformers calls them; gate and up in one
//                                                                   call
// or, for a mixture-of-experts MLP (Qwen2-MoE, Qwen3-MoE; `moe` non-empty), x' = h + moe(n):
//   p = softmax(n W_router) in float32; the top-k of p (at::topk: transformers' order and ties), divided by their
//   sum where the model renormalises; out = 0; for each expert e chosen by some row, in ascending order:
//   out[rows] += ((act(n[rows] W_gate_e) * (n[rows] W_up_e)) W_down_e) * p_top[rows, slot] (index_add_)
//   [+ sigmoid(n W_shared_gate) * (act(n W_gate) * (n W_up)) W_down: the shared expert in the dense slots]
//   the ATen calls transformers' Qwen2-MoE / Qwen3-MoE blocks make (with eagle/model/backends/gguf_experts.py's
//   kernel router and experts), in their order: a row's sum is its own experts' terms in ascending expert order.
// A norm's weight is the factor it multiplies by: Gemma's (1 + w) is computed once by the caller, in float32, as
// transformers computes it.
// Every step computes a row from that row alone (and attention from its visible keys) by a sequence of operations
// that does not depend on M, the row's place or the thread count, so the layers are row-invariant like each kernel.
// Against transformers' forward on the same weights only the RMSNorm's summation order differs (torch's reduction
// order is its own); every other step rounds as transformers' ops do.
#pragma GCC optimize("fp-contract=off")

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "ops.h"

namespace eagle {
namespace {

constexpr int kLanes = 16;
constexpr int64_t kWeights = 7;  // per layer: q, k, v, o, gate, up, down
constexpr int64_t kBiases = 3;   // per layer: q, k, v (each may be None)
constexpr int64_t kNorms = 2;    // per layer in eagle::decoder_layers: input, post-attention
constexpr int64_t kSpecNorms = 6;  // per layer in eagle::spec_layers: input, attention output, feedforward input,
                                   // feedforward output, q, k (the second, fourth, fifth and sixth may be None)
constexpr const char* kOp = "eagle::decoder_layers";
constexpr const char* kSpecOp = "eagle::spec_layers";

// w * (x * (1 / sqrt(sum(x^2) / n + eps))) for one row. Lane j sums x[16 i + j]^2 over i ascending, then the lanes
// are added in order: one sequence of roundings per row, whatever else is in the call.
void rms_norm_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  float lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) lanes[j] += x[i + j] * x[i + j];
  for (int j = 0; i + j < n; ++j) lanes[j] += x[i + j] * x[i + j];
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += lanes[j];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
  for (int64_t e = 0; e < n; ++e) y[e] = w[e] * (x[e] * inv);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  at::Tensor y = at::empty({rows, n}, x.options());
  const float *src = x.data_ptr<float>(), *weight = w.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) rms_norm_row(src + r * n, weight, n, eps, dst + r * n);
  return y;
}

// transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1). (-a) * b + p is
// p - a * b exactly, so each output is the two rounded products and one rounded sum torch computes.
void rotate_row(const float* x, const float* c, const float* s, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * c[i] - x[i + half] * s[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * c[i] + x[i - half] * s[i];
}

struct Shape {
  int64_t batch, queries, hidden, q_heads, kv_heads, head_dim, inter, capacity, start;
  int64_t rows() const { return batch * queries; }
};

struct Layer {
  const at::Tensor* weights;  // kWeights packed tensors
  const std::string* types;   // their GGUF type names
  std::optional<at::Tensor> biases[kBiases];
  const at::Tensor *norm_in, *norm_post, *keys, *values, *offsets, *indices;
  const float *cos, *sin;  // the layer's rotary table, (M, head_dim) each; nullptr: no rotary (NoPE)
  // optional norms (nullptr: none): the sandwich's attention and feedforward outputs, the per-head q and k norms
  const at::Tensor *norm_attn_out = nullptr, *norm_ffw_out = nullptr, *norm_q = nullptr, *norm_k = nullptr;
  const at::Tensor* experts = nullptr;  // Moe::weights() tensors of a mixture-of-experts layer, and their types
  const std::string* expert_types = nullptr;
};

enum class Activation { kSilu, kGeluTanh };

// A mixture-of-experts MLP (experts == 0: a dense MLP). Its weights per layer, in `Layer::experts`: the router
// (experts x hidden), each expert's gate and up rows (2 inter x hidden), each expert's down (hidden x inter), then
// the shared expert's gate (1 x hidden) where it has one (its MLP in the dense gate / up / down slots).
struct Moe {
  int64_t experts = 0, top_k = 0, inter = 0;
  bool renormalize = false, shared = false;
  int64_t weights() const { return experts == 0 ? 0 : 1 + 2 * experts + (shared ? 1 : 0); }
};

struct Call {
  Shape shape;
  float eps;
  double scale;
  std::string numerics;
  Activation activation = Activation::kSilu;
  Moe moe{};
};

at::Tensor linear(const Layer& L, int w, const at::Tensor& x, int64_t n, int64_t k, const Call& C) {
  return quant_linear_call(x, L.weights[w], L.types[w], n, k, w < kBiases ? L.biases[w] : std::nullopt,
                           C.numerics);
}

// Rotates q in place (where the layer has a rotary table) and writes the rotated k and v of every row into the cache
// slots start + t.
void rotate_and_cache(const Layer& L, const Call& C, at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const Shape& S = C.shape;
  const int64_t D = S.head_dim;
  std::vector<float> tmp(D);
  float *qp = q.data_ptr<float>(), *kc = L.keys->data_ptr<float>(), *vc = L.values->data_ptr<float>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  for (int64_t r = 0; r < S.rows(); ++r) {
    const int64_t b = r / S.queries, t = r % S.queries;
    const float *c = L.cos ? L.cos + r * D : nullptr, *s = L.sin ? L.sin + r * D : nullptr;
    for (int64_t h = 0; c != nullptr && h < S.q_heads; ++h) {
      float* row = qp + (r * S.q_heads + h) * D;
      rotate_row(row, c, s, D, tmp.data());
      std::memcpy(row, tmp.data(), D * sizeof(float));
    }
    for (int64_t g = 0; g < S.kv_heads; ++g) {
      const int64_t slot = ((b * S.kv_heads + g) * S.capacity + S.start + t) * D;
      const float* key = kp + (r * S.kv_heads + g) * D;
      if (c != nullptr) {
        rotate_row(key, c, s, D, kc + slot);
      } else {
        std::memcpy(kc + slot, key, D * sizeof(float));
      }
      std::memcpy(vc + slot, vp + (r * S.kv_heads + g) * D, D * sizeof(float));
    }
  }
}

// The per-head RMSNorm of q or k (M, heads * head_dim), each head's D values a row of its own.
at::Tensor head_norm(const at::Tensor& x, const at::Tensor& w, const Call& C) {
  return rms_norm(x.view({-1, C.shape.head_dim}), w, C.eps).view(x.sizes());
}

at::Tensor maybe_norm(const at::Tensor& x, const at::Tensor* w, const Call& C) {
  return w != nullptr ? rms_norm(x, *w, C.eps) : x;
}

std::vector<at::Tensor> project_qkv(const Layer& L, const Call& C, const at::Tensor& normed) {
  const Shape& S = C.shape;
  const int64_t qn = S.q_heads * S.head_dim, kvn = S.kv_heads * S.head_dim;
  return quant_linear_group_call(
      normed, {{&L.weights[0], &L.types[0], qn, &L.biases[0]}, {&L.weights[1], &L.types[1], kvn, &L.biases[1]},
               {&L.weights[2], &L.types[2], kvn, &L.biases[2]}}, C.numerics);
}

// (act(x W_gate) * (x W_up)) W_down over the dense slots: gate and up in one call, act and product in place.
at::Tensor dense_mlp(const Layer& L, const Call& C, const at::Tensor& x) {
  const Shape& S = C.shape;
  const std::optional<at::Tensor> none;
  std::vector<at::Tensor> gate_up = quant_linear_group_call(
      x, {{&L.weights[4], &L.types[4], S.inter, &none}, {&L.weights[5], &L.types[5], S.inter, &none}}, C.numerics);
  at::Tensor& gate = gate_up[0];
  if (C.activation == Activation::kGeluTanh) {
    at::gelu_(gate, "tanh");
  } else {
    at::silu_(gate);
  }
  gate.mul_(gate_up[1]);
  return linear(L, 6, gate, S.hidden, S.inter, C);
}

at::Tensor expert_linear(const Layer& L, const Call& C, int64_t w, const at::Tensor& x, int64_t n, int64_t k) {
  return quant_linear_call(x, L.experts[w], L.expert_types[w], n, k, std::nullopt, C.numerics);
}

// Expert e's gated MLP over the rows x[rows] (as KernelExperts computes it: gate and up in one weight, split).
at::Tensor expert_mlp(const Layer& L, const Call& C, int64_t e, const at::Tensor& x) {
  const Moe& E = C.moe;
  const std::vector<at::Tensor> gate_up = expert_linear(L, C, 1 + e, x, 2 * E.inter, C.shape.hidden).chunk(2, -1);
  const at::Tensor act = C.activation == Activation::kGeluTanh ? at::gelu(gate_up[0], "tanh") : at::silu(gate_up[0]);
  return expert_linear(L, C, 1 + E.experts + e, act * gate_up[1], C.shape.hidden, E.inter);
}

// The routed experts' sum for every row, then the gated shared expert added (see the header comment).
at::Tensor moe_mlp(const Layer& L, const Call& C, const at::Tensor& x) {
  const Moe& E = C.moe;
  const int64_t M = x.size(0);
  const at::Tensor probs = at::softmax(expert_linear(L, C, 0, x, E.experts, C.shape.hidden), -1, at::kFloat);
  auto [top, chosen] = at::topk(probs, E.top_k, -1);
  if (E.renormalize) top.div_(top.sum(-1, true));
  const at::Tensor experts = chosen.contiguous();
  const int64_t* ids = experts.data_ptr<int64_t>();
  std::vector<std::vector<int64_t>> rows(E.experts), slots(E.experts);  // torch.where(chosen == e)'s order
  for (int64_t r = 0; r < M; ++r)
    for (int64_t s = 0; s < E.top_k; ++s) {
      const int64_t e = ids[r * E.top_k + s];
      if (e >= 0 && e < E.experts) {
        rows[e].push_back(r);
        slots[e].push_back(s);
      }
    }
  at::Tensor out = at::zeros_like(x);
  const auto index = [](const std::vector<int64_t>& v) {
    return at::from_blob(const_cast<int64_t*>(v.data()), {static_cast<int64_t>(v.size())}, at::kLong).clone();
  };
  for (int64_t e = 0; e < E.experts; ++e) {
    if (rows[e].empty()) continue;
    const at::Tensor r = index(rows[e]), s = index(slots[e]);
    const at::Tensor y = expert_mlp(L, C, e, x.index_select(0, r)) * top.index({r, s}).unsqueeze(1);
    out.index_add_(0, r, y);
  }
  if (!E.shared) return out;
  const at::Tensor gate = at::sigmoid(expert_linear(L, C, 1 + 2 * E.experts, x, 1, C.shape.hidden));
  return out + gate * dense_mlp(L, C, x);
}

// After q/k/v: rotary, cache write, attention, o_proj added to `residual`, then the MLP block.
at::Tensor finish_layer(const Layer& L, const Call& C, const at::Tensor& residual, std::vector<at::Tensor>& qkv) {
  const Shape& S = C.shape;
  const int64_t H = S.hidden, D = S.head_dim, qn = S.q_heads * D;
  if (L.norm_q != nullptr) qkv[0] = head_norm(qkv[0], *L.norm_q, C);
  if (L.norm_k != nullptr) qkv[1] = head_norm(qkv[1], *L.norm_k, C);
  rotate_and_cache(L, C, qkv[0], qkv[1], qkv[2]);
  const at::Tensor& q = qkv[0];
  const at::Tensor queries = q.view({S.batch, S.queries, S.q_heads, D}).permute({0, 2, 1, 3});
  const int64_t slots = S.start + S.queries;
  at::Tensor attended = tree_attention_call(queries, L.keys->narrow(2, 0, slots), L.values->narrow(2, 0, slots),
                                            *L.offsets, *L.indices, C.scale);
  at::Tensor h = at::add(residual, maybe_norm(linear(L, 3, attended.view({S.rows(), qn}), H, qn, C),
                                              L.norm_attn_out, C));
  const at::Tensor normed = rms_norm(h, *L.norm_post, C.eps);
  h.add_(maybe_norm(C.moe.experts > 0 ? moe_mlp(L, C, normed) : dense_mlp(L, C, normed), L.norm_ffw_out, C));
  return h;
}

at::Tensor run_layer(const Layer& L, const Call& C, const at::Tensor& x) {
  std::vector<at::Tensor> qkv = project_qkv(L, C, rms_norm(x, *L.norm_in, C.eps));
  return finish_layer(L, C, x, qkv);
}

void check_float(const at::Tensor& t, const char* what, at::IntArrayRef shape, const char* op = kOp) {
  TORCH_CHECK_TYPE(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat, op, ": ", what,
                   " must be a float32 CPU tensor");
  TORCH_CHECK_VALUE(t.sizes() == shape && t.is_contiguous(), op, ": ", what, " must be a contiguous tensor of shape ",
                    shape, ", got ", t.sizes(), t.is_contiguous() ? "" : " (not contiguous)");
}

Shape check_shape(const at::Tensor& hidden, at::IntArrayRef dims, at::TensorList keys, int64_t start,
                  const char* op) {
  TORCH_CHECK_VALUE(dims.size() == 4, op, ": dims must be (q_heads, kv_heads, head_dim, intermediate), got ", dims);
  TORCH_CHECK_TYPE(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.dim() == 3, op,
                   ": hidden must be a float32 CPU tensor (B, T, hidden), got ", hidden.scalar_type(), " ",
                   hidden.sizes());
  Shape S{hidden.size(0), hidden.size(1), hidden.size(2), dims[0], dims[1], dims[2], dims[3], 0, start};
  TORCH_CHECK_VALUE(S.batch >= 1 && S.queries >= 1 && S.hidden >= 1, op, ": hidden must hold at least one row, got ",
                    hidden.sizes());
  TORCH_CHECK_VALUE(S.q_heads >= 1 && S.kv_heads >= 1 && S.q_heads % S.kv_heads == 0 && S.head_dim >= 2 &&
                        S.head_dim % 2 == 0 && S.inter >= 1,
                    op, ": dims must be positive with kv_heads dividing q_heads and an even head_dim, got ", dims);
  TORCH_CHECK_VALUE(!keys.empty() && keys[0].dim() == 4, op, ": keys must be (B, kv_heads, capacity, head_dim) "
                    "tensors, one per layer");
  S.capacity = keys[0].size(2);
  TORCH_CHECK_VALUE(start >= 0 && start + S.queries <= S.capacity, op, ": ", start, " cached + ", S.queries,
                    " new positions exceed the cache's capacity of ", S.capacity);
  return S;
}

// What a call gives of every layer: the lists of eagle::spec_layers, kWeights / kBiases / kSpecNorms entries per
// layer, one key and value tensor per layer, and each layer's index into the rotary tables and mask lists.
struct LayerLists {
  at::TensorList weights;
  const std::vector<std::string>& types;
  const c10::List<std::optional<at::Tensor>>& biases;
  const c10::List<std::optional<at::Tensor>>& norms;
  at::TensorList cos, sin;
  at::IntArrayRef layer_rotary;
  at::TensorList keys, values, offsets, indices;
  at::IntArrayRef layer_masks;
  at::TensorList experts = {};  // Moe::weights() per layer of a mixture-of-experts model, and their types
  const std::vector<std::string>* expert_types = nullptr;
};

void check_lists(const LayerLists& A, int64_t layers, const Moe& moe, const char* op) {
  TORCH_CHECK_VALUE(layers >= 1 && static_cast<int64_t>(A.weights.size()) == kWeights * layers &&
                        static_cast<int64_t>(A.types.size()) == kWeights * layers &&
                        static_cast<int64_t>(A.biases.size()) == kBiases * layers &&
                        static_cast<int64_t>(A.norms.size()) == kSpecNorms * layers &&
                        static_cast<int64_t>(A.layer_rotary.size()) == layers &&
                        static_cast<int64_t>(A.keys.size()) == layers &&
                        static_cast<int64_t>(A.values.size()) == layers,
                    op, ": per layer 7 weights and types, 3 biases, 6 norms, 1 rotary index, 1 key and 1 value "
                    "tensor; got ", layers, " layers and ", A.weights.size(), ", ", A.types.size(), ", ",
                    A.biases.size(), ", ", A.norms.size(), ", ", A.layer_rotary.size(), ", ", A.keys.size(), ", ",
                    A.values.size());
  TORCH_CHECK_VALUE(!A.offsets.empty() && A.offsets.size() == A.indices.size(), op,
                    ": offsets and indices must be lists of the same length >= 1");
  const int64_t expert_types = A.expert_types ? static_cast<int64_t>(A.expert_types->size()) : 0;
  TORCH_CHECK_VALUE(static_cast<int64_t>(A.experts.size()) == moe.weights() * layers && expert_types ==
                        moe.weights() * layers, op, ": per layer ", moe.weights(), " expert weights and types (the "
                    "router, gate-up and down per expert, the shared expert's gate), got ", A.experts.size(), " and ",
                    expert_types, " for ", layers, " layers");
  TORCH_CHECK_VALUE(A.cos.size() == A.sin.size(), op, ": cos and sin must be lists of the same length");
}

// Layer i's norms (its kSpecNorms entries of A.norms, held in `held`), checked; the first and third are required.
void bind_norms(Layer& L, const LayerLists& A, int64_t i, const Shape& S, std::optional<at::Tensor>* held,
                const char* op) {
  static const char* const kWhat[kSpecNorms] = {"an input norm weight", "an attention output norm weight",
                                                "a post-attention norm weight", "a feedforward output norm weight",
                                                "a q norm weight", "a k norm weight"};
  const at::Tensor* bound[kSpecNorms] = {};
  for (int64_t j = 0; j < kSpecNorms; ++j) {
    held[j] = A.norms.get(kSpecNorms * i + j);
    TORCH_CHECK_VALUE(held[j].has_value() || (j != 0 && j != 2), op, ": layer ", i, " lacks ", kWhat[j]);
    if (!held[j].has_value()) continue;
    check_float(*held[j], kWhat[j], {j < 4 ? S.hidden : S.head_dim}, op);
    bound[j] = &*held[j];
  }
  L.norm_in = bound[0];
  L.norm_attn_out = bound[1];
  L.norm_post = bound[2];
  L.norm_ffw_out = bound[3];
  L.norm_q = bound[4];
  L.norm_k = bound[5];
}

// Every rotary table of a call, checked once (the layers bind them by index): (B, T, head_dim) float32 each.
void check_tables(const LayerLists& A, const Shape& S, const char* op) {
  for (size_t r = 0; r < A.cos.size(); ++r) {
    check_float(A.cos[r], "cos", {S.batch, S.queries, S.head_dim}, op);
    check_float(A.sin[r], "sin", {S.batch, S.queries, S.head_dim}, op);
  }
}

// Layer i's rotary table (checked by check_tables): the entry of A.cos / A.sin that A.layer_rotary names, or none
// for -1.
void bind_rotary(Layer& L, const LayerLists& A, int64_t i, const char* op) {
  const int64_t r = A.layer_rotary[i];
  TORCH_CHECK_VALUE(r >= -1 && r < static_cast<int64_t>(A.cos.size()), op, ": layer ", i, " names rotary table ", r,
                    " of ", A.cos.size());
  if (r < 0) return;
  L.cos = A.cos[r].data_ptr<float>();
  L.sin = A.sin[r].data_ptr<float>();
}

std::vector<at::Tensor> run_layers(const at::Tensor& hidden, const LayerLists& A, const Shape& S, const Call& C,
                                   bool keep_states, const char* op) {
  const int64_t layers = static_cast<int64_t>(A.layer_masks.size());
  check_float(hidden, "hidden", hidden.sizes(), op);
  check_tables(A, S, op);
  std::vector<at::Tensor> out(1);
  at::Tensor x = hidden.reshape({S.rows(), S.hidden});
  std::optional<at::Tensor> held[kSpecNorms];
  for (int64_t i = 0; i < layers; ++i) {
    TORCH_CHECK_VALUE(A.layer_masks[i] >= 0 && A.layer_masks[i] < static_cast<int64_t>(A.offsets.size()), op,
                      ": layer ", i, " names mask list ", A.layer_masks[i], " of ", A.offsets.size());
    check_float(A.keys[i], "a layer's cached keys", {S.batch, S.kv_heads, S.capacity, S.head_dim}, op);
    check_float(A.values[i], "a layer's cached values", {S.batch, S.kv_heads, S.capacity, S.head_dim}, op);
    Layer L{&A.weights[kWeights * i], &A.types[kWeights * i], {}, nullptr, nullptr, &A.keys[i], &A.values[i],
            &A.offsets[A.layer_masks[i]], &A.indices[A.layer_masks[i]], nullptr, nullptr};
    bind_norms(L, A, i, S, held, op);
    bind_rotary(L, A, i, op);
    for (int64_t j = 0; j < kBiases; ++j) L.biases[j] = A.biases.get(kBiases * i + j);
    if (C.moe.experts > 0) {
      L.experts = &A.experts[C.moe.weights() * i];
      L.expert_types = &(*A.expert_types)[C.moe.weights() * i];
    }
    if (keep_states) out.push_back(x.view(hidden.sizes()));
    x = run_layer(L, C, x);
  }
  out[0] = x.view(hidden.sizes());
  return out;
}

Activation activation_named(const std::string& name) {
  TORCH_CHECK_VALUE(name == "silu" || name == "gelu_tanh", kSpecOp, ": activation must be 'silu' or 'gelu_tanh', got '",
                    name, "'");
  return name == "silu" ? Activation::kSilu : Activation::kGeluTanh;
}

// moe: empty (dense MLPs) or (experts, top_k, renormalize, shared expert, expert intermediate size).
Moe moe_named(at::IntArrayRef moe) {
  if (moe.empty()) return {};
  TORCH_CHECK_VALUE(moe.size() == 5 && moe[0] >= 1 && moe[1] >= 1 && moe[1] <= moe[0] && moe[4] >= 1 &&
                        (moe[2] == 0 || moe[2] == 1) && (moe[3] == 0 || moe[3] == 1),
                    kSpecOp, ": moe must be empty or (experts, top_k <= experts, renormalize 0/1, shared expert 0/1, "
                    "expert intermediate size), got ", moe);
  return Moe{moe[0], moe[1], moe[4], moe[2] == 1, moe[3] == 1};
}

std::vector<at::Tensor> spec_layers(const at::Tensor& hidden, at::TensorList weights,
                                    const std::vector<std::string>& types,
                                    const c10::List<std::optional<at::Tensor>>& biases,
                                    const c10::List<std::optional<at::Tensor>>& norms, at::IntArrayRef dims,
                                    double eps, double scale, const std::string& activation, at::TensorList cos,
                                    at::TensorList sin, at::IntArrayRef layer_rotary, at::TensorList keys,
                                    at::TensorList values, int64_t start, at::TensorList offsets,
                                    at::TensorList indices, at::IntArrayRef layer_masks, const std::string& numerics,
                                    bool keep_states, at::TensorList expert_weights,
                                    const std::vector<std::string>& expert_types, at::IntArrayRef moe) {
  const LayerLists A{weights, types, biases, norms, cos, sin, layer_rotary, keys, values, offsets, indices,
                     layer_masks, expert_weights, &expert_types};
  const Moe experts = moe_named(moe);
  check_lists(A, static_cast<int64_t>(layer_masks.size()), experts, kSpecOp);
  const Shape S = check_shape(hidden, dims, keys, start, kSpecOp);
  const Call C{S, static_cast<float>(eps), scale, numerics, activation_named(activation), experts};
  return run_layers(hidden, A, S, C, keep_states, kSpecOp);
}

// The Llama options of eagle::spec_layers: two norms per layer (input, post-attention), one rotary table, SiLU.
std::vector<at::Tensor> decoder_layers(const at::Tensor& hidden, at::TensorList weights,
                                       const std::vector<std::string>& types,
                                       const c10::List<std::optional<at::Tensor>>& biases, at::TensorList norms,
                                       at::IntArrayRef dims, double eps, double scale, const at::Tensor& cos,
                                       const at::Tensor& sin, at::TensorList keys, at::TensorList values,
                                       int64_t start, at::TensorList offsets, at::TensorList indices,
                                       at::IntArrayRef layer_masks, const std::string& numerics, bool keep_states) {
  const int64_t layers = static_cast<int64_t>(layer_masks.size());
  TORCH_CHECK_VALUE(layers >= 1 && static_cast<int64_t>(weights.size()) == kWeights * layers &&
                        static_cast<int64_t>(types.size()) == kWeights * layers &&
                        static_cast<int64_t>(biases.size()) == kBiases * layers &&
                        static_cast<int64_t>(norms.size()) == kNorms * layers &&
                        static_cast<int64_t>(keys.size()) == layers && static_cast<int64_t>(values.size()) == layers,
                    kOp, ": per layer 7 weights and types, 3 biases, 2 norms, 1 key and 1 value tensor; got ", layers,
                    " layers and ", weights.size(), ", ", types.size(), ", ", biases.size(), ", ", norms.size(), ", ",
                    keys.size(), ", ", values.size());
  c10::List<std::optional<at::Tensor>> spec_norms;
  for (int64_t i = 0; i < layers; ++i) {
    spec_norms.push_back(norms[kNorms * i]);
    spec_norms.push_back(std::nullopt);
    spec_norms.push_back(norms[kNorms * i + 1]);
    for (int j = 0; j < 3; ++j) spec_norms.push_back(std::nullopt);
  }
  const std::vector<at::Tensor> tables_cos{cos}, tables_sin{sin};
  const std::vector<int64_t> rotary(layers, 0);
  const LayerLists A{weights, types, biases, spec_norms, tables_cos, tables_sin, rotary, keys, values, offsets,
                     indices, layer_masks};
  check_lists(A, layers, Moe{}, kOp);
  const Shape S = check_shape(hidden, dims, keys, start, kOp);
  const Call C{S, static_cast<float>(eps), scale, numerics, Activation::kSilu};
  return run_layers(hidden, A, S, C, keep_states, kOp);
}

constexpr const char* kHeadOp = "eagle::eagle3_layer";

// The decoder layer of an EAGLE-3 draft head (draft_layers.Eagle3DecoderLayer) over the kernels:
//   e, n = rms_norm(embeds, w_in), rms_norm(hidden, w_hidden)
//   q, k, v = [e, n] W_q, [e, n] W_k, [e, n] W_v                  the 2H concatenation, embedding first
//   keys, values = [past keys, rotary(k)], [past values, v]        new tensors of P + T slots (returned)
//   h = r + attention(rotary(q), keys, values) W_o                  r = hidden, or n (norm_before_residual)
//   out = h + (silu(m W_gate) * (m W_up)) W_down, m = rms_norm(h, w_post)
// The visible-key lists (offsets, indices) are those of the (B or 1, 1, T, P + T) mask the head attends with.
std::vector<at::Tensor> eagle3_layer(const at::Tensor& embeds, const at::Tensor& hidden, at::TensorList weights,
                                     const std::vector<std::string>& types, at::TensorList norms, at::IntArrayRef dims,
                                     double eps, double scale, const at::Tensor& cos, const at::Tensor& sin,
                                     const at::Tensor& past_keys, const at::Tensor& past_values,
                                     const at::Tensor& offsets, const at::Tensor& indices, const std::string& numerics,
                                     bool norm_before_residual) {
  TORCH_CHECK_VALUE(weights.size() == kWeights && types.size() == kWeights && norms.size() == 3, kHeadOp,
                    ": 7 weights and types (q, k, v, o, gate, up, down) and 3 norms (input, hidden, post-attention), "
                    "got ", weights.size(), ", ", types.size(), ", ", norms.size());
  TORCH_CHECK_VALUE(dims.size() == 4, kHeadOp, ": dims must be (q_heads, kv_heads, head_dim, intermediate), got ",
                    dims);
  TORCH_CHECK_TYPE(hidden.device().is_cpu() && hidden.scalar_type() == at::kFloat && hidden.dim() == 3, kHeadOp,
                   ": hidden must be a float32 CPU tensor (B, T, hidden), got ", hidden.scalar_type(), " ",
                   hidden.sizes());
  const int64_t B = hidden.size(0), T = hidden.size(1), H = hidden.size(2);
  TORCH_CHECK_VALUE(B >= 1 && T >= 1 && H >= 1, kHeadOp, ": hidden must hold at least one row, got ", hidden.sizes());
  TORCH_CHECK_VALUE(dims[0] >= 1 && dims[1] >= 1 && dims[0] % dims[1] == 0 && dims[2] >= 2 && dims[2] % 2 == 0 &&
                        dims[3] >= 1, kHeadOp,
                    ": dims must be positive with kv_heads dividing q_heads and an even head_dim, got ", dims);
  const int64_t D = dims[2], kv = dims[1];
  TORCH_CHECK_VALUE(past_keys.dim() == 4, kHeadOp, ": past keys must be (B, kv_heads, P, head_dim), got ",
                    past_keys.sizes());
  const int64_t P = past_keys.size(2);
  check_float(hidden, "hidden", {B, T, H}, kHeadOp);
  check_float(embeds, "embeds", {B, T, H}, kHeadOp);
  check_float(past_keys, "past keys", {B, kv, P, D}, kHeadOp);
  check_float(past_values, "past values", {B, kv, P, D}, kHeadOp);
  check_float(cos, "cos", {B, T, D}, kHeadOp);
  check_float(sin, "sin", {B, T, D}, kHeadOp);
  for (int i = 0; i < 3; ++i) check_float(norms[i], "a norm weight", {H}, kHeadOp);
  // P + T slots: the past copied in, the new keys written by rotate_and_cache at slot P + t
  at::Tensor keys = at::empty({B, kv, P + T, D}, hidden.options());
  at::Tensor values = at::empty({B, kv, P + T, D}, hidden.options());
  keys.narrow(2, 0, P).copy_(past_keys);
  values.narrow(2, 0, P).copy_(past_values);
  const Shape S{B, T, H, dims[0], kv, D, dims[3], P + T, P};
  const Call C{S, static_cast<float>(eps), scale, numerics, Activation::kSilu};
  Layer L{weights.data(), types.data(), {}, nullptr, &norms[2], &keys, &values, &offsets, &indices,
          cos.data_ptr<float>(), sin.data_ptr<float>()};
  const at::Tensor x = hidden.view({B * T, H});
  const at::Tensor normed_hidden = rms_norm(x, norms[1], C.eps);
  const at::Tensor input = at::cat({rms_norm(embeds.view({B * T, H}), norms[0], C.eps), normed_hidden}, 1);
  std::vector<at::Tensor> qkv = project_qkv(L, C, input);
  at::Tensor out = finish_layer(L, C, norm_before_residual ? normed_hidden : x, qkv);
  return {out.view({B, T, H}), keys, values};
}

}  // namespace

// The layers' RMSNorm as an op of its own: x (..., n) float32, w (n,) float32; each row as rms_norm_row computes it.
at::Tensor rms_norm_op(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() >= 1, "eagle::rms_norm: x must "
                    "be a float32 CPU tensor (..., n), got ", x.scalar_type(), " ", x.sizes(), " on ", x.device());
  const int64_t n = x.size(-1);
  TORCH_CHECK_VALUE(n > 0, "eagle::rms_norm: x's last size must be positive, got ", x.sizes());
  TORCH_CHECK_VALUE(w.device().is_cpu() && w.scalar_type() == at::kFloat && w.dim() == 1 && w.size(0) == n,
                    "eagle::rms_norm: the weight must be a float32 CPU vector of ", n, " (x's last size), got ",
                    w.scalar_type(), " ", w.sizes());
  at::Tensor rows = x.contiguous().view({-1, n});
  return rms_norm(rows, w.contiguous(), static_cast<float>(eps)).view(x.sizes());
}

}  // namespace eagle

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &eagle::rms_norm_op);
  m.def("eagle3_layer(Tensor embeds, Tensor hidden, Tensor[] weights, str[] types, Tensor[] norms, int[] dims, "
        "float eps, float scale, Tensor cos, Tensor sin, Tensor past_keys, Tensor past_values, Tensor offsets, "
        "Tensor indices, str numerics, bool norm_before_residual) -> Tensor[]", &eagle::eagle3_layer);
  m.def("decoder_layers(Tensor hidden, Tensor[] weights, str[] types, Tensor?[] biases, Tensor[] norms, int[] dims, "
        "float eps, float scale, Tensor cos, Tensor sin, Tensor[] keys, Tensor[] values, int start, Tensor[] offsets, "
        "Tensor[] indices, int[] layer_masks, str numerics, bool keep_states) -> Tensor[]",
        &eagle::decoder_layers);
  m.def("spec_layers(Tensor hidden, Tensor[] weights, str[] types, Tensor?[] biases, Tensor?[] norms, int[] dims, "
        "float eps, float scale, str activation, Tensor[] cos, Tensor[] sin, int[] layer_rotary, Tensor[] keys, "
        "Tensor[] values, int start, Tensor[] offsets, Tensor[] indices, int[] layer_masks, str numerics, "
        "bool keep_states, Tensor[] expert_weights, str[] expert_types, int[] moe) -> Tensor[]", &eagle::spec_layers);
}
