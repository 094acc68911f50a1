// Attention ops: decode over the paged cache (kernels/paged_decode.cpp), the KV store, and
// causal prefill of one sequence (kernels/prefill_attention.cpp, and in bf16 on AMX
// kernels/prefill_attention_amx.cpp).
#include "common.h"

namespace plugserve::ops {

at::Tensor paged_decode(at::Tensor q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& slots, at::Tensor first_key, at::Tensor kv_lens,
                        double scale, double k_scale, double v_scale, at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "paged_decode: q, k, v must be 3-d");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "paged_decode: k and v must share a dtype");
  const Dtype qd = float_dtype(q, "paged_decode"), kd = kv_dtype(k, "paged_decode");
  TORCH_CHECK(kd == qd || kd == Dtype::bf16 || kd == Dtype::f8e4m3 || kd == Dtype::f8e5m2,
              "paged_decode: a ", k.scalar_type(), " cache takes queries of its own dtype only, got ",
              q.scalar_type());
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "paged_decode: heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == k.size(2) && k.size(2) == v.size(2), "paged_decode: head_dim differs");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1,
              "paged_decode: k and v must be contiguous in head_dim");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 &&
                  (slots.size(1) <= 1 || slots.stride(1) == 1),
              "paged_decode: slots must be a row-contiguous int64 [rows, max_len] table");
  TORCH_CHECK(first_key.scalar_type() == at::kLong && kv_lens.scalar_type() == at::kLong,
              "paged_decode: first_key and kv_lens must be int64");
  TORCH_CHECK(slots.size(0) == q.size(0) && kv_lens.size(0) == q.size(0) &&
                  first_key.size(0) == q.size(0),
              "paged_decode: one slot row, length and start per query");
  q = q.contiguous();
  first_key = first_key.contiguous();
  kv_lens = kv_lens.contiguous();
  out = out_or_empty(out, q.sizes(), q, "paged_decode");
  if (q.numel() == 0) return out;
  PagedDecodeArgs a{};
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.out = out.data_ptr();
  a.dtype = qd;
  a.kv_dtype = kd;
  a.k_token_stride = k.stride(0);
  a.k_head_stride = k.stride(1);
  a.v_token_stride = v.stride(0);
  a.v_head_stride = v.stride(1);
  a.slots = slots.data_ptr<int64_t>();
  a.slot_stride = slots.stride(0);
  a.slot_width = slots.size(1);
  a.first_key = first_key.data_ptr<int64_t>();
  a.kv_lens = kv_lens.data_ptr<int64_t>();
  a.num_slots = std::min(k.size(0), v.size(0));
  a.rows = q.size(0);
  a.heads = q.size(1);
  a.kv_heads = k.size(1);
  a.dim = q.size(2);
  a.scale = static_cast<float>(scale);
  a.k_scale = static_cast<float>(k_scale);
  a.v_scale = static_cast<float>(v_scale);
  kernels().paged_decode(a);
  return out;
}

void store_rows(at::Tensor& buffer, const at::Tensor& slots, const at::Tensor& rows,
                double scale) {
  TORCH_CHECK(buffer.dim() == 3 && rows.dim() == 3 && buffer.size(1) == rows.size(1) &&
                  buffer.size(2) == rows.size(2) && buffer.stride(2) == 1 &&
                  buffer.stride(1) == buffer.size(2) && rows.stride(2) == 1 &&
                  rows.stride(1) == rows.size(2),
              "store_rows: the cache buffer ", buffer.sizes(), " does not take rows ",
              rows.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 &&
                  slots.size(0) == rows.size(0) && slots.is_contiguous(),
              "store_rows: one contiguous int64 slot per row is needed, got ", slots.sizes());
  const auto* slot = slots.data_ptr<int64_t>();
  const int64_t capacity = buffer.size(0);
  for (int64_t r = 0; r < rows.size(0); ++r) {  // all checked before anything is written
    TORCH_CHECK(slot[r] >= 0 && slot[r] < capacity, "store_rows: store slot ", slot[r],
                " is outside the cache's ", capacity, " slots");
  }
  StoreRowsArgs a{};
  a.src = rows.data_ptr();
  a.src_stride = rows.stride(0);
  a.dst = buffer.data_ptr();
  a.dst_stride = buffer.stride(0);
  a.slots = slot;
  a.rows = rows.size(0);
  a.row_elements = rows.size(1) * rows.size(2);
  a.src_dtype = float_dtype(rows, "store_rows");
  a.dst_dtype = kv_dtype(buffer, "store_rows");
  a.scale = static_cast<float>(scale);
  kernels().store_rows(a);
}

