// AVX2 + FMA + F16C kernel: 8 lanes.  AVX2 has no 16-bit masked loads, so
// the tail (< 8 elements) is staged through zero-padded stack buffers and
// runs through the very same vector code as the body.
#include <immintrin.h>

#include "adam.h"
#include "variants.h"

namespace offloadd::adam {
namespace {

constexpr size_t kLanes = 8;

// Step scalars broadcast once per call, not per vector.
struct Coefficients {
  __m256 grad_scale, l2_weight_decay, decay_factor, one_minus_beta1, beta2, one_minus_beta2, eps,
      bias_correction2_sqrt, neg_step_size;
};

Coefficients broadcast(const StepScalars& s) {
  return {_mm256_set1_ps(s.grad_scale),     _mm256_set1_ps(s.l2_weight_decay),
          _mm256_set1_ps(s.decay_factor),   _mm256_set1_ps(s.one_minus_beta1),
          _mm256_set1_ps(s.beta2),          _mm256_set1_ps(s.one_minus_beta2),
          _mm256_set1_ps(s.eps),            _mm256_set1_ps(s.bias_correction2_sqrt),
          _mm256_set1_ps(s.neg_step_size)};
}

template <GradDtype kGrad>
inline __m256 load_grad(const void* grad, size_t i) {
  if constexpr (kGrad == GradDtype::kFloat32) {
    return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  } else {
    const __m128i raw =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
}

// Same rounding as bf16_from_float in convert.h (ties to even, NaN -> 0xFFFF).
inline __m128i bf16_from_float(__m256 value) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(-1), is_nan);
  const __m256i top = _mm256_srli_epi32(rounded, 16);  // fits 16 bits, so unsigned packing is exact
  return _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
}

template <OutDtype kOut>
inline void store_out(void* out, size_t i, __m256 value) {
  auto* out16 = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(out) + i);
  if constexpr (kOut == OutDtype::kFloat32) {
    _mm256_storeu_ps(static_cast<float*>(out) + i, value);
  } else if constexpr (kOut == OutDtype::kBFloat16) {
    _mm_storeu_si128(out16, bf16_from_float(value));
  } else if constexpr (kOut == OutDtype::kFloat16) {
    _mm_storeu_si128(out16, _mm256_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT));
  }
}

// Element size of the grad / param_out streams, for staging the tail.
inline size_t grad_bytes(GradDtype dtype) { return dtype == GradDtype::kFloat32 ? 4 : 2; }
inline size_t out_bytes(OutDtype dtype) {
  return dtype == OutDtype::kNone ? 0 : (dtype == OutDtype::kFloat32 ? 4 : 2);
}

inline void copy_bytes(void* dst, const void* src, size_t nbytes) {
  auto* d = static_cast<unsigned char*>(dst);
  const auto* s = static_cast<const unsigned char*>(src);
  for (size_t k = 0; k < nbytes; ++k) d[k] = s[k];
}

struct Avx2Kernel {
  template <GradDtype kGrad, OutDtype kOut, bool kL2>
  static inline void update(const Coefficients& c, const Buffers& b, size_t i) {
    __m256 grad = _mm256_mul_ps(load_grad<kGrad>(b.grad, i), c.grad_scale);
    __m256 param = _mm256_mul_ps(_mm256_loadu_ps(b.master + i), c.decay_factor);
    if constexpr (kL2) grad = _mm256_fmadd_ps(c.l2_weight_decay, param, grad);
    __m256 exp_avg = _mm256_loadu_ps(b.exp_avg + i);
    exp_avg = _mm256_fmadd_ps(c.one_minus_beta1, _mm256_sub_ps(grad, exp_avg), exp_avg);
    __m256 exp_avg_sq = _mm256_mul_ps(_mm256_loadu_ps(b.exp_avg_sq + i), c.beta2);
    exp_avg_sq = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, grad), grad, exp_avg_sq);
    const __m256 denom = _mm256_add_ps(
        _mm256_div_ps(_mm256_sqrt_ps(exp_avg_sq), c.bias_correction2_sqrt), c.eps);
    param = _mm256_fmadd_ps(c.neg_step_size, _mm256_div_ps(exp_avg, denom), param);
    _mm256_storeu_ps(b.master + i, param);
    _mm256_storeu_ps(b.exp_avg + i, exp_avg);
    _mm256_storeu_ps(b.exp_avg_sq + i, exp_avg_sq);
    store_out<kOut>(b.param_out, i, param);
  }

  // Stages elements [i, end) (fewer than kLanes) through zero-padded buffers.
  template <GradDtype kGrad, OutDtype kOut, bool kL2>
  static void update_tail(const Coefficients& c, const Buffers& b, size_t i, size_t end) {
    float master[kLanes] = {}, exp_avg[kLanes] = {}, exp_avg_sq[kLanes] = {};
    float grad[kLanes] = {}, out[kLanes] = {};  // float-sized slots also hold 16-bit values
    const size_t n = end - i;
    const size_t gsize = grad_bytes(b.grad_dtype), osize = out_bytes(b.out_dtype);
    copy_bytes(master, b.master + i, n * 4);
    copy_bytes(exp_avg, b.exp_avg + i, n * 4);
    copy_bytes(exp_avg_sq, b.exp_avg_sq + i, n * 4);
    copy_bytes(grad, static_cast<const unsigned char*>(b.grad) + i * gsize, n * gsize);
    const Buffers staged{master, exp_avg, exp_avg_sq, grad, b.grad_dtype, out, b.out_dtype};
    update<kGrad, kOut, kL2>(c, staged, 0);
    copy_bytes(b.master + i, master, n * 4);
    copy_bytes(b.exp_avg + i, exp_avg, n * 4);
    copy_bytes(b.exp_avg_sq + i, exp_avg_sq, n * 4);
    if (osize != 0) copy_bytes(static_cast<unsigned char*>(b.param_out) + i * osize, out, n * osize);
  }

  template <GradDtype kGrad, OutDtype kOut, bool kL2>
  static void run(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
    const Coefficients c = broadcast(s);
    size_t i = begin;
    for (; i + kLanes <= end; i += kLanes) update<kGrad, kOut, kL2>(c, b, i);
    if (i < end) update_tail<kGrad, kOut, kL2>(c, b, i, end);
  }
};

}  // namespace

void step_avx2(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
  run_variant<Avx2Kernel>(s, b, begin, end);
}

}  // namespace offloadd::adam
