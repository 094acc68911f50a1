// A Llama decoder layer around its attention, for the few rows of a decode step, in two calls
// instead of a dozen, on the CPU.
//
// At batch 1 a layer's work is a few microseconds per step above its weight stream, but run
// op by op from Python it costs ~70 us of interpreter and dispatch time (2 ms of a 12 ms bf16
// step over 30 layers). Here the same kernels run back to back in C++:
//   attention_input            qkv = rms_norm(hidden) @ qkv_w.T (+ b), q and k rotated in place
//   attention_output_and_mlp   h = residual + attn @ o_w.T (+ b); x = rms_norm(h);
//                              returns h + down(silu(gate(x)) * up(x)) (+ biases)
// with the streaming linear of skinny_linear.h and the elementwise kernels of elementwise.h,
// so the results are those of the op-by-op path bit for bit (the Python side's references;
// tests/kernels/test_decode_layer.py).
#include <torch/extension.h>

#include <string>

#include "elementwise.h"
#include "skinny_linear.h"

namespace {

using plugserve::elementwise::add_rms_norm_kernel;
using plugserve::elementwise::rms_norm_kernel;
using plugserve::elementwise::rope_kernel;
using plugserve::elementwise::silu_mul_kernel;
using plugserve::skinny::bias_as_float;
using plugserve::skinny::kHaveBf16;
using plugserve::skinny::linear_into;

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, what, ": a CPU tensor [rows, features] is needed, got ",
              x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == torch::kFloat || (kHaveBf16 && dtype == torch::kBFloat16), what,
              ": float32", kHaveBf16 ? " or bfloat16" : "", " here, got ", dtype);
}

void check_matrix(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.scalar_type() == x.scalar_type(),
              what, ": the weight must be [outputs, ", x.size(1), "] of ", x.scalar_type(),
              ", got ", w.sizes(), " of ", w.scalar_type());
}

void check_norm(const torch::Tensor& x, const torch::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              what, ": the norm weight must be [", x.size(1), "] of ", x.scalar_type());
}

// x @ w.T (+ bias) into a new [rows, outputs] tensor.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w,
                     const c10::optional<torch::Tensor>& bias, const char* what) {
  check_matrix(x, w, what);
  auto out = torch::empty({x.size(0), w.size(0)}, x.options());
  linear_into(x, w.contiguous(), bias_as_float(bias, w.size(0), what), out);
  return out;
}

template <typename T>
torch::Tensor attention_input_kernel(const torch::Tensor& hidden, const torch::Tensor& norm_w,
                                     double eps, const torch::Tensor& qkv_w,
                                     const c10::optional<torch::Tensor>& qkv_b,
                                     const torch::Tensor& cos, const torch::Tensor& sin,
                                     int64_t rotated_heads, int64_t head_dim) {
  auto normed = torch::empty_like(hidden);
  rms_norm_kernel<T>(hidden, norm_w, eps, /*unit_offset=*/false, normed);
  auto qkv = linear(normed, qkv_w, qkv_b, "attention_input (qkv)");
  auto qk = qkv.narrow(1, 0, rotated_heads * head_dim).view({qkv.size(0), rotated_heads, head_dim});
  rope_kernel<T>(qk, cos, sin);
  return qkv;
}

template <typename T>
torch::Tensor attention_output_and_mlp_kernel(
    const torch::Tensor& attn, const torch::Tensor& o_w, const c10::optional<torch::Tensor>& o_b,
    const torch::Tensor& residual, const torch::Tensor& norm_w, double eps,
    const torch::Tensor& gate_up_w, const c10::optional<torch::Tensor>& gate_up_b,
    const torch::Tensor& down_w, const c10::optional<torch::Tensor>& down_b) {
  const auto o = linear(attn, o_w, o_b, "attention_output_and_mlp (o)");
  TORCH_CHECK(o.sizes() == residual.sizes(), "attention_output_and_mlp: the residual must be ",
              o.sizes(), ", got ", residual.sizes());
  check_norm(o, norm_w, "attention_output_and_mlp");
  auto mlp_in = torch::empty_like(o);
  auto hidden = torch::empty_like(o);
  add_rms_norm_kernel<T>(o, residual, norm_w, eps, /*unit_offset=*/false, mlp_in, hidden);
  const auto gate_up = linear(mlp_in, gate_up_w, gate_up_b, "attention_output_and_mlp (gate_up)");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "attention_output_and_mlp: gate_up has ",
              gate_up.size(1), " outputs; gate | up needs an even number");
  auto act = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_kernel<T>(gate_up, act);
  const auto mlp = linear(act, down_w, down_b, "attention_output_and_mlp (down)");
  return hidden.add_(mlp);  // torch's add: the sum rounded to T once, as `hidden + mlp` does
}

}  // namespace

