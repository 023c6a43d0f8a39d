// The GGUF linears for many rows on a CPU whose dense bf16 matmul far outruns our integer tiles (AMX: oneDNN's tile
// matmuls; radixserve/model/gguf_linear.py decides when): the blocks dequantized a cache-sized chunk of weight rows at a
// time into the activations' dtype and multiplied by torch's dense matmul, as int8_dense.cpp does with int8 codes.
// Not batch-invariant (oneDNN blocks its sums by the row count), so deterministic mode never comes here.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ops/mm_ops.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gguf_blocks.h"
#include "ops.h"

namespace radixserve::cpu {

namespace {
using radixserve::gguf::check_blocks;
using radixserve::gguf::kSub;
using radixserve::gguf::unpack_row;
using radixserve::gguf::weights_row;

constexpr int64_t kRowBucket = 64;

// One chunk: `rows` weight rows of one part, from `blocks` on, into the output columns from `column`.
struct Chunk {
  const uint8_t* blocks;
  int64_t type, row_bytes, rows, column;
};

// The chunk's weights w = a u - b (weights_row, as gguf_dequantize), rounded once to T, into buf [rows, K].
template <typename T>
void dequantize_chunk(const Chunk& c, int64_t K, T* buf) {
  thread_local std::vector<uint8_t> u;
  thread_local std::vector<float> a, b;
  u.resize(K);
  a.resize(K / kSub);
  b.resize(K / kSub);
  for (int64_t r = 0; r < c.rows; r++) {
    unpack_row(c.type, c.blocks + r * c.row_bytes, K, u.data(), a.data(), b.data());
    weights_row(u.data(), a.data(), b.data(), K, buf + r * K);
  }
}

}  // namespace

// y = x W^T + bias for the stacked parts' blocks, in x's dtype (float32 or bfloat16). No dequantized copy of the whole
// matrix is allocated: each thread widens ~1 MiB of weight rows into its buffer and writes the matmul straight into
// y's columns.
at::Tensor gguf_linear_dense(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                             const std::vector<int64_t>& types, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "x must be float32 or bfloat16 [M, K]");
  TORCH_CHECK(blocks.size() == types.size() && !blocks.empty(), "one block type per tensor of blocks");
  const int64_t M = x.size(0), K = x.size(1);
  // ~1 MiB of weights, a multiple of 64 rows (fewer distinct matmul shapes: see the rows' padding below)
  const int64_t chunk_rows = std::max<int64_t>(64, (int64_t{1} << 20) / (K * x.element_size()) / 64 * 64);
  std::vector<Chunk> chunks;
  int64_t N = 0;
  for (size_t i = 0; i < blocks.size(); i++) {
    const at::Tensor& w = blocks[i];
    check_blocks(w, types[i], K);
    for (int64_t r = 0; r < w.size(0); r += chunk_rows)
      chunks.push_back({w.data_ptr<uint8_t>() + r * w.size(1), types[i], w.size(1),
                        std::min(chunk_rows, w.size(0) - r), N + r});
    N += w.size(0);
  }
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N), "bias must be [", N, "]");
  // The rows padded to a multiple of kRowBucket: oneDNN keeps a primitive (and its buffers) per matmul shape, and a
  // server's prefill steps come in every row count (RSS grew by ~70 MiB over a dozen prompt lengths without this).
  const int64_t Mp = (M + kRowBucket - 1) / kRowBucket * kRowBucket;
  at::Tensor y = x.new_empty({Mp, N});
  at::Tensor xc = x.contiguous();
  if (Mp != M) {
    xc = x.new_zeros({Mp, K});
    xc.narrow(0, 0, M).copy_(x);
  }
  const at::Tensor b = bias ? bias->to(x.scalar_type()) : at::Tensor();
  const at::ThreadLocalState caller;  // inference mode and the like, for the ATen calls on the worker threads
  // The threads' buffers from this thread: allocated on a worker thread they went to its own malloc arena, which
  // kept them (peak RSS).
  const at::Tensor bufs = x.new_empty({at::get_num_threads(), chunk_rows, K});
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t c0, int64_t c1) {
    const at::ThreadLocalStateGuard same_as_caller(caller);
    at::Tensor buf = bufs[at::get_thread_num()];
    for (int64_t i = c0; i < c1; i++) {
      const Chunk& c = chunks[i];
      if (x.scalar_type() == at::kBFloat16)
        dequantize_chunk(c, K, buf.data_ptr<at::BFloat16>());
      else
        dequantize_chunk(c, K, buf.data_ptr<float>());
      at::Tensor out = y.narrow(1, c.column, c.rows);
      at::_ops::mm_out::call(xc, buf.narrow(0, 0, c.rows).t(), out);
      if (bias) out.add_(b.narrow(0, c.column, c.rows));
    }
  });
  return y.narrow(0, 0, M);
}

}  // namespace radixserve::cpu
