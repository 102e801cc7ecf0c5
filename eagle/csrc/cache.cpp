// eagle::keep_slots: after a verification, move the accepted tree nodes' key/value entries of every layer of a
// TreeKVCache next to the committed prefix, in one call (a Python loop over the layers costs more than the copies).
//
// For each tensor t (B, heads, capacity, dim), contiguous, on the CPU, any dtype: t[b, h, start + i] = t[b, h,
// positions[i]] for i = 0 .. n - 1, every b and h. positions ascend strictly and are >= start, so positions[i] >=
// start + i: copying in order never overwrites an entry still to be read. Bytes are moved, nothing is computed.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

namespace eagle {
namespace {

constexpr const char* kOp = "eagle::keep_slots";

void check_positions(const std::vector<int64_t>& positions, int64_t start) {
  TORCH_CHECK_VALUE(start >= 0, kOp, ": start must be >= 0, got ", start);
  int64_t previous = start - 1;
  for (int64_t p : positions) {
    TORCH_CHECK_VALUE(p > previous, kOp, ": positions must ascend strictly from start (", start, "), got ", p,
                      " after ", previous);
    previous = p;
  }
}

void keep_slots(at::TensorList tensors, at::IntArrayRef positions_ref, int64_t start) {
  std::vector<int64_t> positions(positions_ref.begin(), positions_ref.end());
  check_positions(positions, start);
  const int64_t n = static_cast<int64_t>(positions.size());
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK_VALUE(t.device().is_cpu() && t.dim() == 4 && t.is_contiguous(), kOp,
                      ": each tensor must be a contiguous 4-D (batch, heads, capacity, dim) CPU tensor, got ",
                      t.sizes(), t.is_contiguous() ? "" : " (not contiguous)", " on ", t.device());
    const int64_t capacity = t.size(2);
    TORCH_CHECK_VALUE(n == 0 || positions.back() < capacity, kOp, ": position ", n ? positions.back() : 0,
                      " is past the tensor's ", capacity, " slots");
    const int64_t rows = t.size(0) * t.size(1);
    const size_t entry = static_cast<size_t>(t.size(3)) * t.element_size();
    auto* base = static_cast<char*>(t.data_ptr());
    for (int64_t r = 0; r < rows; ++r) {
      char* row = base + static_cast<size_t>(r * capacity) * entry;
      for (int64_t i = 0; i < n; ++i) {
        if (positions[i] != start + i) {
          std::memcpy(row + static_cast<size_t>(start + i) * entry, row + static_cast<size_t>(positions[i]) * entry,
                      entry);
        }
      }
    }
  }
}

}  // namespace
}  // namespace eagle

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("keep_slots(Tensor(a!)[] tensors, int[] positions, int start) -> ()", &eagle::keep_slots);
}
