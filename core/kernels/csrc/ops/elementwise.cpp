// Elementwise ops (kernels/elementwise.cpp documents what each computes and where it rounds)
// and greedy sampling's row argmax (kernels/row_argmax.cpp).
//
// Rows (every index but the last) may have any strides; the last dim must be contiguous (a
// strided one is copied first), so a view such as the q heads inside a fused qkv output is
// read where it lies. Outputs are new contiguous tensors.
#include <tuple>

#include "common.h"

namespace plugserve::ops {

void rms_norm_into(const at::Tensor& x, const at::Tensor& w, double eps, bool unit_offset,
                   at::Tensor& out) {
  NormArgs a{};
  a.x = x.data_ptr();
  a.x_rows = row_layout(x);
  a.weight = w.data_ptr();
  a.out = out.data_ptr();
  a.n = x.size(-1);
  a.rows = rows_of(x);
  a.eps = static_cast<float>(eps);
  a.unit_offset = unit_offset;
  a.dtype = float_dtype(x, "rms_norm");
  kernels().rms_norm(a);
}

void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                       double eps, bool unit_offset, at::Tensor& out, at::Tensor& new_residual) {
  NormArgs a{};
  a.x = x.data_ptr();
  a.x_rows = row_layout(x);
  a.residual = residual.data_ptr();
  a.residual_rows = row_layout(residual);
  a.weight = w.data_ptr();
  a.out = out.data_ptr();
  a.new_residual = new_residual.data_ptr();
  a.n = x.size(-1);
  a.rows = rows_of(x);
  a.eps = static_cast<float>(eps);
  a.unit_offset = unit_offset;
  a.dtype = float_dtype(x, "add_rms_norm");
  kernels().add_rms_norm(a);
}

void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out) {
  SiluMulArgs a{};
  a.gate_up = gate_up.data_ptr();
  a.rows_layout = row_layout(gate_up);
  a.out = out.data_ptr();
  a.width = out.size(-1);
  a.rows = rows_of(gate_up);
  a.dtype = float_dtype(gate_up, "silu_mul");
  kernels().silu_mul(a);
}

void rope_in_place(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  RopeArgs a{};
  a.x = x.data_ptr();
  a.tokens = x.size(0);
  a.heads = x.size(1);
  a.half = x.size(2) / 2;
  a.token_stride = x.stride(0);
  a.head_stride = x.stride(1);
  a.cos = cos.data_ptr();
  a.sin = sin.data_ptr();
  a.cos_stride = cos.stride(0);
  a.sin_stride = sin.stride(0);
  a.dtype = float_dtype(x, "rope_");
  kernels().rope(a);
}

namespace {

void check_input(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(x.dim() >= 1, what, ": the input needs at least one dim");
  float_dtype(x, what);
}

void check_weight(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), what, ": the weight must be [",
              x.size(-1), "]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), what, ": the weight's dtype differs");
}

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps, bool unit_offset) {
  check_input(x, "rms_norm");
  check_weight(x, weight, "rms_norm");
  x = last_dim_contiguous(x);
  weight = weight.contiguous();
  auto out = at::empty(x.sizes(), x.options());
  if (x.numel() > 0) rms_norm_into(x, weight, eps, unit_offset, out);
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual,
                                                at::Tensor weight, double eps, bool unit_offset) {
  check_input(x, "add_rms_norm");
  check_weight(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
                  residual.device().is_cpu(),
              "add_rms_norm: x and residual differ in shape or dtype");
  x = last_dim_contiguous(x);
  residual = last_dim_contiguous(residual);
  weight = weight.contiguous();
  auto out = at::empty(x.sizes(), x.options());
  auto new_residual = at::empty(x.sizes(), x.options());
  if (x.numel() > 0) add_rms_norm_into(x, residual, weight, eps, unit_offset, out, new_residual);
  return {out, new_residual};
}

at::Tensor silu_mul(at::Tensor gate_up) {
  check_input(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(-1) % 2 == 0, "silu_mul: the last dim (gate | up) must be even");
  gate_up = last_dim_contiguous(gate_up);
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  auto out = at::empty(sizes, gate_up.options());
  if (out.numel() > 0) silu_mul_into(gate_up, out);
  return out;
}

void rope_(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  check_input(x, "rope_");
  TORCH_CHECK(x.dim() == 3 && x.size(2) % 2 == 0 && x.stride(2) == 1,
              "rope_: x must be [tokens, heads, head_dim] with an even, contiguous head_dim, got ",
              x.sizes(), " with strides ", x.strides());
  const int64_t half = x.size(2) / 2;
  for (const auto* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "rope_: cos/sin dtype ", t->scalar_type(),
                " differs from x's ", x.scalar_type());
    TORCH_CHECK(t->size(0) == x.size(0) && t->size(-1) == half &&
                    t->numel() == x.size(0) * half && t->stride(-1) == 1,
                "rope_: cos and sin must hold ", half, " contiguous values per token for ",
                x.size(0), " tokens, got ", t->sizes());
  }
  if (x.numel() > 0) rope_in_place(x, cos, sin);
}

std::tuple<at::Tensor, at::Tensor> row_argmax(at::Tensor logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 &&
                  logits.scalar_type() == at::kFloat,
              "row_argmax: float32 CPU logits [rows, vocab] are needed, got ", logits.sizes(),
              " of ", logits.scalar_type(), " on ", logits.device());
  TORCH_CHECK(logits.size(1) > 0, "row_argmax: the vocab dim is empty");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0);
  auto maxes = at::empty({rows}, logits.options());
  auto ids = at::empty({rows}, logits.options().dtype(at::kLong));
  RowArgmaxArgs a{logits.data_ptr<float>(), rows, logits.size(1), maxes.data_ptr<float>(),
                  ids.data_ptr<int64_t>()};
  kernels().row_argmax(a);
  return {maxes, ids};
}

}  // namespace
}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool unit_offset) -> Tensor",
        &plugserve::ops::rms_norm);
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps, bool unit_offset) "
        "-> (Tensor, Tensor)",
        &plugserve::ops::add_rms_norm);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &plugserve::ops::silu_mul);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &plugserve::ops::rope_);
  m.def("row_argmax(Tensor logits) -> (Tensor, Tensor)", &plugserve::ops::row_argmax);
}
