// The decoder layers of a GGUF model on CPU as one call per step (radixserve/model/cpu_stack.py): every layer runs
// the ops its Python runs, in the same order with the same arguments (ops.h: the functions torch.ops.radixserve
// dispatches to), so the two paths give the same bits.
//
// Why: in Python each layer is ~15 op dispatches plus the module calls around them, ~2 ms of a ~13 ms decode step
// of the default model (24 layers), all of it serial while the second core waits; here it is one dispatch a step.
// Only the case the Python path serves with these ops comes here: the linears over the file's blocks, no QK norm,
// rotary embedding by table (cos, sin), and attention by the decode op for every row of the step.
#include "ops.h"

#include <torch/custom_class.h>
#include <torch/library.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace {

using namespace radixserve::cpu;  // NOLINT: the ops the layers run

// One GGUFLinear: its parts' blocks and types, bias, and what it hands the pool to prefetch after it runs.
struct Linear {
  std::vector<at::Tensor> blocks;
  std::vector<int64_t> types;
  std::optional<at::Tensor> bias;
  std::optional<std::vector<at::Tensor>> ahead;

  at::Tensor operator()(const at::Tensor& x) const { return gguf_linear(x, blocks, types, bias, ahead); }
};

// Where the stack's time goes (benchmarks/decode_parts.py): its parts' wall seconds summed over calls, in the
// order of `kParts`. A clock read costs ~20 ns; a layer reads eight.
constexpr std::array<const char*, 6> kParts = {"qkv", "o", "gate_up", "down", "attention", "norms, rope, silu"};

class Clock {
 public:
  explicit Clock(std::array<double, kParts.size()>& into) : into_(into), last_(now()) {}
  void lap(size_t part) {
    const auto t = now();
    into_[part] += std::chrono::duration<double>(t - last_).count();
    last_ = t;
  }

 private:
  static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
  std::array<double, kParts.size()>& into_;
  std::chrono::steady_clock::time_point last_;
};

struct Layer {
  at::Tensor in_norm, post_norm;
  std::optional<at::Tensor> k_center;  // subtracted from the rotated keys (int8 KV pages: key_center.py)
  std::vector<Linear> linears;         // qkv, o, gate_up, down
};

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, at::Tensor final_norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), final_norm_(std::move(final_norm)) {}

  void add_layer(at::Tensor in_norm, at::Tensor post_norm, std::optional<at::Tensor> k_center) {
    layers_.push_back({std::move(in_norm), std::move(post_norm), std::move(k_center), {}});
  }

  // The next linear of the last layer added: qkv, o, gate_up, then down.
  void add_linear(std::vector<at::Tensor> blocks, std::vector<int64_t> types, std::optional<at::Tensor> bias,
                  std::vector<at::Tensor> ahead) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "add_layer first; four linears a layer");
    std::optional<std::vector<at::Tensor>> next;
    if (!ahead.empty()) next = std::move(ahead);
    layers_.back().linears.push_back({std::move(blocks), std::move(types), std::move(bias), std::move(next)});
  }

  // The final norm's output [T, hidden] for the embedded tokens h [T, hidden]; writes each layer's K/V into
  // k_bufs[l] / v_bufs[l] at slots loc (int8 pages: quantized, else copied), then attends by the decode op with the
  // page table [T, P] and seq_lens [T] (int32).
  at::Tensor run(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_bufs,
                 std::vector<at::Tensor> v_bufs, at::Tensor loc, at::Tensor table, at::Tensor seq_lens, double scale,
                 bool int8_kv) const {
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

  // {part: seconds} since the last call (kParts), then zeroed.
  c10::Dict<std::string, double> take_times() {
    c10::Dict<std::string, double> out;
    for (size_t i = 0; i < kParts.size(); i++) out.insert(kParts[i], seconds_[i]);
    seconds_.fill(0.0);
    return out;
  }

 private:
  // What every layer of one step reads besides its weights.
  struct Step {
    const at::Tensor &cos, &sin;
    const std::vector<at::Tensor>&k_bufs, &v_bufs;
    const at::Tensor &loc, &table, &seq_lens;
    double scale;
    bool int8_kv;
  };

  // llama.py's Attention.forward with TorchAttentionBackend.forward: o_proj's output. Its intermediates (the q/k/v
  // projection, rotated q and k, the attention output) are freed on return, before the MLP allocates.
  at::Tensor attention(const Layer& layer, size_t l, const at::Tensor& x, const Step& step, Clock& clock) const {
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
  at::Tensor mlp(const Layer& layer, const at::Tensor& x, Clock& clock) const {
    at::Tensor gate_up = layer.linears[2](x);
    clock.lap(2);
    const at::Tensor act = silu_mul(gate_up);
    gate_up.reset();
    clock.lap(5);
    at::Tensor h = layer.linears[3](act);
    clock.lap(3);
    return h;
  }

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  mutable std::array<double, kParts.size()> seconds_{};  // take_times
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.class_<DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, at::Tensor>())
      .def("add_layer", &DecoderStack::add_layer)
      .def("add_linear", &DecoderStack::add_linear)
      .def("run", &DecoderStack::run)
      .def("take_times", &DecoderStack::take_times);
}
