// The ops of this folder that other ops call directly (decoder_stack.cpp runs a whole decode step through them):
// the same functions torch.ops.radixserve dispatches to, so both paths give the same bits.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace radixserve::cpu {

at::Tensor gguf_linear(const at::Tensor& x, const std::vector<at::Tensor>& blocks, const std::vector<int64_t>& types,
                       const std::optional<at::Tensor>& bias, const std::optional<std::vector<at::Tensor>>& ahead);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& h, const std::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                           const at::Tensor& sin);
at::Tensor silu_mul(const at::Tensor& gate_up);
void store_kv_int8(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor k_buf, at::Tensor v_buf,
                   const at::Tensor& loc);
void store_kv(const at::Tensor& k_in, const at::Tensor& v_in, at::Tensor k_buf, at::Tensor v_buf, const at::Tensor& loc);
at::Tensor decode_attention(const at::Tensor& q_in, const at::Tensor& k_pages, const at::Tensor& v_pages,
                            const at::Tensor& page_table, const at::Tensor& seq_lens, double scale);

}  // namespace radixserve::cpu
