// What ops/decode_stack.cpp shares with ops/decode_layer.cpp: a layer's batch packs, the
// buffers a stack call reuses from layer to layer, and the whole decode-step layer
// (`decode_step_packed`, defined in decode_layer.cpp).
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <optional>
#include <string>
#include <vector>

namespace plugserve::ops::decode {

using OptTensor = std::optional<at::Tensor>;
using Tensors = std::vector<at::Tensor>;
using Strings = std::vector<std::string>;

// A layer's batch packs, one per projection (all undefined: the few-row kernels).
struct LayerPacks {
  at::Tensor qkv, o, gate_up, down;
};

// Buffers one stack call reuses layer after layer for its few rows, so that a layer's
// intermediate results cost no allocation each (a decode step is ~10 of them per layer).
// Sized from the first layer; a layer of another shape gets new tensors (`fit`). A layer
// reads the hidden rows the previous one wrote, so the hidden rows alternate between two.
struct Scratch {
  at::Tensor normed, qkv, attn, o, mlp_in, gate_up, act, mlp;
  at::Tensor hidden[2];
  int next_hidden = 0;

  Scratch(const at::Tensor& x, int64_t qkv_outputs, int64_t heads, int64_t head_dim,
          int64_t gate_up_outputs) {
    const int64_t rows = x.size(0), width = x.size(1);
    const auto opts = x.options();
    normed = at::empty({rows, width}, opts);
    qkv = at::empty({rows, qkv_outputs}, opts);
    attn = at::empty({rows, heads, head_dim}, opts);
    o = at::empty({rows, width}, opts);
    mlp_in = at::empty({rows, width}, opts);
    gate_up = at::empty({rows, gate_up_outputs}, opts);
    act = at::empty({rows, gate_up_outputs / 2}, opts);
    mlp = at::empty({rows, width}, opts);
    hidden[0] = at::empty({rows, width}, opts);
    hidden[1] = at::empty({rows, width}, opts);
  }
};

// The outputs of a projection held as one dense tensor or as stacked quantized parts.
int64_t outputs_of(const Tensors& w);

// Inside a stack call's team (team.h): its waiting threads read `w` (the next projection's
// weight parts; null: nothing) ahead while this thread runs the serial work before it.
void read_ahead(const Tensors* w);

// One Llama-form layer of a decode step whose attention is the paged-decode kernel: the
// attention input, the new k and v rows stored at store_slots, paged_decode over the slots,
// then the attention output and the MLP (ops/decode_layer.cpp). `packs` (batch rows) or
// `s` (few rows, reused buffers) may be empty / null. Inside a team (team.h) each projection
// asks the waiting threads to read the next one's weights ahead, the last one the next
// layer's `next_qkv_w` (null: none).
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
    const Tensors* next_qkv_w = nullptr);

}  // namespace plugserve::ops::decode

// The names both files use (only they include this header).
namespace plugserve::ops {
using decode::LayerPacks;
using decode::OptTensor;
using decode::outputs_of;
using decode::read_ahead;
using decode::Scratch;
using decode::Strings;
using decode::Tensors;
}  // namespace plugserve::ops
