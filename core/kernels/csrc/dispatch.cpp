// The dispatch tables: one per ISA copy the builder compiled (it defines PLUGSERVE_BUILT_<isa>
// for each), filled at compile time, so no code runs when the library loads.
#include "dispatch.h"

#include <c10/util/Exception.h>

#include <atomic>

namespace plugserve {
namespace {

#define PLUGSERVE_ENTRY(isa_ns, ret, name, params) &isa_ns::name,

#if defined(PLUGSERVE_BUILT_scalar)
#define PLUGSERVE_E(ret, name, params) PLUGSERVE_ENTRY(scalar, ret, name, params)
constexpr KernelTable kScalar{"scalar", false, PLUGSERVE_KERNELS(PLUGSERVE_E)};
#undef PLUGSERVE_E
#endif
#if defined(PLUGSERVE_BUILT_avx2)
#define PLUGSERVE_E(ret, name, params) PLUGSERVE_ENTRY(avx2, ret, name, params)
constexpr KernelTable kAvx2{"avx2", false, PLUGSERVE_KERNELS(PLUGSERVE_E)};
#undef PLUGSERVE_E
#endif
#if defined(PLUGSERVE_BUILT_avx512)
#define PLUGSERVE_E(ret, name, params) PLUGSERVE_ENTRY(avx512, ret, name, params)
constexpr KernelTable kAvx512{"avx512", false, PLUGSERVE_KERNELS(PLUGSERVE_E)};
#undef PLUGSERVE_E
#endif
#if defined(PLUGSERVE_BUILT_avx512_vnni)
#define PLUGSERVE_E(ret, name, params) PLUGSERVE_ENTRY(avx512_vnni, ret, name, params)
constexpr KernelTable kAvx512Vnni{"avx512_vnni", false, PLUGSERVE_KERNELS(PLUGSERVE_E)};
#undef PLUGSERVE_E
#endif
#if defined(PLUGSERVE_BUILT_avx512_bf16)
#define PLUGSERVE_E(ret, name, params) PLUGSERVE_ENTRY(avx512_bf16, ret, name, params)
constexpr KernelTable kAvx512Bf16{"avx512_bf16", true, PLUGSERVE_KERNELS(PLUGSERVE_E)};
#undef PLUGSERVE_E
#endif
#if defined(PLUGSERVE_BUILT_neon)
#define PLUGSERVE_E(ret, name, params) PLUGSERVE_ENTRY(neon, ret, name, params)
constexpr KernelTable kNeon{"neon", false, PLUGSERVE_KERNELS(PLUGSERVE_E)};
#undef PLUGSERVE_E
#endif
#if defined(PLUGSERVE_BUILT_sve256)
#define PLUGSERVE_E(ret, name, params) PLUGSERVE_ENTRY(sve256, ret, name, params)
constexpr KernelTable kSve256{"sve256", false, PLUGSERVE_KERNELS(PLUGSERVE_E)};
#undef PLUGSERVE_E
#endif

// Lowest first.
constexpr const KernelTable* kBuilt[] = {
#if defined(PLUGSERVE_BUILT_scalar)
    &kScalar,
#endif
#if defined(PLUGSERVE_BUILT_avx2)
    &kAvx2,
#endif
#if defined(PLUGSERVE_BUILT_avx512)
    &kAvx512,
#endif
#if defined(PLUGSERVE_BUILT_avx512_vnni)
    &kAvx512Vnni,
#endif
#if defined(PLUGSERVE_BUILT_avx512_bf16)
    &kAvx512Bf16,
#endif
#if defined(PLUGSERVE_BUILT_neon)
    &kNeon,
#endif
#if defined(PLUGSERVE_BUILT_sve256)
    &kSve256,
#endif
};

// Whether this CPU (and its OS) runs the copy called `isa`. On Arm the builder compiled only
// what the CPU has (SVE256 as torch detected it).
bool cpu_runs(const std::string& isa) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512dq");
  if (isa == "avx2") return avx2;
  if (isa == "avx512") return avx512;
  if (isa == "avx512_vnni") return avx512 && __builtin_cpu_supports("avx512vnni");
  if (isa == "avx512_bf16") {
    return avx512 && __builtin_cpu_supports("avx512bf16") &&
           __builtin_cpu_supports("avx512vnni");
  }
  return isa == "scalar";
#else
  return isa == "neon" || isa == "sve256" || isa == "scalar";
#endif
}

const KernelTable* best() {
  const KernelTable* chosen = nullptr;
  for (const KernelTable* t : kBuilt) {
    if (cpu_runs(t->isa)) chosen = t;
  }
  TORCH_CHECK(chosen != nullptr, "plugserve CPU kernels: no ISA copy in this build runs here");
  return chosen;
}

std::atomic<const KernelTable*> g_active{nullptr};

}  // namespace

const KernelTable& kernels() {
  const KernelTable* t = g_active.load(std::memory_order_acquire);
  if (t == nullptr) {
    t = best();
    g_active.store(t, std::memory_order_release);
  }
  return *t;
}

std::vector<std::string> runnable_isas() {
  std::vector<std::string> out;
  for (const KernelTable* t : kBuilt) {
    if (cpu_runs(t->isa)) out.emplace_back(t->isa);
  }
  return out;
}

void set_isa(const std::string& name) {
  for (const KernelTable* t : kBuilt) {
    if (name == t->isa && cpu_runs(name)) {
      g_active.store(t, std::memory_order_release);
      return;
    }
  }
  std::string allowed;
  for (const auto& isa : runnable_isas()) allowed += (allowed.empty() ? "" : ", ") + isa;
  TORCH_CHECK(false, "plugserve CPU kernels: cannot use ISA '", name,
              "' here; this build and CPU run: ", allowed);
}

}  // namespace plugserve
