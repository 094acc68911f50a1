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
// with the few-row linear, the elementwise kernels and the paged-decode attention, so the
// results are those of the op-by-op path bit for bit (the Python side's references;
// tests/kernels/test_decode_layer.py). `DecodeStack` (ops/decode_stack.cpp) holds a model's
// layers so that a decode step runs all of them in one call.
//
// A projection's weight is dense (one [outputs, inputs] tensor of the layer's dtype, no
// formats) or GGML blocks (one uint8 tensor per run of rows of one format, stacked along the
// outputs, with the formats' names): those go to the few-row quantized kernel
// (ops/quant_linear.cpp) with int8 or float activations, as the op-by-op path does.
//
// Past the few-row kernel's rows (a decode batch of 9 .. ~96 rows), a dense projection may
// come with its batch pack, and then goes to the kernel plugserve.model.layers._dense_linear
// picks for those rows: the AMX linear for bf16 (ops/dense_amx.cpp), the panel GEMM for
// float32 (ops/linear.cpp); a quantized one goes to the many-row quantized path
// (ops/quant_linear.cpp: quant_gemm), part by part. The Python side
// (plugserve.kernels.decode_layer.DecodeStack) says which rows take which kernel and hands
// the packs from the kernels' own caches.
#include <ATen/ops/cat.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "../team.h"
#include "common.h"
#include "decode_layer.h"

namespace plugserve::ops {
namespace {

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2, what,
              ": a CPU tensor [rows, features] is needed, got ", x.sizes());
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, what,
              ": float32 or bfloat16 here, got ", dtype);
}

void check_matrix(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 2 && w.size(1) == x.size(1) && w.scalar_type() == x.scalar_type(),
              what, ": the weight must be [outputs, ", x.size(1), "] of ", x.scalar_type(),
              ", got ", w.sizes(), " of ", w.scalar_type());
}

void check_norm(const at::Tensor& x, const at::Tensor& w, const char* what) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == x.scalar_type(),
              what, ": the norm weight must be [", x.size(1), "] of ", x.scalar_type());
}

// plugserve.kernels.quant_linear's MAX_FEW_ROWS: the rows up to which a quantized projection
// takes the few-row kernel (past them the many-row path with quant_linear's STRIP_BYTES,
// kWeightStripBytes here: the decode stack multiplies as the op-by-op path does).
constexpr int64_t kQuantFewRows = 8;

// `buffer` where it has exactly `sizes` (and there is a scratch at all), else undefined (the
// op then allocates).
at::Tensor fit(const Scratch* s, const at::Tensor Scratch::*buffer, at::IntArrayRef sizes) {
  if (s == nullptr) return {};
  const at::Tensor& t = s->*buffer;
  return t.sizes() == sizes ? t : at::Tensor();
}

