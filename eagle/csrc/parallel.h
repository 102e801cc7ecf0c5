// Work splitting shared by every kernel of the extension.
//
// dynamic_for(n, fn) runs fn(i) for every chunk i in [0, n) on torch's intra-op threads (at::parallel_for, so
// torch.set_num_threads governs it like any torch op). The chunks are claimed one at a time from a shared counter,
// not split statically: a thread that the operating system deschedules (a busy machine) claims fewer chunks and the
// others take over its share, instead of everyone waiting at the barrier for its fixed part.
//
// A chunk is always computed whole by the one thread that claims it, and what a chunk computes depends only on its
// index, so results are bit-identical whatever thread computed which chunk and however many threads ran. Kernels
// split their work by output columns (never along a reduction) to keep that promise.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace eagle {

template <typename F>
void dynamic_for(int64_t n_chunks, const F& fn) {
  if (n_chunks <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n_chunks);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t i = 0; i < n_chunks; ++i) fn(i);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < n_chunks;
           i = next.fetch_add(1, std::memory_order_relaxed)) {
        fn(i);
      }
    }
  });
}

}  // namespace eagle
