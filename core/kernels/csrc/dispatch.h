// Run-time choice of the ISA copy of the kernels (kernel_api.h): a table of entry points per
// ISA compiled into this library, and the one in use. The ops call `kernels().name(args)`.
#pragma once

#include <string>
#include <vector>

#include "kernel_api.h"

namespace plugserve {

#define PLUGSERVE_TABLE_FIELD(ret, name, params) ret(*name) params;
struct KernelTable {
  const char* isa;
  bool bf16_dot;  // multiplies bf16 pairs natively (the avx512_bf16 copy)
  PLUGSERVE_KERNELS(PLUGSERVE_TABLE_FIELD)
};
#undef PLUGSERVE_TABLE_FIELD

// The table in use: the best ISA of this library the CPU runs, until set_isa changes it.
const KernelTable& kernels();

// The ISA copies compiled into this library that this CPU can run, lowest first.
std::vector<std::string> runnable_isas();

// Use the copy called `name` (one of runnable_isas(); anything else is refused with the list).
void set_isa(const std::string& name);

}  // namespace plugserve
