// AVX2 + FMA + F16C kernel: 8 lanes.  AVX2 has no 16-bit masked loads, so
// the tail (< 8 elements) is staged through zero-padded stack buffers and
// runs through the very same vector code as the body.
#include <immintrin.h>

#include "adam.h"
#include "compact.h"
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

// 8-lane vectors for compact.h: the same arithmetic as Avx2Kernel below (fused where it
// is).
struct Avx2Lanes {
  using F = __m256;
  using I = __m256i;
  using M = __m256i;  // all-ones lanes
  static constexpr size_t kLanes = adam::kLanes;

  static F setf(float value) { return _mm256_set1_ps(value); }
  static I seti(uint32_t value) { return _mm256_set1_epi32(int(value)); }
  static I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
  static F loadf(const float* source) { return _mm256_loadu_ps(source); }
  static void storef(float* destination, F value) { _mm256_storeu_ps(destination, value); }
  template <GradDtype kGrad>
  static F load_grad(const void* grad, size_t i) { return adam::load_grad<kGrad>(grad, i); }
  template <OutDtype kOut>
  static void store_out(void* out, size_t i, F value) { adam::store_out<kOut>(out, i, value); }
  static I load_u8(const uint8_t* source) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(source)));
  }
  static void store_u8(uint8_t* destination, I value) {
    // Byte 0 of each 32-bit lane to the front of its 128-bit half, then join the halves.
    const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, 0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, -1, -1);
    const __m256i packed = _mm256_shuffle_epi8(value, pick);
    const __m128i joined = _mm_unpacklo_epi32(_mm256_castsi256_si128(packed),
                                              _mm256_extracti128_si256(packed, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(destination), joined);
  }
  static I load_u16(const uint16_t* source) {
    return _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
  }
  static void store_u16(uint16_t* destination, I value) {
    // Lanes hold values below 2^16, so unsigned saturation packs them exactly.
    _mm_storeu_si128(reinterpret_cast<__m128i*>(destination),
                     _mm_packus_epi32(_mm256_castsi256_si128(value),
                                      _mm256_extracti128_si256(value, 1)));
  }
  // Streaming stores (compact.h, out of place): destinations aligned to the vector's bytes.
  // 8 codes are one 64-bit store: written plainly.
  static void streamf(float* destination, F value) { _mm256_stream_ps(destination, value); }
  static void stream_u8(uint8_t* destination, I value) { store_u8(destination, value); }
  static void stream_u16(uint16_t* destination, I value) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination),
                     _mm_packus_epi32(_mm256_castsi256_si128(value),
                                      _mm256_extracti128_si256(value, 1)));
  }
  static void fence() { _mm_sfence(); }

  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  static F maxf(F a, F b) { return _mm256_max_ps(a, b); }
  static F absf(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
  static float hmax(F a) {
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    half = _mm_max_ss(half, _mm_shuffle_ps(half, half, 1));
    return _mm_cvtss_f32(half);
  }
  static M isnan(F a) { return _mm256_castps_si256(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)); }

  static I as_int(F value) { return _mm256_castps_si256(value); }
  static F as_float(I bits) { return _mm256_castsi256_ps(bits); }
  static I addi(I a, I b) { return _mm256_add_epi32(a, b); }
  static I subi(I a, I b) { return _mm256_sub_epi32(a, b); }
  static I andi(I a, I b) { return _mm256_and_si256(a, b); }
  static I ori(I a, I b) { return _mm256_or_si256(a, b); }
  static I xori(I a, I b) { return _mm256_xor_si256(a, b); }
  static I mullo(I a, I b) { return _mm256_mullo_epi32(a, b); }
  template <int kBits>
  static I srl(I a) { return _mm256_srli_epi32(a, kBits); }
  template <int kBits>
  static I sll(I a) { return _mm256_slli_epi32(a, kBits); }
  static M lt(I a, I b) { return _mm256_cmpgt_epi32(b, a); }
  static M eq(I a, I b) { return _mm256_cmpeq_epi32(a, b); }
  static I select(M mask, I a, I b) { return _mm256_blendv_epi8(b, a, mask); }
};

