// DecoderStack's layers (decoder_stack.h; library.cpp registers the class): llama.py's DecoderLayer.forward per layer.
#include "decoder_stack.h"

#include <tuple>

namespace radixserve::cpu {

void DecoderStack::add_layer(at::Tensor in_norm, at::Tensor post_norm, std::optional<at::Tensor> k_center) {
  layers_.push_back({std::move(in_norm), std::move(post_norm), std::move(k_center), {}});
}

void DecoderStack::add_linear(std::vector<at::Tensor> blocks, std::vector<int64_t> types,
                              std::optional<at::Tensor> bias, std::vector<at::Tensor> ahead) {
  TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "add_layer first; four linears a layer");
  std::optional<std::vector<at::Tensor>> next;
  if (!ahead.empty()) next = std::move(ahead);
  layers_.back().linears.push_back({std::move(blocks), std::move(types), std::move(bias), std::move(next)});
}

at::Tensor DecoderStack::run(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_bufs,
                             std::vector<at::Tensor> v_bufs, at::Tensor loc, at::Tensor table, at::Tensor seq_lens,
                             double scale, bool int8_kv) const {
  TORCH_CHECK(k_bufs.size() == layers_.size() && v_bufs.size() == layers_.size(), "one K and V buffer a layer");
  const Step step{cos, sin, k_bufs, v_bufs, loc, table, seq_lens, scale, int8_kv};
  std::optional<at::Tensor> residual;
  Clock clock(seconds_);
  for (size_t l = 0; l < layers_.size(); l++) {  // llama.py's DecoderLayer.forward
    const Layer& layer = layers_[l];
    TORCH_CHECK(layer.linears.size() == 4, "layer ", l, " has ", layer.linears.size(), " linears, not 4");
    auto [sum, x] = add_rms_norm(h, residual, layer.in_norm, eps_);
    clock.lap(5);
    const at::Tensor o = attention(layer, l, x, step, clock);
    auto [sum2, x2] = add_rms_norm(o, sum, layer.post_norm, eps_);
    clock.lap(5);
    h = mlp(layer, x2, clock);
    residual = sum2;
  }
  at::Tensor normed = std::get<1>(add_rms_norm(h, residual, final_norm_, eps_));
  clock.lap(5);
  return normed;
}

c10::Dict<std::string, double> DecoderStack::take_times() {
  c10::Dict<std::string, double> out;
  for (size_t i = 0; i < kParts.size(); i++) out.insert(kParts[i], seconds_[i]);
  seconds_.fill(0.0);
  return out;
}

// llama.py's Attention.forward with TorchAttentionBackend.forward: o_proj's output. Its intermediates (the q/k/v
// projection, rotated q and k, the attention output) are freed on return, before the MLP allocates.
at::Tensor DecoderStack::attention(const Layer& layer, size_t l, const at::Tensor& x, const Step& step,
                                   Clock& clock) const {
  const int64_t t = x.size(0), q_size = heads_ * head_dim_, kv_size = kv_heads_ * head_dim_;
  const at::Tensor qkv = layer.linears[0](x);
  clock.lap(0);
  const at::Tensor q = qkv.narrow(1, 0, q_size).view({t, -1, head_dim_});
  const at::Tensor k = qkv.narrow(1, q_size, kv_size).view({t, -1, head_dim_});
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({t, -1, head_dim_});
  auto [q_rot, k_rot] = rope_qk(q, k, step.cos, step.sin);
  if (layer.k_center) k_rot.sub_(*layer.k_center);
  clock.lap(5);
  if (step.int8_kv)
    store_kv_int8(k_rot, v, step.k_bufs[l], step.v_bufs[l], step.loc);
  else
    store_kv(k_rot, v, step.k_bufs[l], step.v_bufs[l], step.loc);
  const at::Tensor out = decode_attention(q_rot, step.k_bufs[l], step.v_bufs[l], step.table, step.seq_lens, step.scale);
  clock.lap(4);
  at::Tensor o = layer.linears[1](out.reshape({t, q_size}));
  clock.lap(1);
  return o;
}

// llama.py's MLP.forward: down(SiLU(gate) * up), the gate_up output freed before down runs.
at::Tensor DecoderStack::mlp(const Layer& layer, const at::Tensor& x, Clock& clock) const {
  at::Tensor gate_up = layer.linears[2](x);
  clock.lap(2);
  const at::Tensor act = silu_mul(gate_up);
  gate_up.reset();
  clock.lap(5);
  at::Tensor h = layer.linears[3](act);
  clock.lap(3);
  return h;
}

}  // namespace radixserve::cpu
