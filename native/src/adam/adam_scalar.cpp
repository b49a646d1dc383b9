// Portable kernel: the reference for the SIMD kernels and the path on CPUs
// without AVX2.  Compiled without FMA contraction so it rounds like torch's
// unfused tensor ops.
#include <cmath>

#include "adam.h"
#include "convert.h"
#include "variants.h"

namespace offloadd::adam {
namespace {

template <GradDtype kGrad>
inline float load_grad(const void* grad, size_t i) {
  if constexpr (kGrad == GradDtype::kFloat32) {
    return static_cast<const float*>(grad)[i];
  } else {
    return float_from_bf16(static_cast<const uint16_t*>(grad)[i]);
  }
}

template <OutDtype kOut>
inline void store_out(void* out, size_t i, float value) {
  if constexpr (kOut == OutDtype::kFloat32) {
    static_cast<float*>(out)[i] = value;
  } else if constexpr (kOut == OutDtype::kBFloat16) {
    static_cast<uint16_t*>(out)[i] = bf16_from_float(value);
  } else if constexpr (kOut == OutDtype::kFloat16) {
    static_cast<uint16_t*>(out)[i] = fp16_from_float(value);
  }
}

struct ScalarKernel {
  template <GradDtype kGrad, OutDtype kOut, bool kL2>
  static void run(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
      float grad = load_grad<kGrad>(b.grad, i) * s.grad_scale;
      float param = b.master[i] * s.decay_factor;
      if constexpr (kL2) grad = grad + s.l2_weight_decay * param;
      float exp_avg = b.exp_avg[i];
      exp_avg = exp_avg + s.one_minus_beta1 * (grad - exp_avg);
      const float exp_avg_sq = b.exp_avg_sq[i] * s.beta2 + s.one_minus_beta2 * grad * grad;
      const float denom = std::sqrt(exp_avg_sq) / s.bias_correction2_sqrt + s.eps;
      param = param + s.neg_step_size * (exp_avg / denom);
      b.master[i] = param;
      b.exp_avg[i] = exp_avg;
      b.exp_avg_sq[i] = exp_avg_sq;
      store_out<kOut>(b.param_out, i, param);
    }
  }
};

}  // namespace

void step_scalar(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
  run_variant<ScalarKernel>(s, b, begin, end);
}

}  // namespace offloadd::adam
