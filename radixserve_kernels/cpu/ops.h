// Every op of this folder that torch.ops.radixserve dispatches to (library.cpp registers them; decoder_stack.cpp also
// calls them directly to run a whole decode step, so both paths give the same bits).
//
// Only ATen/core/Tensor.h here and in the kernels' files: ATen/ATen.h and torch/library.h took ~16 s of each file's
// compile on 2 cores (of 27-52 s), and a machine's first start compiles all of them. Only library.cpp includes
// torch/library.h (and torch/custom_class.h); the others read Tensor.h precompiled once (build.py). Tensors are
// made by `new_empty`, other ATen ops called through ATen/ops/*_ops.h: the free functions' headers
// (ATen/ops/empty.h ...) pull in ATen/Context.h (~5 s).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace radixserve::cpu {

// gguf_linear.cpp, gguf_dequantize.cpp, gguf_dense.cpp
at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& types,
                       const std::optional<at::Tensor>& bias, const std::optional<std::vector<at::Tensor>>& ahead);
at::Tensor gguf_dequantize(const at::Tensor& blocks, int64_t type, const std::optional<at::Tensor>& ids);
at::Tensor gguf_linear_dense(const at::Tensor& x, const std::vector<at::Tensor>& blocks,
                             const std::vector<int64_t>& types, const std::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor> gguf_quantize_activations(const at::Tensor& x, int64_t block);
int64_t gguf_activation_block(int64_t type);

// int8_linear.cpp, int8_dense.cpp
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const std::optional<at::Tensor>& bias, int64_t out_features, bool batch_invariant);
at::Tensor int8_unpack(const at::Tensor& packed, at::ScalarType dtype);
at::Tensor int8_linear_dense(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                             int64_t out_features);

// norm_rope.cpp, silu_mul.cpp
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                           const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);

// kv_store.cpp, decode_attention.cpp
void store_kv_int8(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor k_buf, at::Tensor v_buf,
                   const at::Tensor& loc);
void store_kv(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor k_buf, at::Tensor v_buf, const at::Tensor& loc);
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_pages, const at::Tensor& v_pages,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale);

}  // namespace radixserve::cpu
