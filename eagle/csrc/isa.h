// The instruction sets the kernels run with, for the whole extension (the linear kernels of ops.cpp, the attention
// of attention.cpp and whatever composes them): one detection, one setting, one report.
//
// The setting is process-wide: EAGLE_KERNELS_ISA=avx512|avx2|portable in the environment, read once, at the first
// call that needs it (unset or empty: the best this CPU runs), until set_isa (the op eagle::set_kernel_isa) changes
// it. A name this CPU cannot run, or an unknown one, is an error at that call that names the valid ones. An op that
// takes a per-call override (eagle::tree_attention's `isa`) parses it with the same names by parse_isa.
//
// Adding an instruction set: its value in Isa and its entry in kIsas (isa.cpp: its name and what the CPU must
// support, best first), plus its kernels and where ops.cpp and attention.cpp pick them by Isa.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace eagle {

// ordered: a CPU that runs one runs every lower one
enum Isa : int32_t { ISA_PORTABLE = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

const char* isa_name(Isa isa);

// the best instruction set this CPU runs (detected once)
Isa best_isa();

// names of the instruction sets this CPU runs, best first
std::vector<std::string> supported_isas();

// `name` (avx512, avx2 or portable) as an Isa this CPU runs; an error that names the valid ones (and, for one this
// CPU lacks, the best it runs) otherwise. `what` prefixes the message (the op or setting it came from).
Isa parse_isa(const std::string& name, const char* what);

// the process-wide setting (see above)
Isa current_isa();

// sets the process-wide setting to `name` (empty: the best this CPU runs)
void set_isa(const std::string& name);

// why the current instruction set is the one in use, e.g. "EAGLE_KERNELS_ISA=avx2" or "the best this CPU runs
// (EAGLE_KERNELS_ISA is not set)"
std::string isa_reason();

}  // namespace eagle
