// Turns the runtime dtype/mode choice into one compile-time kernel variant,
// so the per-element loops carry no branches.
//
// Hazard (ODR across ISA flags): the AVX TUs are compiled with -mavx2 /
// -mavx512f.  Any non-static inline function they instantiate may be merged
// by the linker with the copy from a baseline TU and then run on a CPU
// without those instructions.  Kernel is therefore always a type in an
// anonymous namespace (internal linkage), and this header includes nothing.
#pragma once

#include "adam.h"

namespace offloadd::adam {

template <class Kernel, GradDtype kGrad, bool kL2>
void run_for_out(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
  switch (b.out_dtype) {
    case OutDtype::kNone:
      return Kernel::template run<kGrad, OutDtype::kNone, kL2>(s, b, begin, end);
    case OutDtype::kFloat32:
      return Kernel::template run<kGrad, OutDtype::kFloat32, kL2>(s, b, begin, end);
    case OutDtype::kBFloat16:
      return Kernel::template run<kGrad, OutDtype::kBFloat16, kL2>(s, b, begin, end);
    case OutDtype::kFloat16:
      return Kernel::template run<kGrad, OutDtype::kFloat16, kL2>(s, b, begin, end);
  }
}

template <class Kernel, bool kL2>
void run_for_grad(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
  if (b.grad_dtype == GradDtype::kFloat32) {
    run_for_out<Kernel, GradDtype::kFloat32, kL2>(s, b, begin, end);
  } else {
    run_for_out<Kernel, GradDtype::kBFloat16, kL2>(s, b, begin, end);
  }
}

// L2 mode is the only one that needs the extra g += wd * p term.
template <class Kernel>
void run_variant(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
  if (s.l2_weight_decay != 0.0f) {
    run_for_grad<Kernel, true>(s, b, begin, end);
  } else {
    run_for_grad<Kernel, false>(s, b, begin, end);
  }
}

}  // namespace offloadd::adam
