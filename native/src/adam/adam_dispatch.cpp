// Kernel selection by CPU features and the multithreaded driver.
#include "adam_dispatch.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "../thread_pool.h"

namespace offloadd::adam {
namespace {

struct KernelInfo {
  const char* name;
  KernelFn fn;
  CompactKernelFn compact_fn;
  bool (*supported)();
};

bool always_supported() { return true; }

#if defined(OFFLOADD_X86_KERNELS)
bool cpu_has_avx512() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl");
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
}
#endif

// Best first: the first supported entry is the default kernel.
constexpr KernelInfo kKernels[] = {
#if defined(OFFLOADD_X86_KERNELS)
    {"avx512", step_avx512, step_compact_avx512, cpu_has_avx512},
    {"avx2", step_avx2, step_compact_avx2, cpu_has_avx2},
#endif
    {"scalar", step_scalar, step_compact_scalar, always_supported},
};

// Elements per task: 64 Ki fp32 = 256 KiB per stream, large enough to
// amortise task hand-out, small enough to balance 2..128 threads.
// A multiple of 16 so only the final task has a SIMD tail, and of the blockwise8
// block (256) so every task but the last covers whole blocks.
constexpr size_t kTaskElements = size_t(1) << 16;

const KernelInfo& find_info(const std::string& name) {
  for (const KernelInfo& info : kKernels) {
    if (name != info.name) continue;
    if (!info.supported()) throw std::invalid_argument("kernel '" + name + "' is not supported by this CPU");
    return info;
  }
  throw std::invalid_argument("unknown kernel '" + name + "'");
}

}  // namespace

StepScalars make_step_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                              double weight_decay, bool decoupled_weight_decay,
                              double grad_scale) {
  const double bias_correction1 = 1.0 - std::pow(beta1, double(step));
  const double bias_correction2 = 1.0 - std::pow(beta2, double(step));
  StepScalars s{};
  s.one_minus_beta1 = float(1.0 - beta1);
  s.beta2 = float(beta2);
  s.one_minus_beta2 = float(1.0 - beta2);
  s.eps = float(eps);
  s.grad_scale = float(grad_scale);
  s.l2_weight_decay = decoupled_weight_decay ? 0.0f : float(weight_decay);
  s.decay_factor = decoupled_weight_decay ? float(1.0 - lr * weight_decay) : 1.0f;
  s.neg_step_size = float(-lr / bias_correction1);
  s.bias_correction2_sqrt = float(std::sqrt(bias_correction2));
  return s;
}

std::vector<std::string> supported_kernels() {
  std::vector<std::string> names;
  for (const KernelInfo& info : kKernels) {
    if (info.supported()) names.emplace_back(info.name);
  }
  return names;
}

KernelFn find_kernel(const std::string& name) { return find_info(name).fn; }

CompactKernelFn find_compact_kernel(const std::string& name) {
  return find_info(name).compact_fn;
}

void run_step(KernelFn kernel, const StepScalars& scalars, const Buffers& buffers, size_t numel,
              int num_threads) {
  if (num_threads <= 0) num_threads = available_cpus();
  const size_t num_tasks = (numel + kTaskElements - 1) / kTaskElements;
  ThreadPool::instance().parallel_for(num_tasks, num_threads, [&](size_t task) {
    const size_t begin = task * kTaskElements;
    kernel(scalars, buffers, begin, std::min(numel, begin + kTaskElements));
  });
}

void run_compact_step(CompactKernelFn kernel, const StepScalars& scalars, const Buffers& buffers,
                      const CompactMoments& moments, size_t numel, int num_threads) {
  if (num_threads <= 0) num_threads = available_cpus();
  const size_t num_tasks = (numel + kTaskElements - 1) / kTaskElements;
  ThreadPool::instance().parallel_for(num_tasks, num_threads, [&](size_t task) {
    const size_t begin = task * kTaskElements;
    kernel(scalars, buffers, moments, begin, std::min(numel, begin + kTaskElements));
  });
}

}  // namespace offloadd::adam
