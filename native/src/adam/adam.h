// Fused CPU Adam/AdamW over fp32 master weights and fp32 or compact moments.
//
// One pass reads master, exp_avg, exp_avg_sq and grad and writes master,
// exp_avg, exp_avg_sq and (optionally) a low-precision copy of the updated
// master.  The state is read through the `*_in` pointers: equal to the
// written ones for an in-place step, another copy for an out-of-place one (a
// speculative step keeps the state it read, so it can be taken back).  The arithmetic follows torch.optim.Adam/AdamW (see StepScalars).
// Compact moments (bf16, 8-bit block-wise; compact.h) are decoded to fp32,
// updated with the same arithmetic and encoded again in the same pass.
#pragma once

#include <cstddef>
#include <cstdint>

namespace offloadd::adam {

enum class GradDtype : int { kFloat32 = 0, kBFloat16 = 1 };
enum class OutDtype : int { kNone = 0, kFloat32 = 1, kBFloat16 = 2, kFloat16 = 3 };

// Per-step scalars.  They are derived in double precision and rounded to
// float once, which is what torch does when a Python float multiplies an
// fp32 tensor, so every kernel sees the same coefficients as torch.
struct StepScalars {
  float one_minus_beta1;       // lerp weight of exp_avg towards grad
  float beta2;
  float one_minus_beta2;
  float eps;
  float grad_scale;            // g = grad * grad_scale (unscale/clip fold)
  float l2_weight_decay;       // Adam (L2) mode: g += wd * p; 0 in AdamW mode
  float decay_factor;          // AdamW mode: p *= 1 - lr * wd; 1 in Adam mode
  float neg_step_size;         // -lr / (1 - beta1^step)
  float bias_correction2_sqrt; // sqrt(1 - beta2^step)
};

StepScalars make_step_scalars(int64_t step, double lr, double beta1, double beta2, double eps,
                              double weight_decay, bool decoupled_weight_decay,
                              double grad_scale);

struct Buffers {
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  const void* grad;
  GradDtype grad_dtype;
  void* param_out;  // nullptr when out_dtype == kNone
  OutDtype out_dtype;
  const float* master_in;  // where the state is read: master etc. in place
  const float* exp_avg_in;
  const float* exp_avg_sq_in;
};

// How exp_avg / exp_avg_sq are stored when they are not fp32 (offloadd/formats.py).
enum class MomentFormat : int { kBFloat16 = 1, kBlockwise8 = 2 };

struct CompactMoments {
  MomentFormat format;
  void* exp_avg;               // bf16 bits, or blockwise8 codes (one byte per element)
  void* exp_avg_sq;
  float* exp_avg_scales;       // blockwise8: one absmax per kBlockElements elements
  float* exp_avg_sq_scales;
  uint32_t rounding_key;       // bf16: key of this step's stochastic rounding
  const void* exp_avg_in;      // where the moments are read (the above in place)
  const void* exp_avg_sq_in;
  const float* exp_avg_scales_in;
  const float* exp_avg_sq_scales_in;
};

// Updates elements [begin, end).  Each kernel computes an element the same
// way wherever chunk boundaries fall, so threading never changes results.
using KernelFn = void (*)(const StepScalars&, const Buffers&, size_t begin, size_t end);

void step_scalar(const StepScalars&, const Buffers&, size_t begin, size_t end);
#if defined(OFFLOADD_X86_KERNELS)
void step_avx2(const StepScalars&, const Buffers&, size_t begin, size_t end);
void step_avx512(const StepScalars&, const Buffers&, size_t begin, size_t end);
#endif

// The same over compact moments (Buffers' exp_avg / exp_avg_sq are unused).  begin
// is a multiple of the blockwise8 block size; only the final task ends mid-block.
using CompactKernelFn = void (*)(const StepScalars&, const Buffers&, const CompactMoments&,
                                 size_t begin, size_t end);

void step_compact_scalar(const StepScalars&, const Buffers&, const CompactMoments&, size_t begin,
                         size_t end);
#if defined(OFFLOADD_X86_KERNELS)
void step_compact_avx2(const StepScalars&, const Buffers&, const CompactMoments&, size_t begin,
                       size_t end);
void step_compact_avx512(const StepScalars&, const Buffers&, const CompactMoments&,
                         size_t begin, size_t end);
#endif

}  // namespace offloadd::adam
