// A Llama decoder layer for the few rows of a decode step, in one or two calls instead of a
// dozen, on the CPU.
//
// At batch 1 a layer's work is a few microseconds per step above its weight stream, but run
// op by op from Python it costs ~70 us of interpreter and dispatch time (2 ms of a 12 ms bf16
// step over 30 layers). Here the same kernels run back to back in C++:
//   attention_input            qkv = rms_norm(hidden) @ qkv_w.T (+ b), q and k rotated in place
//   attention_output_and_mlp   h = residual + attn @ o_w.T (+ b); x = rms_norm(h);
//                              returns h + down(silu(gate(x)) * up(x)) (+ biases)
//   decode_step                both, with the KV store and the paged-decode attention between
//                              (for a backend whose decode is that kernel)
// with the streaming linear of skinny_linear.h, the elementwise kernels of elementwise.h and
// the attention of paged_decode.h, so the results are those of the op-by-op path bit for bit
// (the Python side's references; tests/kernels/test_decode_layer.py).
#include <torch/extension.h>

#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "elementwise.h"
#include "paged_decode.h"
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
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, what,
              ": a CPU tensor [rows, features] is needed, got ", x.sizes());
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

// buffer[slots[r]] = rows[r] for each row r: the new tokens' k or v written into the cache.
// rows [n, kv_heads, head_dim] may be a view with a contiguous last two dims (inside qkv).
void store_rows(torch::Tensor& buffer, const torch::Tensor& slots, const torch::Tensor& rows) {
  TORCH_CHECK(buffer.dim() == 3 && buffer.size(1) == rows.size(1) &&
                  buffer.size(2) == rows.size(2) && buffer.stride(2) == 1 &&
                  buffer.stride(1) == buffer.size(2) && rows.stride(2) == 1 &&
                  rows.stride(1) == rows.size(2),
              "decode_step: the cache buffer ", buffer.sizes(), " does not take rows ",
              rows.sizes());
  const int64_t row_bytes = rows.size(1) * rows.size(2) * rows.element_size();
  const int64_t capacity = buffer.size(0);
  const auto* slot = slots.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(buffer.data_ptr());
  const auto* src = static_cast<const char*>(rows.data_ptr());
  for (int64_t r = 0; r < rows.size(0); ++r) {  // all checked before anything is written
    TORCH_CHECK(slot[r] >= 0 && slot[r] < capacity, "decode_step: store slot ", slot[r],
                " is outside the cache's ", capacity, " slots");
  }
  for (int64_t r = 0; r < rows.size(0); ++r) {
    std::memcpy(dst + slot[r] * buffer.stride(0) * buffer.element_size(),
                src + r * rows.stride(0) * rows.element_size(), row_bytes);
  }
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

// The whole layer for one decode step whose attention is the paged-decode kernel (a
// backend's `PagedDecodePlan`): attention_input, the new k and v rows stored at store_slots
// of the cache buffers, paged_decode over slots[i, first_key[i]:kv_lens[i]], then
// attention_output_and_mlp. What the backend's `forward` does between the two halves, here
// without returning to Python.
torch::Tensor decode_step(torch::Tensor hidden, torch::Tensor input_norm_w, double input_eps,
                          torch::Tensor qkv_w, c10::optional<torch::Tensor> qkv_b,
                          torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t kv_heads,
                          int64_t head_dim, torch::Tensor k_buffer, torch::Tensor v_buffer,
                          torch::Tensor store_slots, torch::Tensor slots, torch::Tensor first_key,
                          torch::Tensor kv_lens, double scale, torch::Tensor o_w,
                          c10::optional<torch::Tensor> o_b, torch::Tensor post_norm_w,
                          double post_eps, torch::Tensor gate_up_w,
                          c10::optional<torch::Tensor> gate_up_b, torch::Tensor down_w,
                          c10::optional<torch::Tensor> down_b) {
  const int64_t rows = hidden.size(0);
  TORCH_CHECK(k_buffer.scalar_type() == hidden.scalar_type() &&
                  v_buffer.scalar_type() == hidden.scalar_type(),
              "decode_step: the KV cache holds ", k_buffer.scalar_type(),
              ", the layer computes in ", hidden.scalar_type());
  TORCH_CHECK(store_slots.scalar_type() == torch::kInt64 && store_slots.dim() == 1 &&
                  store_slots.size(0) == rows,
              "decode_step: one int64 store slot per row is needed, got ", store_slots.sizes(),
              " of ", store_slots.scalar_type(), " for ", rows, " rows");
  const auto qkv = attention_input(hidden, input_norm_w, input_eps, qkv_w, qkv_b, cos, sin,
                                   heads + kv_heads, head_dim);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "decode_step: the qkv projection has ",
              qkv.size(1), " outputs, not ", q_width + 2 * kv_width, " for ", heads, " + 2 x ",
              kv_heads, " heads of ", head_dim);
  const auto q = qkv.narrow(1, 0, q_width).view({rows, heads, head_dim});
  const auto k = qkv.narrow(1, q_width, kv_width).view({rows, kv_heads, head_dim});
  const auto v = qkv.narrow(1, q_width + kv_width, kv_width).view({rows, kv_heads, head_dim});
  store_slots = store_slots.contiguous();
  store_rows(k_buffer, store_slots, k);
  store_rows(v_buffer, store_slots, v);
  const auto attn = plugserve::paged::paged_decode(q, k_buffer, v_buffer, slots, first_key,
                                                   kv_lens, scale);
  return attention_output_and_mlp(attn.view({rows, q_width}), o_w, o_b, hidden, post_norm_w,
                                  post_eps, gate_up_w, gate_up_b, down_w, down_b);
}

