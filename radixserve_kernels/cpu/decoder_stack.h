// The decoder layers of a GGUF model on CPU as one call per step (radixserve/model/cpu_stack.py): every layer runs
// the ops its Python runs, in the same order with the same arguments (ops.h: the functions torch.ops.radixserve
// dispatches to), so the two paths give the same bits.
//
// Why: in Python each layer is ~15 op dispatches plus the module calls around them, ~2 ms of a ~13 ms decode step
// of the default model (24 layers), all of it serial while the second core waits; here it is one dispatch a step.
// Only the case the Python path serves with these ops comes here: the linears over the file's blocks, no QK norm,
// rotary embedding by table (cos, sin), and attention by the decode op for every row of the step.
//
// Declared here so that library.cpp registers the class: torch::class_ needs torch/custom_class.h, ~11 s of a file's
// compile on 2 cores (ops.h), and decoder_stack.cpp, which runs the layers, then compiles with the light headers.
#pragma once

#include "ops.h"

#include <ATen/core/ivalue.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace radixserve::cpu {

class DecoderStack : public torch::CustomClassHolder {
 public:
  DecoderStack(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, at::Tensor final_norm)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), final_norm_(std::move(final_norm)) {}

  void add_layer(at::Tensor in_norm, at::Tensor post_norm, std::optional<at::Tensor> k_center);

  // The next linear of the last layer added: qkv, o, gate_up, then down.
  void add_linear(std::vector<at::Tensor> blocks, std::vector<int64_t> types, std::optional<at::Tensor> bias,
                  std::vector<at::Tensor> ahead);

  // The final norm's output [T, hidden] for the embedded tokens h [T, hidden]; writes each layer's K/V into
  // k_bufs[l] / v_bufs[l] at slots loc (int8 pages: quantized, else copied), then attends by the decode op with the
  // page table [T, P] and seq_lens [T] (int32).
  at::Tensor run(at::Tensor h, at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> k_bufs,
                 std::vector<at::Tensor> v_bufs, at::Tensor loc, at::Tensor table, at::Tensor seq_lens, double scale,
                 bool int8_kv) const;

  // {part: seconds} since the last call (kParts), then zeroed.
  c10::Dict<std::string, double> take_times();

 private:
  // One GGUFLinear: its parts' blocks and types, bias, and what it hands the pool to prefetch after it runs.
  struct Linear {
    std::vector<at::Tensor> blocks;
    std::vector<int64_t> types;
    std::optional<at::Tensor> bias;
    std::optional<std::vector<at::Tensor>> ahead;

    at::Tensor operator()(const at::Tensor& x) const { return gguf_linear(x, blocks, types, bias, ahead); }
  };

  struct Layer {
    at::Tensor in_norm, post_norm;
    std::optional<at::Tensor> k_center;  // subtracted from the rotated keys (int8 KV pages: key_center.py)
    std::vector<Linear> linears;         // qkv, o, gate_up, down
  };

  // Where the stack's time goes (benchmarks/decode_parts.py): its parts' wall seconds summed over calls, in the
  // order of `kParts`. A clock read costs ~20 ns; a layer reads eight.
  static constexpr std::array<const char*, 6> kParts = {"qkv", "o", "gate_up", "down", "attention", "norms, rope, silu"};
  using Seconds = std::array<double, kParts.size()>;

  class Clock {
   public:
    explicit Clock(Seconds& into) : into_(into), last_(now()) {}
    void lap(size_t part) {
      const auto t = now();
      into_[part] += std::chrono::duration<double>(t - last_).count();
      last_ = t;
    }

   private:
    static std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }
    Seconds& into_;
    std::chrono::steady_clock::time_point last_;
  };

  // What every layer of one step reads besides its weights.
  struct Step {
    const at::Tensor &cos, &sin;
    const std::vector<at::Tensor>&k_bufs, &v_bufs;
    const at::Tensor &loc, &table, &seq_lens;
    double scale;
    bool int8_kv;
  };

  at::Tensor attention(const Layer& layer, size_t l, const at::Tensor& x, const Step& step, Clock& clock) const;
  at::Tensor mlp(const Layer& layer, const at::Tensor& x, Clock& clock) const;

  int64_t heads_, kv_heads_, head_dim_;
  double eps_;
  at::Tensor final_norm_;
  std::vector<Layer> layers_;
  mutable Seconds seconds_{};  // take_times
};

}  // namespace radixserve::cpu
