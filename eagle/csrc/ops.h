// The extension's ops as C++ functions, for kernels that compose them (decoder.cpp) without the dispatcher. Each
// checks its arguments exactly as the registered op does.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <vector>

namespace eagle {

// eagle::quant_linear: x (M, K) float32 -> (M, N) float32 over a packed weight (ops.cpp)
at::Tensor quant_linear_call(const at::Tensor& x, const at::Tensor& weight, const std::string& type, int64_t n,
                             int64_t k, const std::optional<at::Tensor>& bias, const std::string& numerics);

// One weight of a group call: packed weight, its GGUF type name, N, and an optional bias (nullptr: none).
struct LinearSpec {
  const at::Tensor* weight;
  const std::string* type;
  int64_t n;
  const std::optional<at::Tensor>* bias;
};

// Several weights over the same rows x (M, K), their chunks in one parallel region (and x quantized once for int8
// numerics): the outputs, each what quant_linear_call gives (a row's bits never depend on the grouping).
std::vector<at::Tensor> quant_linear_group_call(const at::Tensor& x, const std::vector<LinearSpec>& weights,
                                                const std::string& numerics);

// eagle::tree_attention without sinks or softcap: q (B, Hq, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv), the
// visible-key lists -> (B, T, Hq, Dv) contiguous (attention.cpp)
at::Tensor tree_attention_call(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& offsets, const at::Tensor& indices, double scale);

}  // namespace eagle
