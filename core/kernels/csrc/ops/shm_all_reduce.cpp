// All-reduce (sum) over the tensor-parallel ranks of one machine through a shared memory
// region, the way vLLM's and SGLang's CPU backends do it: gloo's TCP loopback costs about a
// millisecond per call, two per layer, which a batch-1 decode step cannot afford.
//
// The region (a uint8 tensor mapped from the same file by every rank):
//   [ arrival counters: kMaxRanks x 64 bytes (one int64 per cache line) ]
//   [ phase 0: world slots of slot_bytes ][ phase 1: world slots of slot_bytes ]
// Call number `seq` (1, 2, ...; the same on every rank) uses phase seq % 2. A rank copies its
// tensor into its slot, publishes `seq` in its counter (release), waits until every counter
// reached `seq` (acquire), then sums the slots in rank order into its tensor, so every rank
// gets the same bits. Two phases make reuse safe: a rank writes phase p again at seq + 2 only
// after every counter reached seq + 1, and a rank publishes seq + 1 only after it finished
// reading seq.
//
// `shm_all_gather` uses the same slots and counters without the sum.
//
// A rank that does not arrive within `wait_s` is reported to the caller: the op returns its
// rank (-1 when all arrived). The caller checks whether that rank's process is still alive
// and, if so, calls again with `resume` set (no second copy or publish) to wait longer.
#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "common.h"

namespace plugserve::ops {

namespace {

constexpr int64_t kMaxRanks = 8;
constexpr int64_t kCounterStride = 64;  // bytes: one counter per cache line
constexpr int64_t kHeaderBytes = kMaxRanks * kCounterStride;
constexpr int kSpinsBeforeYield = 4096;

inline int64_t* counter(uint8_t* base, int64_t rank) {
  return reinterpret_cast<int64_t*>(base + rank * kCounterStride);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Waits until every rank's counter reached `seq`; returns the first rank that did not arrive
// before the deadline, or -1.
int64_t wait_for_all(uint8_t* base, int64_t world, int64_t seq, double timeout_s) {
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(timeout_s));
  for (int64_t r = 0; r < world; ++r) {
    int spins = 0;
    while (__atomic_load_n(counter(base, r), __ATOMIC_ACQUIRE) < seq) {
      if (++spins < kSpinsBeforeYield) {
        cpu_relax();
        continue;
      }
      // More ranks than free cores (or a slow peer): give the core away between looks.
      std::this_thread::yield();
      if ((spins & 1023) == 0 && std::chrono::steady_clock::now() > deadline) return r;
    }
  }
  return -1;
}

template <typename T>
void sum_slots(uint8_t* phase, int64_t slot_bytes, int64_t world, int64_t n, T* out) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = 0.0f;
    for (int64_t r = 0; r < world; ++r) {
      acc += static_cast<float>(reinterpret_cast<const T*>(phase + r * slot_bytes)[i]);
    }
    out[i] = static_cast<T>(acc);
  }
}

void sum_slots_f32(uint8_t* phase, int64_t slot_bytes, int64_t world, int64_t n, float* out) {
  const float* first = reinterpret_cast<const float*>(phase);
  std::memcpy(out, first, n * sizeof(float));
  for (int64_t r = 1; r < world; ++r) {
    const float* slot = reinterpret_cast<const float*>(phase + r * slot_bytes);
    for (int64_t i = 0; i < n; ++i) out[i] += slot[i];
  }
}

void check_call(const at::Tensor& x, const at::Tensor& region, int64_t rank, int64_t world,
                int64_t seq, int64_t slot_bytes, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && region.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(x.is_contiguous(), what, ": the tensor must be contiguous");
  TORCH_CHECK(region.scalar_type() == at::kByte && region.is_contiguous(),
              what, ": the region must be a contiguous uint8 tensor");
  TORCH_CHECK(world >= 1 && world <= kMaxRanks, what, ": world size ", world, " (1 to ",
              kMaxRanks, " ranks)");
  TORCH_CHECK(rank >= 0 && rank < world, what, ": rank ", rank, " outside 0..", world - 1);
  TORCH_CHECK(seq >= 1, what, ": seq ", seq, " (counts from 1)");
  const int64_t bytes = x.numel() * static_cast<int64_t>(x.element_size());
  TORCH_CHECK(bytes <= slot_bytes, what, ": ", bytes, " bytes do not fit a slot of ",
              slot_bytes, " (split the tensor)");
  TORCH_CHECK(region.numel() >= kHeaderBytes + 2 * world * slot_bytes, what, ": a region of ",
              region.numel(), " bytes is too small for ", world, " ranks with slots of ",
              slot_bytes, " bytes");
  float_dtype(x, what);
}

