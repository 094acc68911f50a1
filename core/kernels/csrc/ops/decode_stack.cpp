// A model's decoder layers held once (`DecodeStack`), so that a decode step runs all of them
// in one call of ops/decode_layer.cpp's layer step.
#include <torch/custom_class.h>
#include <torch/library.h>

#include <memory>
#include <utility>
#include <vector>

#include "../team.h"
#include "decode_layer.h"

namespace plugserve::ops {
namespace {

using decode::decode_step_packed;

// A model's decoder layers for `decode_step`, held once so that a decode step runs all of
// them in one call: the weights (tensors that share the parameters' storage, so in-place
// weight loads are seen; a projection's parts and formats as `linear` takes them) and each
// layer's shape. A layer's attention operands change every step and come with `run`, one
// entry per layer, as the backend's plans give them. The dense projections' batch packs
// (set_packs) are those the Python side holds in the kernels' caches, set again whenever a
// weight's version or the ISA in use moves; `run` uses them where it is told to (batch rows).
struct DecodeStack : torch::CustomClassHolder {
  using Layers = std::vector<Tensors>;
  using LayerFormats = std::vector<Strings>;
  std::vector<at::Tensor> input_norm_w, post_norm_w;
  Layers qkv_w, o_w, gate_up_w, down_w;
  LayerFormats qkv_f, o_f, gate_up_f, down_f;
  std::vector<OptTensor> qkv_b, o_b, gate_up_b, down_b;
  std::vector<double> input_eps, post_eps;
  std::vector<int64_t> heads, kv_heads, head_dim, int8_activations;
  std::vector<LayerPacks> packs;  // none, or one per layer
  bool all_quantized = false;     // every projection of every layer is GGML blocks
  Tensors kv_k, kv_v;  // set_kv: every layer's cache buffers, for run_shared
  std::vector<double> kv_scales;

  DecodeStack(Tensors input_norm_w_, std::vector<double> input_eps_, Layers qkv_w_,
              LayerFormats qkv_f_, std::vector<OptTensor> qkv_b_, std::vector<int64_t> heads_,
              std::vector<int64_t> kv_heads_, std::vector<int64_t> head_dim_, Layers o_w_,
              LayerFormats o_f_, std::vector<OptTensor> o_b_, Tensors post_norm_w_,
              std::vector<double> post_eps_, Layers gate_up_w_, LayerFormats gate_up_f_,
              std::vector<OptTensor> gate_up_b_, Layers down_w_, LayerFormats down_f_,
              std::vector<OptTensor> down_b_, std::vector<int64_t> int8_activations_)
      : input_norm_w(std::move(input_norm_w_)), post_norm_w(std::move(post_norm_w_)),
        qkv_w(std::move(qkv_w_)), o_w(std::move(o_w_)), gate_up_w(std::move(gate_up_w_)),
        down_w(std::move(down_w_)), qkv_f(std::move(qkv_f_)), o_f(std::move(o_f_)),
        gate_up_f(std::move(gate_up_f_)), down_f(std::move(down_f_)),
        qkv_b(std::move(qkv_b_)), o_b(std::move(o_b_)), gate_up_b(std::move(gate_up_b_)),
        down_b(std::move(down_b_)), input_eps(std::move(input_eps_)),
        post_eps(std::move(post_eps_)), heads(std::move(heads_)),
        kv_heads(std::move(kv_heads_)), head_dim(std::move(head_dim_)),
        int8_activations(std::move(int8_activations_)) {
    const size_t n = input_norm_w.size();
    for (const size_t size :
         {input_eps.size(), qkv_w.size(), qkv_f.size(), qkv_b.size(), heads.size(),
          kv_heads.size(), head_dim.size(), o_w.size(), o_f.size(), o_b.size(),
          post_norm_w.size(), post_eps.size(), gate_up_w.size(), gate_up_f.size(),
          gate_up_b.size(), down_w.size(), down_f.size(), down_b.size(),
          int8_activations.size()}) {
      TORCH_CHECK(size == n, "DecodeStack: every field needs one entry per layer (", n,
                  " layers), one has ", size);
    }
    all_quantized = n > 0;
    for (size_t i = 0; i < n; ++i) {
      all_quantized = all_quantized && !qkv_f[i].empty() && !o_f[i].empty() &&
                      !gate_up_f[i].empty() && !down_f[i].empty();
    }
  }
  // Batch rows need every layer's batch packs (set_packs), unless no projection is dense:
  // the quantized ones multiply their blocks as stored.
  void check_batch(bool batch, const char* what) const {
    TORCH_CHECK(!batch || all_quantized || packs.size() == input_norm_w.size(), what,
                ": batch rows need every layer's batch packs (set_packs), the stack holds ",
                packs.size(), " for ", input_norm_w.size(), " layers");
  }
  const LayerPacks& packs_of(size_t layer, bool batch) const {
    static const LayerPacks none;
    return batch && !packs.empty() ? packs[layer] : none;
  }

