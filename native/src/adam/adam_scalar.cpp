// Portable kernel: the reference for the SIMD kernels and the path on CPUs
// without AVX2.  Compiled without FMA contraction so it rounds like torch's
// unfused tensor ops.
#include <cmath>
#include <cstring>

#include "adam.h"
#include "compact.h"
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
      float param = b.master_in[i] * s.decay_factor;
      if constexpr (kL2) grad = grad + s.l2_weight_decay * param;
      float exp_avg = b.exp_avg_in[i];
      exp_avg = exp_avg + s.one_minus_beta1 * (grad - exp_avg);
      const float exp_avg_sq = b.exp_avg_sq_in[i] * s.beta2 + s.one_minus_beta2 * grad * grad;
      const float denom = std::sqrt(exp_avg_sq) / s.bias_correction2_sqrt + s.eps;
      param = param + s.neg_step_size * (exp_avg / denom);
      b.master[i] = param;
      b.exp_avg[i] = exp_avg;
      b.exp_avg_sq[i] = exp_avg_sq;
      store_out<kOut>(b.param_out, i, param);
    }
  }
};

// One-lane "vectors" for compact.h: the same arithmetic as ScalarKernel (no FMA).
struct ScalarLanes {
  using F = float;
  using I = uint32_t;
  using M = bool;
  static constexpr size_t kLanes = 1;

  static F setf(float value) { return value; }
  static I seti(uint32_t value) { return value; }
  static I iota() { return 0; }
  static F loadf(const float* source) { return *source; }
  static void storef(float* destination, F value) { *destination = value; }
  template <GradDtype kGrad>
  static F load_grad(const void* grad, size_t i) { return adam::load_grad<kGrad>(grad, i); }
  template <OutDtype kOut>
  static void store_out(void* out, size_t i, F value) { adam::store_out<kOut>(out, i, value); }
  static I load_u8(const uint8_t* source) { return *source; }
  static void store_u8(uint8_t* destination, I value) { *destination = uint8_t(value); }
  static I load_u16(const uint16_t* source) { return *source; }
  static void store_u16(uint16_t* destination, I value) { *destination = uint16_t(value); }
  // No streaming stores one lane at a time (compact.h): plain ones.
  static void streamf(float* destination, F value) { storef(destination, value); }
  static void stream_u8(uint8_t* destination, I value) { store_u8(destination, value); }
  static void stream_u16(uint16_t* destination, I value) { store_u16(destination, value); }
  static void fence() {}

  static F add(F a, F b) { return a + b; }
  static F sub(F a, F b) { return a - b; }
  static F mul(F a, F b) { return a * b; }
  static F div(F a, F b) { return a / b; }
  static F fmadd(F a, F b, F c) { return a * b + c; }  // two roundings: -ffp-contract=off
  static F sqrt(F a) { return std::sqrt(a); }
  static F maxf(F a, F b) { return a > b ? a : b; }
  static F absf(F a) { return std::fabs(a); }
  static float hmax(F a) { return a; }
  static M isnan(F a) { return std::isnan(a); }

  static I as_int(F value) {
    I bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits;
  }
  static F as_float(I bits) {
    F value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  static I addi(I a, I b) { return a + b; }
  static I subi(I a, I b) { return a - b; }
  static I andi(I a, I b) { return a & b; }
  static I ori(I a, I b) { return a | b; }
  static I xori(I a, I b) { return a ^ b; }
  static I mullo(I a, I b) { return a * b; }  // uint32 wraps mod 2^32
  template <int kBits>
  static I srl(I a) { return a >> kBits; }
  template <int kBits>
  static I sll(I a) { return a << kBits; }
  // Operands stay below 2^31 wherever the SIMD kernels compare signed.
  static M lt(I a, I b) { return a < b; }
  static M eq(I a, I b) { return a == b; }
  static I select(M mask, I a, I b) { return mask ? a : b; }
};

}  // namespace

void step_scalar(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
  run_variant<ScalarKernel>(s, b, begin, end);
}

void step_compact_scalar(const StepScalars& s, const Buffers& b, const CompactMoments& m,
                         size_t begin, size_t end) {
  compact::run<ScalarLanes>(s, b, m, begin, end);
}

}  // namespace offloadd::adam