struct Avx2Kernel {
  template <GradDtype kGrad, OutDtype kOut, bool kL2>
  static inline void update(const Coefficients& c, const Buffers& b, size_t i,
                            bool stream_state = false) {
    __m256 grad = _mm256_mul_ps(load_grad<kGrad>(b.grad, i), c.grad_scale);
    __m256 param = _mm256_mul_ps(_mm256_loadu_ps(b.master_in + i), c.decay_factor);
    if constexpr (kL2) grad = _mm256_fmadd_ps(c.l2_weight_decay, param, grad);
    __m256 exp_avg = _mm256_loadu_ps(b.exp_avg_in + i);
    exp_avg = _mm256_fmadd_ps(c.one_minus_beta1, _mm256_sub_ps(grad, exp_avg), exp_avg);
    __m256 exp_avg_sq = _mm256_mul_ps(_mm256_loadu_ps(b.exp_avg_sq_in + i), c.beta2);
    exp_avg_sq = _mm256_fmadd_ps(_mm256_mul_ps(c.one_minus_beta2, grad), grad, exp_avg_sq);
    const __m256 denom = _mm256_add_ps(
        _mm256_div_ps(_mm256_sqrt_ps(exp_avg_sq), c.bias_correction2_sqrt), c.eps);
    param = _mm256_fmadd_ps(c.neg_step_size, _mm256_div_ps(exp_avg, denom), param);
    if (stream_state) {  // out of place, 32-byte aligned (see run)
      _mm256_stream_ps(b.master + i, param);
      _mm256_stream_ps(b.exp_avg + i, exp_avg);
      _mm256_stream_ps(b.exp_avg_sq + i, exp_avg_sq);
    } else {
      _mm256_storeu_ps(b.master + i, param);
      _mm256_storeu_ps(b.exp_avg + i, exp_avg);
      _mm256_storeu_ps(b.exp_avg_sq + i, exp_avg_sq);
    }
    store_out<kOut>(b.param_out, i, param);
  }

  // Stages elements [i, end) (fewer than kLanes) through zero-padded buffers.
  template <GradDtype kGrad, OutDtype kOut, bool kL2>
  static void update_tail(const Coefficients& c, const Buffers& b, size_t i, size_t end) {
    float master[kLanes] = {}, exp_avg[kLanes] = {}, exp_avg_sq[kLanes] = {};
    float grad[kLanes] = {}, out[kLanes] = {};  // float-sized slots also hold 16-bit values
    const size_t n = end - i;
    const size_t gsize = grad_bytes(b.grad_dtype), osize = out_bytes(b.out_dtype);
    copy_bytes(master, b.master_in + i, n * 4);
    copy_bytes(exp_avg, b.exp_avg_in + i, n * 4);
    copy_bytes(exp_avg_sq, b.exp_avg_sq_in + i, n * 4);
    copy_bytes(grad, static_cast<const unsigned char*>(b.grad) + i * gsize, n * gsize);
    const Buffers staged{master, exp_avg, exp_avg_sq, grad,      b.grad_dtype,
                         out,    b.out_dtype, master,  exp_avg, exp_avg_sq};
    update<kGrad, kOut, kL2>(c, staged, 0);
    copy_bytes(b.master + i, master, n * 4);
    copy_bytes(b.exp_avg + i, exp_avg, n * 4);
    copy_bytes(b.exp_avg_sq + i, exp_avg_sq, n * 4);
    if (osize != 0) copy_bytes(static_cast<unsigned char*>(b.param_out) + i * osize, out, n * osize);
  }

  template <GradDtype kGrad, OutDtype kOut, bool kL2>
  static void run(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
    const Coefficients c = broadcast(s);
    // Streaming stores skip the read-for-ownership of lines this pass never reads.
    const bool stream_state = compact::can_stream<Avx2Lanes>(
        b.master + begin, b.master_in + begin, b.exp_avg + begin, b.exp_avg_sq + begin, 4);
    size_t i = begin;
    for (; i + kLanes <= end; i += kLanes) update<kGrad, kOut, kL2>(c, b, i, stream_state);
    if (i < end) update_tail<kGrad, kOut, kL2>(c, b, i, end);
    // Non-temporal stores are weakly ordered: visible before the pool reports the task.
    if (stream_state) _mm_sfence();
  }
};

}  // namespace

void step_avx2(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
  run_variant<Avx2Kernel>(s, b, begin, end);
}

void step_compact_avx2(const StepScalars& s, const Buffers& b, const CompactMoments& m,
                       size_t begin, size_t end) {
  compact::run<Avx2Lanes>(s, b, m, begin, end);
}

}  // namespace offloadd::adam