// x @ w.T (+ bias) into a new [rows, outputs] tensor (or `out`, where defined and the few-row
// kernels run), w dense (formats empty: w is one tensor) or quantized (w[i] the blocks of
// formats[i], stacked along the outputs). A dense w with a defined `pack` goes to the batch
// linear of x's dtype against that pack.
at::Tensor linear(const at::Tensor& x, const Tensors& w, const Strings& formats,
                  const OptTensor& bias, bool int8_activations, const char* what,
                  const at::Tensor& pack, const at::Tensor& out = {}) {
  if (formats.empty()) {
    TORCH_CHECK(w.size() == 1, what, ": a dense weight is one tensor, got ", w.size());
    check_matrix(x, w[0], what);
    if (pack.defined()) {  // a panel pack is [panels, K, width]; an AMX pack is not 3-d
      return pack.dim() == 3 ? panel_gemm(x, pack, w[0].size(0), bias)
                             : dense_amx_linear(x, pack, w[0].size(0), bias);
    }
    auto y = out_or_empty(out, {x.size(0), w[0].size(0)}, x, what);
    skinny_linear_into(x, w[0].contiguous(), bias_as_float(bias, w[0].size(0), what), y);
    return y;
  }
  TORCH_CHECK(!pack.defined(), what, ": a batch pack is for a dense weight, this one is ",
              formats.size(), " quantized part(s)");
  TORCH_CHECK(w.size() == formats.size(), what, ": ", w.size(), " quantized parts for ",
              formats.size(), " formats");
  const bool batch = x.size(0) > kQuantFewRows;
  // One part: the few-row kernel, or past its rows the many-row path with the strips
  // plugserve.kernels.quant_linear gives it (the dequantize-and-GEMM path's, where no AMX).
  const auto one = [&](const at::Tensor& part, const std::string& format,
                       const OptTensor& part_bias, const at::Tensor& into) {
    if (!batch) return quant_linear(x, part, format, part_bias, int8_activations, into);
    return quant_gemm(x, part, format, part_bias, int8_activations, kWeightStripBytes, "auto");
  };
  if (w.size() == 1) return one(w[0], formats[0], bias, out);
  int64_t outputs = 0;
  for (const auto& part : w) outputs += part.size(0);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == outputs, what, ": bias has ", bias->numel(),
              " values for ", outputs, " outputs");
  // The same values as part by part (each output row is computed alone), in one pass.
  if (int8_activations && !batch) return quant_linear_parts(x, w, formats, bias, out);
  Tensors outs;
  int64_t row = 0;
  for (size_t i = 0; i < w.size(); ++i) {  // as plugserve.model.quant_weight.quant_matmul
    const int64_t rows = w[i].size(0);
    const OptTensor part_bias = has_bias ? OptTensor(bias->narrow(0, row, rows)) : std::nullopt;
    outs.push_back(one(w[i], formats[i], part_bias, at::Tensor()));
    row += rows;
  }
  return at::cat(outs, 1);
}

// hidden += mlp for contiguous tensors of one shape and dtype (float32 or bf16), as torch's
// add_ computes it (the sum in float32, rounded to bf16 once), in a plain loop: at a decode
// step's few rows torch's add costs microseconds of dispatch per layer for a 576-wide row.
void add_in_place(at::Tensor& hidden, const at::Tensor& mlp) {
  TORCH_CHECK(hidden.sizes() == mlp.sizes() && hidden.scalar_type() == mlp.scalar_type() &&
                  hidden.is_contiguous() && mlp.is_contiguous(),
              "attention_output_and_mlp: the MLP output ", mlp.sizes(), " does not match the "
              "hidden rows ", hidden.sizes());
  const int64_t n = hidden.numel();
  if (hidden.scalar_type() == at::kFloat) {
    float* h = hidden.data_ptr<float>();
    const float* m = mlp.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) h[i] += m[i];
    return;
  }
  TORCH_CHECK(hidden.scalar_type() == at::kBFloat16, "attention_output_and_mlp: float32 or "
              "bfloat16 rows, got ", hidden.scalar_type());
  auto* h = hidden.data_ptr<at::BFloat16>();
  const auto* m = mlp.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < n; ++i) {
    h[i] = at::BFloat16(static_cast<float>(h[i]) + static_cast<float>(m[i]));
  }
}

at::Tensor attention_input_packed(at::Tensor hidden, at::Tensor norm_w, double eps,
                                  const Tensors& qkv_w, const Strings& qkv_formats,
                                  const OptTensor& qkv_b, const at::Tensor& cos,
                                  const at::Tensor& sin, int64_t rotated_heads,
                                  int64_t head_dim, bool int8_activations,
                                  const at::Tensor& qkv_pack, const Scratch* s = nullptr,
                                  const Tensors* read_next = nullptr) {
  check_rows(hidden, "attention_input");
  check_norm(hidden, norm_w, "attention_input");
  const int64_t qkv_outputs = outputs_of(qkv_w);
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && rotated_heads > 0 &&
                  rotated_heads * head_dim <= qkv_outputs,
              "attention_input: ", rotated_heads, " rotated heads of ", head_dim,
              " do not fit the ", qkv_outputs, " qkv outputs (head_dim must be even)");
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
  auto normed = fit(s, &Scratch::normed, hidden.sizes());
  if (!normed.defined()) normed = at::empty_like(hidden);
  rms_norm_into(hidden, norm_w, eps, /*unit_offset=*/false, normed);
  auto qkv = linear(normed, qkv_w, qkv_formats, qkv_b, int8_activations,
                    "attention_input (qkv)", qkv_pack,
                    fit(s, &Scratch::qkv, {hidden.size(0), qkv_outputs}));
  read_ahead(read_next);
  auto qk = qkv.narrow(1, 0, rotated_heads * head_dim).view({qkv.size(0), rotated_heads, head_dim});
  rope_in_place(qk, cos, sin);
  return qkv;
}

