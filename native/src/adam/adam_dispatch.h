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

// One buffer of the step's state and its undo copy (a speculative step's saved state):
// unit_bytes per unit_elements elements (fp32: 4 per 1; blockwise8 scales: 4 per 256).
struct UndoStream {
  char* state;
  char* undo;
  size_t unit_bytes;
  size_t unit_elements;
};

// The state buffers a step saves before it updates them (restore == false), or
// restores from their undo copies before it updates them (restore == true).  Done
// task by task on the thread that then updates the task: the kernel finds the bytes
// in cache, so saving costs the undo's writes, not a second pass over the state.
struct Undo {
  static constexpr int kMaxStreams = 5;  // master, two moments, two blockwise8 scales
  UndoStream streams[kMaxStreams];
  int count = 0;
  bool restore = false;
};

// Runs `kernel` over [0, numel) split into tasks on the shared pool;
// num_threads <= 0 means every CPU in this process's affinity mask.  With `undo`,
// each task first saves (or restores) its slice of the state.
void run_step(KernelFn kernel, const StepScalars& scalars, const Buffers& buffers, size_t numel,
              int num_threads, const Undo* undo = nullptr);

// The same kernel's compact-moment variant, and its threaded step.
CompactKernelFn find_compact_kernel(const std::string& name);

void run_compact_step(CompactKernelFn kernel, const StepScalars& scalars, const Buffers& buffers,
                      const CompactMoments& moments, size_t numel, int num_threads,
                      const Undo* undo = nullptr);

}  // namespace offloadd::adam