  int64_t layers() const { return static_cast<int64_t>(input_norm_w.size()); }

  // The buffers a call over few rows reuses from layer to layer (none for batch rows, whose
  // linears allocate their own), shaped after the first layer.
  std::unique_ptr<Scratch> few_rows_scratch(const at::Tensor& hidden, bool batch) const {
    if (batch || input_norm_w.empty() || hidden.dim() != 2) return nullptr;
    return std::make_unique<Scratch>(hidden, outputs_of(qkv_w[0]), heads[0], head_dim[0],
                                     outputs_of(gate_up_w[0]));
  }

  // One layer's attention operands for `run_layers` (what its PagedDecodePlan holds).
  struct Attention {
    const at::Tensor &k, &v, &store_slots, &slots, &first_key, &kv_lens;
    double scale;
  };

  // hidden through every layer's decode_step, layer i's attention being attention(i). Over
  // few rows the call is one team (team.h: one OpenMP region, the waiting threads reading the
  // next weights ahead, layer 0's qkv asked for first); batch rows run as they are (their
  // kernels open regions of their own).
  template <typename AttentionOf>
  at::Tensor run_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                        bool batch, const AttentionOf& attention) const {
    auto layers = [&](Scratch* scratch) {
      at::Tensor h = hidden;
      for (size_t i = 0; i < input_norm_w.size(); ++i) {
        const Attention a = attention(i);
        h = decode_step_packed(
            h, input_norm_w[i], input_eps[i], qkv_w[i], qkv_f[i], qkv_b[i], cos, sin, heads[i],
            kv_heads[i], head_dim[i], a.k, a.v, a.store_slots, a.slots, a.first_key,
            a.kv_lens, a.scale, o_w[i], o_f[i], o_b[i], post_norm_w[i], post_eps[i],
            gate_up_w[i], gate_up_f[i], gate_up_b[i], down_w[i], down_f[i], down_b[i],
            int8_activations[i] != 0, packs_of(i, batch), scratch, next_qkv(i));
      }
      return h;
    };
    auto scratch = few_rows_scratch(hidden, batch);
    if (scratch == nullptr) return layers(nullptr);
    at::Tensor out;
    team::with_team([&] {
      if (!qkv_w.empty()) read_ahead(&qkv_w[0]);
      out = layers(scratch.get());
    });
    return out;
  }

  // The next layer's qkv weights (for the read-ahead), or null after the last layer.
  const Tensors* next_qkv(size_t layer) const {
    return layer + 1 < qkv_w.size() ? &qkv_w[layer + 1] : nullptr;
  }

  // Every layer's batch packs (one tensor per layer and projection), or none (empty lists).
  void set_packs(Tensors qkv, Tensors o, Tensors gate_up, Tensors down) {
    const size_t n = input_norm_w.size(), given = qkv.size();
    TORCH_CHECK((given == n || given == 0) && o.size() == given &&
                    gate_up.size() == given && down.size() == given,
                "DecodeStack.set_packs: one pack per layer and projection is needed (", n,
                " layers), got ", qkv.size(), ", ", o.size(), ", ", gate_up.size(), ", ",
                down.size());
    for (size_t i = 0; i < given; ++i) {
      TORCH_CHECK(qkv_f[i].empty() && o_f[i].empty() && gate_up_f[i].empty() &&
                      down_f[i].empty(),
                  "DecodeStack.set_packs: layer ", i, " has quantized projections; batch "
                  "packs are for dense weights");
    }
    packs.clear();
    for (size_t i = 0; i < given; ++i) {
      packs.push_back(LayerPacks{std::move(qkv[i]), std::move(o[i]), std::move(gate_up[i]),
                                 std::move(down[i])});
    }
  }

