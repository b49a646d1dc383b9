// Kernel selection by CPU features and the multithreaded driver.
#include "adam_dispatch.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

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

// Elements saved (or restored) and then updated at a time within a task: the slice's
// state (~48 KiB at fp32) is still in L1/L2 when the kernel reads it.  A multiple of
// the blockwise8 block and of every SIMD width.
constexpr size_t kUndoSliceElements = size_t(1) << 12;

// The saved copy is not read again this step: streaming stores skip reading each
// destination line first and keep it out of the cache the kernel needs.
void copy_streaming(char* destination, const char* source, size_t nbytes) {
#if defined(__SSE2__)
  size_t head = (16 - reinterpret_cast<uintptr_t>(destination) % 16) % 16;
  head = std::min(head, nbytes);
  std::memcpy(destination, source, head);
  size_t done = head;
  for (; done + 16 <= nbytes; done += 16) {
    const __m128i value = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + done));
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination + done), value);
  }
  std::memcpy(destination + done, source + done, nbytes - done);
#else
  std::memcpy(destination, source, nbytes);
#endif
}

// Saves or restores the undo copy of elements [begin, end).  Slices begin on a whole
// block, so a stream of per-block units (blockwise8 scales) is split between them
// without overlap: only the final slice ends mid-block, and it covers that block.
void copy_undo(const Undo& undo, size_t begin, size_t end) {
  for (int index = 0; index < undo.count; ++index) {
    const UndoStream& stream = undo.streams[index];
    const size_t first = begin / stream.unit_elements;
    const size_t last = (end + stream.unit_elements - 1) / stream.unit_elements;
    const size_t offset = first * stream.unit_bytes;
    const size_t nbytes = (last - first) * stream.unit_bytes;
    if (undo.restore) {  // the kernel rewrites these lines next: plain stores
      std::memcpy(stream.state + offset, stream.undo + offset, nbytes);
    } else {
      copy_streaming(stream.undo + offset, stream.state + offset, nbytes);
    }
  }
}

// One task: the kernel over [begin, end), each slice saved or restored just before.
template <class Update>
void run_task(const Undo* undo, size_t begin, size_t end, const Update& update) {
  if (undo == nullptr) {
    update(begin, end);
    return;
  }
  for (size_t slice = begin; slice < end; slice += kUndoSliceElements) {
    const size_t slice_end = std::min(end, slice + kUndoSliceElements);
    copy_undo(*undo, slice, slice_end);
    update(slice, slice_end);
  }
#if defined(__SSE2__)
  // Streaming stores are weakly ordered: visible before the pool reports the task done.
  if (!undo->restore) _mm_sfence();
#endif
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
              int num_threads, const Undo* undo) {
  if (num_threads <= 0) num_threads = available_cpus();
  const size_t num_tasks = (numel + kTaskElements - 1) / kTaskElements;
  ThreadPool::instance().parallel_for(num_tasks, num_threads, [&](size_t task) {
    const size_t begin = task * kTaskElements;
    run_task(undo, begin, std::min(numel, begin + kTaskElements),
             [&](size_t from, size_t to) { kernel(scalars, buffers, from, to); });
  });
}

void run_compact_step(CompactKernelFn kernel, const StepScalars& scalars, const Buffers& buffers,
                      const CompactMoments& moments, size_t numel, int num_threads,
                      const Undo* undo) {
  if (num_threads <= 0) num_threads = available_cpus();
  const size_t num_tasks = (numel + kTaskElements - 1) / kTaskElements;
  ThreadPool::instance().parallel_for(num_tasks, num_threads, [&](size_t task) {
    const size_t begin = task * kTaskElements;
    run_task(undo, begin, std::min(numel, begin + kTaskElements),
             [&](size_t from, size_t to) { kernel(scalars, buffers, moments, from, to); });
  });
}

}  // namespace offloadd::adam