torch::Tensor attention_input(torch::Tensor hidden, torch::Tensor norm_w, double eps,
                              torch::Tensor qkv_w, c10::optional<torch::Tensor> qkv_b,
                              torch::Tensor cos, torch::Tensor sin, int64_t rotated_heads,
                              int64_t head_dim) {
  check_rows(hidden, "attention_input");
  check_norm(hidden, norm_w, "attention_input");
  check_matrix(hidden, qkv_w, "attention_input (qkv)");
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && rotated_heads > 0 &&
                  rotated_heads * head_dim <= qkv_w.size(0),
              "attention_input: ", rotated_heads, " rotated heads of ", head_dim,
              " do not fit the ", qkv_w.size(0), " qkv outputs (head_dim must be even)");
  const int64_t half = head_dim / 2;
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == hidden.scalar_type() && t->size(0) == hidden.size(0) &&
                    t->size(-1) == half && t->numel() == hidden.size(0) * half &&
                    t->stride(-1) == 1,
                "attention_input: cos and sin must hold ", half, " contiguous ",
                hidden.scalar_type(), " values per row for ", hidden.size(0), " rows, got ",
                t->sizes(), " of ", t->scalar_type());
  }
  hidden = hidden.contiguous();
  norm_w = norm_w.contiguous();
  if (hidden.scalar_type() == torch::kFloat) {
    return attention_input_kernel<float>(hidden, norm_w, eps, qkv_w, qkv_b, cos, sin,
                                         rotated_heads, head_dim);
  }
  return attention_input_kernel<c10::BFloat16>(hidden, norm_w, eps, qkv_w, qkv_b, cos, sin,
                                               rotated_heads, head_dim);
}

torch::Tensor attention_output_and_mlp(torch::Tensor attn, torch::Tensor o_w,
                                       c10::optional<torch::Tensor> o_b, torch::Tensor residual,
                                       torch::Tensor norm_w, double eps, torch::Tensor gate_up_w,
                                       c10::optional<torch::Tensor> gate_up_b,
                                       torch::Tensor down_w,
                                       c10::optional<torch::Tensor> down_b) {
  check_rows(attn, "attention_output_and_mlp");
  check_rows(residual, "attention_output_and_mlp (residual)");
  TORCH_CHECK(residual.scalar_type() == attn.scalar_type(),
              "attention_output_and_mlp: the residual's dtype ", residual.scalar_type(),
              " differs from ", attn.scalar_type());
  attn = attn.contiguous();
  residual = residual.contiguous();
  norm_w = norm_w.contiguous();
  if (attn.scalar_type() == torch::kFloat) {
    return attention_output_and_mlp_kernel<float>(attn, o_w, o_b, residual, norm_w, eps,
                                                  gate_up_w, gate_up_b, down_w, down_b);
  }
  return attention_output_and_mlp_kernel<c10::BFloat16>(attn, o_w, o_b, residual, norm_w, eps,
                                                        gate_up_w, gate_up_b, down_w, down_b);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &plugserve::skinny::isa, "the instruction set this build uses: avx512_bf16, avx512 or none");
  m.def("attention_input", &attention_input,
        "rms_norm(hidden) @ qkv_w.T (+ b) with q and k rotated in place (CPU, few rows)");
  m.def("attention_output_and_mlp", &attention_output_and_mlp,
        "residual + o(attn), then + the gated MLP of its norm (CPU, few rows)");
}