at::Tensor attention_input(at::Tensor hidden, at::Tensor norm_w, double eps, Tensors qkv_w,
                           Strings qkv_formats, OptTensor qkv_b, at::Tensor cos, at::Tensor sin,
                           int64_t rotated_heads, int64_t head_dim, bool int8_activations) {
  return attention_input_packed(std::move(hidden), std::move(norm_w), eps, qkv_w, qkv_formats,
                                qkv_b, cos, sin, rotated_heads, head_dim, int8_activations, {});
}

at::Tensor attention_output_and_mlp_packed(
    at::Tensor attn, const Tensors& o_w, const Strings& o_formats, const OptTensor& o_b,
    at::Tensor residual, at::Tensor norm_w, double eps, const Tensors& gate_up_w,
    const Strings& gate_up_formats, const OptTensor& gate_up_b, const Tensors& down_w,
    const Strings& down_formats, const OptTensor& down_b, bool int8_activations,
    const LayerPacks& packs, Scratch* s = nullptr, const Tensors* read_next = nullptr) {
  check_rows(attn, "attention_output_and_mlp");
  check_rows(residual, "attention_output_and_mlp (residual)");
  TORCH_CHECK(residual.scalar_type() == attn.scalar_type(),
              "attention_output_and_mlp: the residual's dtype ", residual.scalar_type(),
              " differs from ", attn.scalar_type());
  attn = attn.contiguous();
  residual = residual.contiguous();
  norm_w = norm_w.contiguous();
  const int64_t rows = attn.size(0), width = residual.size(1);
  const auto o = linear(attn, o_w, o_formats, o_b, int8_activations,
                        "attention_output_and_mlp (o)", packs.o,
                        fit(s, &Scratch::o, {rows, outputs_of(o_w)}));
  read_ahead(&gate_up_w);
  TORCH_CHECK(o.sizes() == residual.sizes(), "attention_output_and_mlp: the residual must be ",
              o.sizes(), ", got ", residual.sizes());
  check_norm(o, norm_w, "attention_output_and_mlp");
  auto mlp_in = fit(s, &Scratch::mlp_in, o.sizes());
  if (!mlp_in.defined()) mlp_in = at::empty_like(o);
  at::Tensor hidden;
  if (s != nullptr && s->hidden[s->next_hidden].sizes() == o.sizes()) {
    hidden = s->hidden[s->next_hidden];  // not `residual`: that is the other one
    s->next_hidden ^= 1;
  } else {
    hidden = at::empty_like(o);
  }
  add_rms_norm_into(o, residual, norm_w, eps, /*unit_offset=*/false, mlp_in, hidden);
  const auto gate_up = linear(mlp_in, gate_up_w, gate_up_formats, gate_up_b, int8_activations,
                              "attention_output_and_mlp (gate_up)", packs.gate_up,
                              fit(s, &Scratch::gate_up, {rows, outputs_of(gate_up_w)}));
  read_ahead(&down_w);
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "attention_output_and_mlp: gate_up has ",
              gate_up.size(1), " outputs; gate | up needs an even number");
  auto act = fit(s, &Scratch::act, {gate_up.size(0), gate_up.size(1) / 2});
  if (!act.defined()) act = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  silu_mul_into(gate_up, act);
  const auto mlp = linear(act, down_w, down_formats, down_b, int8_activations,
                          "attention_output_and_mlp (down)", packs.down,
                          fit(s, &Scratch::mlp, {rows, width}));
  read_ahead(read_next);
  add_in_place(hidden, mlp);  // the sum rounded to T once, as `hidden + mlp` does
  return hidden;
}