// A model's decoder layers for `decode_step`, held once so that a decode step runs all of
// them in one call: the weights (tensors that share the parameters' storage, so in-place
// weight loads are seen) and each layer's shape. A layer's attention operands change every
// step and come with `run`, one entry per layer, as the backend's plans give them.
class DecodeStack {
 public:
  DecodeStack(std::vector<torch::Tensor> input_norm_w, std::vector<double> input_eps,
              std::vector<torch::Tensor> qkv_w, std::vector<c10::optional<torch::Tensor>> qkv_b,
              std::vector<int64_t> heads, std::vector<int64_t> kv_heads,
              std::vector<int64_t> head_dim, std::vector<torch::Tensor> o_w,
              std::vector<c10::optional<torch::Tensor>> o_b,
              std::vector<torch::Tensor> post_norm_w, std::vector<double> post_eps,
              std::vector<torch::Tensor> gate_up_w,
              std::vector<c10::optional<torch::Tensor>> gate_up_b,
              std::vector<torch::Tensor> down_w,
              std::vector<c10::optional<torch::Tensor>> down_b)
      : input_norm_w_(std::move(input_norm_w)), input_eps_(std::move(input_eps)),
        qkv_w_(std::move(qkv_w)), qkv_b_(std::move(qkv_b)), heads_(std::move(heads)),
        kv_heads_(std::move(kv_heads)), head_dim_(std::move(head_dim)), o_w_(std::move(o_w)),
        o_b_(std::move(o_b)), post_norm_w_(std::move(post_norm_w)),
        post_eps_(std::move(post_eps)), gate_up_w_(std::move(gate_up_w)),
        gate_up_b_(std::move(gate_up_b)), down_w_(std::move(down_w)),
        down_b_(std::move(down_b)) {
    const size_t n = input_norm_w_.size();
    for (const size_t size :
         {input_eps_.size(), qkv_w_.size(), qkv_b_.size(), heads_.size(), kv_heads_.size(),
          head_dim_.size(), o_w_.size(), o_b_.size(), post_norm_w_.size(), post_eps_.size(),
          gate_up_w_.size(), gate_up_b_.size(), down_w_.size(), down_b_.size()}) {
      TORCH_CHECK(size == n, "DecodeStack: every field needs one entry per layer (", n,
                  " layers), one has ", size);
    }
  }

