// The op library `plugserve_cpu` (torch.ops.plugserve_cpu.*): which ISA copy of the kernels
// runs. The other ops register from their own files (TORCH_LIBRARY_FRAGMENT).
#include <string>
#include <vector>

#include "common.h"

namespace {

std::string isa() { return plugserve::kernels().isa; }

std::vector<std::string> isas() { return plugserve::runnable_isas(); }

void set_isa(const std::string& name) { plugserve::set_isa(name); }

}  // namespace

TORCH_LIBRARY(plugserve_cpu, m) {
  m.def("isa() -> str", &isa);
  m.def("isas() -> str[]", &isas);
  m.def("set_isa(str name) -> ()", &set_isa);
}