inline uint8_t* phase_of(uint8_t* base, int64_t world, int64_t seq, int64_t slot_bytes) {
  return base + kHeaderBytes + (seq % 2) * world * slot_bytes;
}

// This rank's data into its slot of the phase, then its counter to `seq`.
inline void publish(uint8_t* base, uint8_t* phase, int64_t rank, int64_t seq,
                    int64_t slot_bytes, const void* data, int64_t bytes) {
  std::memcpy(phase + rank * slot_bytes, data, bytes);
  __atomic_store_n(counter(base, rank), seq, __ATOMIC_RELEASE);
}

int64_t shm_all_reduce_(at::Tensor& x, const at::Tensor& region, int64_t rank, int64_t world,
                        int64_t seq, int64_t slot_bytes, double wait_s, bool resume) {
  check_call(x, region, rank, world, seq, slot_bytes, "shm_all_reduce_");
  uint8_t* base = region.data_ptr<uint8_t>();
  uint8_t* phase = phase_of(base, world, seq, slot_bytes);
  const int64_t bytes = x.numel() * static_cast<int64_t>(x.element_size());
  if (!resume) publish(base, phase, rank, seq, slot_bytes, x.data_ptr(), bytes);
  const int64_t missing = wait_for_all(base, world, seq, wait_s);
  if (missing >= 0) return missing;
  const int64_t n = x.numel();
  switch (x.scalar_type()) {
    case at::kFloat: sum_slots_f32(phase, slot_bytes, world, n, x.data_ptr<float>()); break;
    case at::kBFloat16:
      sum_slots(phase, slot_bytes, world, n, x.data_ptr<c10::BFloat16>());
      break;
    default: sum_slots(phase, slot_bytes, world, n, x.data_ptr<c10::Half>()); break;
  }
  return -1;
}

// All-gather along the last dim through the same region: `local` [rows, cols] from every
// rank lands in `out` [rows, world * cols] in rank order (one copy, no concatenation after).
int64_t shm_all_gather(at::Tensor& out, const at::Tensor& local, const at::Tensor& region,
                       int64_t rank, int64_t world, int64_t seq, int64_t slot_bytes,
                       double wait_s, bool resume) {
  TORCH_CHECK(local.dim() == 2 && out.dim() == 2 && local.is_contiguous() &&
                  out.is_contiguous() && local.scalar_type() == out.scalar_type(),
              "shm_all_gather: contiguous 2-D local and out tensors of one dtype");
  TORCH_CHECK(out.size(0) == local.size(0) && out.size(1) == world * local.size(1),
              "shm_all_gather: out is ", out.sizes(), ", expected [", local.size(0), ", ",
              world * local.size(1), "]");
  check_call(local, region, rank, world, seq, slot_bytes, "shm_all_gather");
  uint8_t* base = region.data_ptr<uint8_t>();
  uint8_t* phase = phase_of(base, world, seq, slot_bytes);
  const int64_t bytes = local.numel() * static_cast<int64_t>(local.element_size());
  if (!resume) publish(base, phase, rank, seq, slot_bytes, local.data_ptr(), bytes);
  const int64_t missing = wait_for_all(base, world, seq, wait_s);
  if (missing >= 0) return missing;
  const int64_t row_bytes = local.size(1) * static_cast<int64_t>(local.element_size());
  auto* dst = static_cast<uint8_t*>(out.data_ptr());
  for (int64_t row = 0; row < local.size(0); ++row) {
    for (int64_t r = 0; r < world; ++r) {
      std::memcpy(dst + (row * world + r) * row_bytes, phase + r * slot_bytes + row * row_bytes,
                  row_bytes);
    }
  }
  return -1;
}

int64_t shm_header_bytes() { return kHeaderBytes; }

int64_t shm_max_ranks() { return kMaxRanks; }

}  // namespace

}  // namespace plugserve::ops

TORCH_LIBRARY_FRAGMENT(plugserve_cpu, m) {
  m.def("shm_all_reduce_(Tensor(a!) x, Tensor region, int rank, int world, int seq, "
        "int slot_bytes, float wait_s, bool resume) -> int",
        &plugserve::ops::shm_all_reduce_);
  m.def("shm_all_gather(Tensor(a!) out, Tensor local, Tensor region, int rank, int world, "
        "int seq, int slot_bytes, float wait_s, bool resume) -> int",
        &plugserve::ops::shm_all_gather);
  m.def("shm_header_bytes() -> int", &plugserve::ops::shm_header_bytes);
  m.def("shm_max_ranks() -> int", &plugserve::ops::shm_max_ranks);
}
