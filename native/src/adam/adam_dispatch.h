// Public native entry points for CPU Adam: kernel lookup and the threaded step.
#pragma once

#include <string>
#include <vector>

#include "adam.h"

namespace offloadd::adam {

// Kernels this CPU can run, best first ("avx512", "avx2", "scalar").
std::vector<std::string> supported_kernels();

// Throws std::invalid_argument if the name is unknown or the CPU lacks it.
KernelFn find_kernel(const std::string& name);

// Runs `kernel` over [0, numel) split into tasks on the shared pool;
// num_threads <= 0 means every CPU in this process's affinity mask.
void run_step(KernelFn kernel, const StepScalars& scalars, const Buffers& buffers, size_t numel,
              int num_threads);

// The same kernel's compact-moment variant, and its threaded step.
CompactKernelFn find_compact_kernel(const std::string& name);

void run_compact_step(CompactKernelFn kernel, const StepScalars& scalars, const Buffers& buffers,
                      const CompactMoments& moments, size_t numel, int num_threads);

}  // namespace offloadd::adam