at::Tensor attention_output_and_mlp(at::Tensor attn, Tensors o_w, Strings o_formats,
                                    OptTensor o_b, at::Tensor residual, at::Tensor norm_w,
                                    double eps, Tensors gate_up_w, Strings gate_up_formats,
                                    OptTensor gate_up_b, Tensors down_w, Strings down_formats,
                                    OptTensor down_b, bool int8_activations) {
  return attention_output_and_mlp_packed(
      std::move(attn), o_w, o_formats, o_b, std::move(residual), std::move(norm_w), eps,
      gate_up_w, gate_up_formats, gate_up_b, down_w, down_formats, down_b, int8_activations,
      LayerPacks{});
}

}  // namespace

namespace decode {

// Inside a stack call's team (team.h): its waiting threads read `w` (the next projection's
// weight parts) ahead while this thread runs the serial work before that projection.
void read_ahead(const Tensors* w) {
  team::Team* tm = team::current();
  if (tm == nullptr || w == nullptr) return;
  team::Range ranges[team::kMaxRanges];
  int count = 0;
  for (const auto& part : *w) {
    if (count == team::kMaxRanges || !part.is_contiguous()) break;
    ranges[count++] = team::Range{part.const_data_ptr(), static_cast<int64_t>(part.nbytes())};
  }
  team::prefetch(tm, ranges, count);
}

int64_t outputs_of(const Tensors& w) {
  int64_t outputs = 0;
  for (const auto& part : w) outputs += part.size(0);
  return outputs;
}

// The whole layer for one decode step whose attention is the paged-decode kernel (a
// backend's `PagedDecodePlan`): attention_input, the new k and v rows stored at store_slots
// of the cache buffers (in the cache's dtype), paged_decode over slots[i,
// first_key[i]:kv_lens[i]], then attention_output_and_mlp. What the backend's `forward`
// does between the two halves, here without returning to Python.
at::Tensor decode_step_packed(
    at::Tensor hidden, const at::Tensor& input_norm_w, double input_eps, const Tensors& qkv_w,
    const Strings& qkv_formats, const OptTensor& qkv_b, const at::Tensor& cos,
    const at::Tensor& sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
    at::Tensor k_buffer, at::Tensor v_buffer, at::Tensor store_slots, const at::Tensor& slots,
    const at::Tensor& first_key, const at::Tensor& kv_lens, double scale, const Tensors& o_w,
    const Strings& o_formats, const OptTensor& o_b, const at::Tensor& post_norm_w,
    double post_eps, const Tensors& gate_up_w, const Strings& gate_up_formats,
    const OptTensor& gate_up_b, const Tensors& down_w, const Strings& down_formats,
    const OptTensor& down_b, bool int8_activations, const LayerPacks& packs, Scratch* s,
    const Tensors* next_qkv_w) {
  const int64_t rows = hidden.size(0);
  for (const auto* buffer : {&k_buffer, &v_buffer}) {
    const auto dtype = buffer->scalar_type();
    TORCH_CHECK(dtype == hidden.scalar_type() || dtype == at::kBFloat16 ||
                    dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2,
                "decode_step: the KV cache holds ", dtype, ", the layer computes in ",
                hidden.scalar_type(), " (a cache holds the layer's dtype, bfloat16 or an fp8 "
                "format)");
  }
  TORCH_CHECK(store_slots.scalar_type() == at::kLong && store_slots.dim() == 1 &&
                  store_slots.size(0) == rows,
              "decode_step: one int64 store slot per row is needed, got ", store_slots.sizes(),
              " of ", store_slots.scalar_type(), " for ", rows, " rows");
  const auto qkv = attention_input_packed(hidden, input_norm_w, input_eps, qkv_w, qkv_formats,
                                          qkv_b, cos, sin, heads + kv_heads, head_dim,
                                          int8_activations, packs.qkv, s, &o_w);
  const int64_t q_width = heads * head_dim, kv_width = kv_heads * head_dim;
  TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_width, "decode_step: the qkv projection has ",
              qkv.size(1), " outputs, not ", q_width + 2 * kv_width, " for ", heads, " + 2 x ",
              kv_heads, " heads of ", head_dim);
  const auto q = qkv.narrow(1, 0, q_width).view({rows, heads, head_dim});
  const auto k = qkv.narrow(1, q_width, kv_width).view({rows, kv_heads, head_dim});
  const auto v = qkv.narrow(1, q_width + kv_width, kv_width).view({rows, kv_heads, head_dim});
  store_slots = store_slots.contiguous();
  store_rows(k_buffer, store_slots, k, 1.0);
  store_rows(v_buffer, store_slots, v, 1.0);
  const auto attn = paged_decode(q, k_buffer, v_buffer, slots, first_key, kv_lens, scale, 1.0,
                                 1.0, fit(s, &Scratch::attn, q.sizes()));
  return attention_output_and_mlp_packed(attn.view({rows, q_width}), o_w, o_formats, o_b,
                                         hidden, post_norm_w, post_eps, gate_up_w,
                                         gate_up_formats, gate_up_b, down_w, down_formats,
                                         down_b, int8_activations, packs, s, next_qkv_w);
}

}  // namespace decode

