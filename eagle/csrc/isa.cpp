// The instruction sets of the kernels: detection, the process-wide setting and its report (see isa.h); the ops
// eagle::kernel_isa, eagle::kernel_isas and eagle::set_kernel_isa.
#include "isa.h"

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <tuple>

namespace eagle {

namespace {

bool cpu_runs_avx512() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_runs_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool cpu_runs_portable() { return true; }

struct IsaInfo {
  Isa isa;
  const char* name;
  bool (*cpu_runs)();  // what the CPU must support (the union of what the kernels of this set use)
};

// best first
const IsaInfo kIsas[] = {
    {ISA_AVX512, "avx512", cpu_runs_avx512},
    {ISA_AVX2, "avx2", cpu_runs_avx2},
    {ISA_PORTABLE, "portable", cpu_runs_portable},
};

constexpr const char* kEnvironmentVariable = "EAGLE_KERNELS_ISA";

// where the setting came from
enum Source : int { SOURCE_DEFAULT = 0, SOURCE_ENVIRONMENT = 1, SOURCE_CALL = 2 };

// isa + 4 * source; -1 until the first call that needs it
std::atomic<int> g_setting{-1};

const std::string& environment_value() {
  static const std::string value = [] {
    const char* v = std::getenv(kEnvironmentVariable);
    return std::string(v ? v : "");
  }();
  return value;
}

std::string all_names() {
  std::string names;
  for (const IsaInfo& i : kIsas) names += std::string(names.empty() ? "" : ", ") + i.name;
  return names;
}

}  // namespace

const char* isa_name(Isa isa) {
  for (const IsaInfo& i : kIsas)
    if (i.isa == isa) return i.name;
  return "?";
}

Isa best_isa() {
  static const Isa best = [] {
    for (const IsaInfo& i : kIsas)
      if (i.cpu_runs()) return i.isa;
    return ISA_PORTABLE;
  }();
  return best;
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const IsaInfo& i : kIsas)
    if (i.isa <= best_isa()) names.emplace_back(i.name);
  return names;
}

Isa parse_isa(const std::string& name, const char* what) {
  for (const IsaInfo& i : kIsas) {
    if (name != i.name) continue;
    TORCH_CHECK(i.isa <= best_isa(), what, ": this CPU cannot run the ", i.name, " kernels (it runs ",
                c10::Join(", ", supported_isas()), ")");
    return i.isa;
  }
  TORCH_CHECK(false, what, ": unknown isa '", name, "': expected one of ", all_names());
  return ISA_PORTABLE;
}

Isa current_isa() {
  int setting = g_setting.load();
  if (setting < 0) {
    const std::string& env = environment_value();
    const Isa isa = env.empty() ? best_isa() : parse_isa(env, kEnvironmentVariable);
    g_setting.compare_exchange_strong(setting, isa + 4 * (env.empty() ? SOURCE_DEFAULT : SOURCE_ENVIRONMENT));
    setting = g_setting.load();
  }
  return static_cast<Isa>(setting % 4);
}

void set_isa(const std::string& name) {
  const Isa isa = name.empty() ? best_isa() : parse_isa(name, "eagle::set_kernel_isa");
  g_setting.store(isa + 4 * SOURCE_CALL);
}

std::string isa_reason() {
  current_isa();
  switch (g_setting.load() / 4) {
    case SOURCE_ENVIRONMENT:
      return std::string(kEnvironmentVariable) + "=" + environment_value();
    case SOURCE_CALL:
      return "set by eagle::set_kernel_isa (eagle.kernels.use_isa)";
    default:
      return std::string("the best this CPU runs (") + kEnvironmentVariable + " is not set)";
  }
}

namespace {

std::tuple<std::string, std::string> kernel_isa() { return {isa_name(current_isa()), isa_reason()}; }

}  // namespace

}  // namespace eagle

TORCH_LIBRARY_FRAGMENT(eagle, m) {
  m.def("kernel_isa() -> (str, str)", &eagle::kernel_isa);
  m.def("kernel_isas() -> str[]", &eagle::supported_isas);
  m.def("set_kernel_isa(str name) -> ()", &eagle::set_isa);
}