namespace {

at::Tensor paged_decode_op(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor slots,
                           at::Tensor first_key, at::Tensor kv_lens, double scale,
                           double k_scale, double v_scale) {
  return paged_decode(q, k, v, slots, first_key, kv_lens, scale, k_scale, v_scale);
}

void store_rows_op(at::Tensor buffer, at::Tensor slots, at::Tensor rows, double scale) {
  store_rows(buffer, slots.contiguous(), rows, scale);
}

// The checked arguments of the prefill ops (`name`: the op, in the errors) and q made
// contiguous; out is q's shape and dtype.
PrefillArgs prefill_args(const char* name, at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, double scale, int64_t prefix_len, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              name, ": q must be [E, H, D], k and v [S, KVH, D]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
              name, ": q, k and v must share a dtype");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(),
              name, ": CPU tensors only");
  TORCH_CHECK(k.size(1) > 0 && v.size(1) == k.size(1) && q.size(1) % k.size(1) == 0,
              name, ": heads must be a multiple of kv heads");
  TORCH_CHECK(q.size(2) == k.size(2) && k.size(2) == v.size(2),
              name, ": q, k and v must share head_dim");
  TORCH_CHECK(prefix_len >= 0, name, ": prefix_len must be >= 0");
  TORCH_CHECK(k.size(0) == prefix_len + q.size(0) && v.size(0) == k.size(0),
              name, ": k and v must hold prefix_len + E = ", prefix_len + q.size(0),
              " tokens, got ", k.size(0), " and ", v.size(0));
  TORCH_CHECK(window >= 0, name, ": window must be >= 1, or 0 for none");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1,
              name, ": k and v must be contiguous in head_dim (stride(-1) == 1)");
  if (q.stride(2) != 1) q = q.contiguous();  // else read in place (a view of qkv's rows)
  PrefillArgs a{};
  a.q = q.data_ptr();
  a.q_token_stride = q.stride(0);
  a.q_head_stride = q.stride(1);
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.dtype = float_dtype(q, name);
  a.k_token_stride = k.stride(0);
  a.k_head_stride = k.stride(1);
  a.v_token_stride = v.stride(0);
  a.v_head_stride = v.stride(1);
  a.tokens = q.size(0);
  a.heads = q.size(1);
  a.kv_heads = k.size(1);
  a.dim = q.size(2);
  a.prefix = prefix_len;
  a.window = window;
  a.scale = static_cast<float>(scale);
  return a;
}

at::Tensor prefill_attention(at::Tensor q, at::Tensor k, at::Tensor v, double scale,
                             int64_t prefix_len, int64_t window) {
  PrefillArgs a = prefill_args("prefill_attention", q, k, v, scale, prefix_len, window);
  auto out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  if (q.numel() == 0) return out;
  a.out = out.data_ptr();
  kernels().prefill_attention(a);
  return out;
}

// The AMX copy (kernels/prefill_attention_amx.cpp): bf16, head_dim a multiple of 32.
at::Tensor prefill_attention_amx(at::Tensor q, at::Tensor k, at::Tensor v, double scale,
                                 int64_t prefix_len, int64_t window) {
  PrefillArgs a = prefill_args("prefill_attention_amx", q, k, v, scale, prefix_len, window);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.size(2) % 32 == 0,
              "prefill_attention_amx: bfloat16 with head_dim a multiple of 32 only, got ",
              q.scalar_type(), " and head_dim ", q.size(2));
  auto out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's strides
  if (q.numel() == 0) return out;
  a.out = out.data_ptr();
  TORCH_CHECK(kernels().prefill_attention_amx(a), "prefill_attention_amx: the ", kernels().isa,
              " kernels have no AMX here (ask amx_usable() first)");
  return out;
}

}  // namespace
}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k, Tensor v, Tensor slots, Tensor first_key, "
        "Tensor kv_lens, float scale, float k_scale=1.0, float v_scale=1.0) -> Tensor",
        &plugserve::ops::paged_decode_op);
  m.def("store_rows(Tensor(a!) buffer, Tensor slots, Tensor rows, float scale=1.0) -> ()",
        &plugserve::ops::store_rows_op);
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int prefix_len, "
        "int window) -> Tensor",
        &plugserve::ops::prefill_attention);
  m.def("prefill_attention_amx(Tensor q, Tensor k, Tensor v, float scale, int prefix_len, "
        "int window) -> Tensor",
        &plugserve::ops::prefill_attention_amx);
}