namespace {

at::Tensor decode_step(at::Tensor hidden, at::Tensor input_norm_w, double input_eps,
                       Tensors qkv_w, Strings qkv_formats, OptTensor qkv_b, at::Tensor cos,
                       at::Tensor sin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                       at::Tensor k_buffer, at::Tensor v_buffer, at::Tensor store_slots,
                       at::Tensor slots, at::Tensor first_key, at::Tensor kv_lens, double scale,
                       Tensors o_w, Strings o_formats, OptTensor o_b, at::Tensor post_norm_w,
                       double post_eps, Tensors gate_up_w, Strings gate_up_formats,
                       OptTensor gate_up_b, Tensors down_w, Strings down_formats,
                       OptTensor down_b, bool int8_activations) {
  return decode_step_packed(std::move(hidden), input_norm_w, input_eps, qkv_w, qkv_formats,
                            qkv_b, cos, sin, heads, kv_heads, head_dim, std::move(k_buffer),
                            std::move(v_buffer), std::move(store_slots), slots, first_key,
                            kv_lens, scale, o_w, o_formats, o_b, post_norm_w, post_eps,
                            gate_up_w, gate_up_formats, gate_up_b, down_w, down_formats,
                            down_b, int8_activations, LayerPacks{}, nullptr);
}

}  // namespace
}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("attention_input(Tensor hidden, Tensor norm_w, float eps, Tensor[] qkv_w, "
        "str[] qkv_formats, Tensor? qkv_b, Tensor cos, Tensor sin, int rotated_heads, "
        "int head_dim, bool int8_activations) -> Tensor",
        &plugserve::ops::attention_input);
  m.def("attention_output_and_mlp(Tensor attn, Tensor[] o_w, str[] o_formats, Tensor? o_b, "
        "Tensor residual, Tensor norm_w, float eps, Tensor[] gate_up_w, str[] gate_up_formats, "
        "Tensor? gate_up_b, Tensor[] down_w, str[] down_formats, Tensor? down_b, "
        "bool int8_activations) -> Tensor",
        &plugserve::ops::attention_output_and_mlp);
  m.def("decode_step(Tensor hidden, Tensor input_norm_w, float input_eps, Tensor[] qkv_w, "
        "str[] qkv_formats, Tensor? qkv_b, Tensor cos, Tensor sin, int heads, int kv_heads, "
        "int head_dim, Tensor(a!) k_buffer, Tensor(b!) v_buffer, Tensor store_slots, "
        "Tensor slots, Tensor first_key, Tensor kv_lens, float scale, Tensor[] o_w, "
        "str[] o_formats, Tensor? o_b, Tensor post_norm_w, float post_eps, Tensor[] gate_up_w, "
        "str[] gate_up_formats, Tensor? gate_up_b, Tensor[] down_w, str[] down_formats, "
        "Tensor? down_b, bool int8_activations) -> Tensor",
        &plugserve::ops::decode_step);
}