  // Every layer's KV cache buffers and softmax scale, which `run_shared` reads (they stay
  // the same from step to step: set once instead of passed with every call).
  void set_kv(Tensors k_buffers, Tensors v_buffers, std::vector<double> scales) {
    const size_t n = input_norm_w.size();
    TORCH_CHECK(k_buffers.size() == n && v_buffers.size() == n && scales.size() == n,
                "DecodeStack.set_kv: one k buffer, v buffer and scale per layer is needed (",
                n, " layers), got ", k_buffers.size(), ", ", v_buffers.size(), ", ",
                scales.size());
    kv_k = std::move(k_buffers);
    kv_v = std::move(v_buffers);
    kv_scales = std::move(scales);
  }

  // `run` where every layer stores at and reads the same slots (a model without windowed
  // layers): layer i's attention is kv_k[i], kv_v[i] and kv_scales[i] (set_kv) with
  // store_slots, slots, first_key and kv_lens. The same results as `run` with those plans.
  at::Tensor run_shared(at::Tensor hidden, at::Tensor cos, at::Tensor sin,
                        at::Tensor store_slots, at::Tensor slots, at::Tensor first_key,
                        at::Tensor kv_lens, bool batch) const {
    const size_t n = input_norm_w.size();
    TORCH_CHECK(kv_k.size() == n, "DecodeStack.run_shared: the KV buffers of the ", n,
                " layers are needed first (set_kv), the stack holds ", kv_k.size());
    check_batch(batch, "DecodeStack.run_shared");
    return run_layers(hidden, cos, sin, batch, [&](size_t i) {
      return Attention{kv_k[i], kv_v[i], store_slots, slots, first_key, kv_lens, kv_scales[i]};
    });
  }

  // hidden through every layer's decode_step; cos / sin are every layer's rope angles, and
  // layer i's attention is k_buffers[i], v_buffers[i], store_slots[i], slots[i],
  // first_key[i], kv_lens[i] and scales[i] (its PagedDecodePlan).
  at::Tensor run(at::Tensor hidden, at::Tensor cos, at::Tensor sin,
                 std::vector<at::Tensor> k_buffers, std::vector<at::Tensor> v_buffers,
                 std::vector<at::Tensor> store_slots, std::vector<at::Tensor> slots,
                 std::vector<at::Tensor> first_key, std::vector<at::Tensor> kv_lens,
                 std::vector<double> scales, bool batch) const {
    const size_t n = input_norm_w.size();
    for (const size_t size : {k_buffers.size(), v_buffers.size(), store_slots.size(),
                              slots.size(), first_key.size(), kv_lens.size(), scales.size()}) {
      TORCH_CHECK(size == n, "DecodeStack.run: one plan per layer is needed (", n,
                  " layers), got ", size);
    }
    check_batch(batch, "DecodeStack.run");
    return run_layers(hidden, cos, sin, batch, [&](size_t i) {
      return Attention{k_buffers[i], v_buffers[i], store_slots[i], slots[i], first_key[i],
                       kv_lens[i], scales[i]};
    });
  }
};

bool set_team(bool enabled) { return team::set_enabled(enabled); }

int64_t team_read_ahead_bytes() { return team::prefetched_bytes(); }

}  // namespace
}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("set_team(bool enabled) -> bool", &plugserve::ops::set_team);
  m.def("team_read_ahead_bytes() -> int", &plugserve::ops::team_read_ahead_bytes);
  using plugserve::ops::DecodeStack;
  using Tensors = std::vector<at::Tensor>;
  using OptTensors = std::vector<std::optional<at::Tensor>>;
  using Ints = std::vector<int64_t>;
  using Doubles = std::vector<double>;
  using Layers = DecodeStack::Layers;
  using LayerFormats = DecodeStack::LayerFormats;
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<Tensors, Doubles, Layers, LayerFormats, OptTensors, Ints, Ints, Ints,
                       Layers, LayerFormats, OptTensors, Tensors, Doubles, Layers,
                       LayerFormats, OptTensors, Layers, LayerFormats, OptTensors, Ints>())
      .def("layers", &DecodeStack::layers)
      .def("set_packs", &DecodeStack::set_packs)
      .def("set_kv", &DecodeStack::set_kv)
      .def("run_shared", &DecodeStack::run_shared)
      .def("run", &DecodeStack::run);
}