  int64_t layers() const { return static_cast<int64_t>(input_norm_w_.size()); }

  // hidden through every layer's decode_step; cos / sin are every layer's rope angles, and
  // layer i's attention is k_buffers[i], v_buffers[i], store_slots[i], slots[i],
  // first_key[i], kv_lens[i] and scales[i] (its PagedDecodePlan).
  torch::Tensor run(torch::Tensor hidden, const torch::Tensor& cos, const torch::Tensor& sin,
                    const std::vector<torch::Tensor>& k_buffers,
                    const std::vector<torch::Tensor>& v_buffers,
                    const std::vector<torch::Tensor>& store_slots,
                    const std::vector<torch::Tensor>& slots,
                    const std::vector<torch::Tensor>& first_key,
                    const std::vector<torch::Tensor>& kv_lens,
                    const std::vector<double>& scales) const {
    const size_t n = input_norm_w_.size();
    for (const size_t size : {k_buffers.size(), v_buffers.size(), store_slots.size(),
                              slots.size(), first_key.size(), kv_lens.size(), scales.size()}) {
      TORCH_CHECK(size == n, "DecodeStack.run: one plan per layer is needed (", n,
                  " layers), got ", size);
    }
    for (size_t i = 0; i < n; ++i) {
      hidden = decode_step(hidden, input_norm_w_[i], input_eps_[i], qkv_w_[i], qkv_b_[i], cos,
                           sin, heads_[i], kv_heads_[i], head_dim_[i], k_buffers[i],
                           v_buffers[i], store_slots[i], slots[i], first_key[i], kv_lens[i],
                           scales[i], o_w_[i], o_b_[i], post_norm_w_[i], post_eps_[i],
                           gate_up_w_[i], gate_up_b_[i], down_w_[i], down_b_[i]);
    }
    return hidden;
  }

 private:
  std::vector<torch::Tensor> input_norm_w_;
  std::vector<double> input_eps_;
  std::vector<torch::Tensor> qkv_w_;
  std::vector<c10::optional<torch::Tensor>> qkv_b_;
  std::vector<int64_t> heads_, kv_heads_, head_dim_;
  std::vector<torch::Tensor> o_w_;
  std::vector<c10::optional<torch::Tensor>> o_b_;
  std::vector<torch::Tensor> post_norm_w_;
  std::vector<double> post_eps_;
  std::vector<torch::Tensor> gate_up_w_;
  std::vector<c10::optional<torch::Tensor>> gate_up_b_;
  std::vector<torch::Tensor> down_w_;
  std::vector<c10::optional<torch::Tensor>> down_b_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &plugserve::skinny::isa,
        "the instruction set this build uses: avx512_bf16, avx512 or none");
  m.def("attention_input", &attention_input,
        "rms_norm(hidden) @ qkv_w.T (+ b) with q and k rotated in place (CPU, few rows)");
  m.def("attention_output_and_mlp", &attention_output_and_mlp,
        "residual + o(attn), then + the gated MLP of its norm (CPU, few rows)");
  m.def("decode_step", &decode_step,
        "a whole decoder layer for a decode step over a paged KV cache (CPU, few rows)");
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<std::vector<torch::Tensor>, std::vector<double>,
                          std::vector<torch::Tensor>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>,
                          std::vector<torch::Tensor>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<torch::Tensor>, std::vector<double>,
                          std::vector<torch::Tensor>, std::vector<c10::optional<torch::Tensor>>,
                          std::vector<torch::Tensor>,
                          std::vector<c10::optional<torch::Tensor>>>())
      .def_property_readonly("layers", &DecodeStack::layers)
      .def("run", &DecodeStack::run,
           "every layer's decode_step in turn, with one plan's operands per layer");
}
