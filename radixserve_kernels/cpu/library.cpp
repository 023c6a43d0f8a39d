// The ops of torch.ops.radixserve, every schema and its CPU function (ops.h), and the DecoderStack class
// (decoder_stack.h): the only file that includes torch/library.h and torch/custom_class.h (why: ops.h).
#include "decoder_stack.h"
#include "ops.h"

#include <torch/custom_class.h>
#include <torch/library.h>

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  // GGUF blocks
  m.def("gguf_linear(Tensor x, Tensor[] blocks, int[] types, Tensor? bias, Tensor[]? ahead=None) -> Tensor");
  m.def("gguf_dequantize(Tensor blocks, int type, Tensor? ids) -> Tensor");
  m.def("gguf_linear_dense(Tensor x, Tensor[] blocks, int[] types, Tensor? bias) -> Tensor");
  m.def("gguf_quantize_activations(Tensor x, int block=32) -> (Tensor, Tensor)");
  // No tensor to dispatch on: a catch-all kernel.
  m.def("gguf_activation_block(int type) -> int", &radixserve::cpu::gguf_activation_block);
  // int8 codes
  m.def(
      "int8_linear(Tensor x, Tensor packed, Tensor scale, Tensor? bias, int out_features, "
      "bool batch_invariant=False) -> Tensor");
  m.def("int8_unpack(Tensor packed, ScalarType dtype) -> Tensor");
  m.def("int8_linear_dense(Tensor x, Tensor packed, Tensor scale, int out_features) -> Tensor");
  // the layers' elementwise parts
  m.def("add_rms_norm(Tensor h, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("rope_qk(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  // KV pages and attention
  m.def("store_kv_int8(Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc) -> ()");
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_buf, Tensor(b!) v_buf, Tensor loc) -> ()");
  m.def(
      "decode_attention(Tensor q, Tensor k_pages, Tensor v_pages, Tensor page_table, Tensor seq_lens, float scale) "
      "-> Tensor");
  // a GGUF model's decoder layers as one call a step (radixserve/model/cpu_stack.py)
  m.class_<radixserve::cpu::DecoderStack>("DecoderStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, at::Tensor>())
      .def("add_layer", &radixserve::cpu::DecoderStack::add_layer)
      .def("add_linear", &radixserve::cpu::DecoderStack::add_linear)
      .def("run", &radixserve::cpu::DecoderStack::run)
      .def("take_times", &radixserve::cpu::DecoderStack::take_times);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  using namespace radixserve::cpu;  // NOLINT: every op here is one of ops.h
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_dequantize", &gguf_dequantize);
  m.impl("gguf_linear_dense", &gguf_linear_dense);
  m.impl("gguf_quantize_activations", &gguf_quantize_activations);
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_unpack", &int8_unpack);
  m.impl("int8_linear_dense", &int8_linear_dense);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope", &rope);
  m.impl("rope_qk", &rope_qk);
  m.impl("silu_mul", &silu_mul);
  m.impl("store_kv_int8", &store_kv_int8);
  m.impl("store_kv", &store_kv);
  m.impl("decode_attention", &decode_attention);
}
