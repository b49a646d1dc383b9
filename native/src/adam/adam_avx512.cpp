// AVX-512 kernel (F + BW + VL): 16 lanes; the tail is one masked iteration,
// so there is no scalar remainder loop that could round differently.
//
// bf16 output uses the integer round-to-nearest-even sequence rather than
// VCVTNEPS2BF16 (AVX512-BF16): that instruction flushes subnormal inputs to
// zero, which would break bit-exactness with torch's `.to(torch.bfloat16)`.
// bf16 input needs no special instruction: widening is a 16-bit shift.
#include <immintrin.h>

#include "adam.h"
#include "compact.h"
#include "variants.h"

namespace offloadd::adam {
namespace {

// Step scalars broadcast once per call, not per vector.
struct Coefficients {
  __m512 grad_scale, l2_weight_decay, decay_factor, one_minus_beta1, beta2, one_minus_beta2, eps,
      bias_correction2_sqrt, neg_step_size;
};

Coefficients broadcast(const StepScalars& s) {
  return {_mm512_set1_ps(s.grad_scale),     _mm512_set1_ps(s.l2_weight_decay),
          _mm512_set1_ps(s.decay_factor),   _mm512_set1_ps(s.one_minus_beta1),
          _mm512_set1_ps(s.beta2),          _mm512_set1_ps(s.one_minus_beta2),
          _mm512_set1_ps(s.eps),            _mm512_set1_ps(s.bias_correction2_sqrt),
          _mm512_set1_ps(s.neg_step_size)};
}

template <GradDtype kGrad>
inline __m512 load_grad(const void* grad, size_t i, __mmask16 mask) {
  if constexpr (kGrad == GradDtype::kFloat32) {
    return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(grad) + i);
  } else {
    const __m256i raw = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(grad) + i);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
  }
}

// Same rounding as bf16_from_float in convert.h (ties to even, NaN -> 0xFFFF).
inline __m256i bf16_from_float(__m512 value) {
  const __m512i bits = _mm512_castps_si512(value);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(value, value, _CMP_UNORD_Q);
  rounded = _mm512_mask_blend_epi32(is_nan, rounded, _mm512_set1_epi32(-1));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

// param_out is written once and not read again by this pass, so full
// vectors go out as non-temporal stores when aligned: that skips the
// read-for-ownership of each destination line (measured ~5% per step on the
// mixed bf16 path).  master/exp_avg/exp_avg_sq were just read when the step
// runs in place, so their lines are cached and plain stores are faster there;
// out of place they are streamed too.
template <OutDtype kOut>
constexpr size_t out_element_bytes() {
  return kOut == OutDtype::kFloat32 ? 4 : 2;
}

template <OutDtype kOut>
inline void store_out(void* out, size_t i, __m512 value, __mmask16 mask, bool stream) {
  if constexpr (kOut == OutDtype::kFloat32) {
    float* dst = static_cast<float*>(out) + i;
    if (stream) {
      _mm512_stream_ps(dst, value);
    } else {
      _mm512_mask_storeu_ps(dst, mask, value);
    }
  } else if constexpr (kOut != OutDtype::kNone) {
    uint16_t* dst = static_cast<uint16_t*>(out) + i;
    const __m256i packed = kOut == OutDtype::kBFloat16
                               ? bf16_from_float(value)
                               : _mm512_cvtps_ph(value, _MM_FROUND_TO_NEAREST_INT);
    if (stream) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), packed);
    } else {
      _mm256_mask_storeu_epi16(dst, mask, packed);
    }
  }
}

// 16-lane vectors for compact.h: the same arithmetic as Avx512Kernel below (fused where
// it is).
struct Avx512Lanes {
  using F = __m512;
  using I = __m512i;
  using M = __mmask16;
  static constexpr size_t kLanes = 16;
  static constexpr __mmask16 kAll = 0xFFFF;

  static F setf(float value) { return _mm512_set1_ps(value); }
  static I seti(uint32_t value) { return _mm512_set1_epi32(int(value)); }
  static I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
  static F loadf(const float* source) { return _mm512_loadu_ps(source); }
  static void storef(float* destination, F value) { _mm512_storeu_ps(destination, value); }
  template <GradDtype kGrad>
  static F load_grad(const void* grad, size_t i) { return adam::load_grad<kGrad>(grad, i, kAll); }
  template <OutDtype kOut>
  static void store_out(void* out, size_t i, F value) {
    adam::store_out<kOut>(out, i, value, kAll, false);
  }
  static I load_u8(const uint8_t* source) {
    return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
  }
  static void store_u8(uint8_t* destination, I value) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(destination), _mm512_cvtepi32_epi8(value));
  }
  static I load_u16(const uint16_t* source) {
    return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source)));
  }
  static void store_u16(uint16_t* destination, I value) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(destination), _mm512_cvtepi32_epi16(value));
  }
  // Streaming stores (compact.h, out of place): destinations aligned to the vector's bytes.
  static void streamf(float* destination, F value) { _mm512_stream_ps(destination, value); }
  static void stream_u8(uint8_t* destination, I value) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(destination), _mm512_cvtepi32_epi8(value));
  }
  static void stream_u16(uint16_t* destination, I value) {
    _mm256_stream_si256(reinterpret_cast<__m256i*>(destination), _mm512_cvtepi32_epi16(value));
  }
  static void fence() { _mm_sfence(); }

  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  static F maxf(F a, F b) { return _mm512_max_ps(a, b); }
  static F absf(F a) { return _mm512_abs_ps(a); }
  static float hmax(F a) { return _mm512_reduce_max_ps(a); }
  static M isnan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }

  static I as_int(F value) { return _mm512_castps_si512(value); }
  static F as_float(I bits) { return _mm512_castsi512_ps(bits); }
  static I addi(I a, I b) { return _mm512_add_epi32(a, b); }
  static I subi(I a, I b) { return _mm512_sub_epi32(a, b); }
  static I andi(I a, I b) { return _mm512_and_si512(a, b); }
  static I ori(I a, I b) { return _mm512_or_si512(a, b); }
  static I xori(I a, I b) { return _mm512_xor_si512(a, b); }
  static I mullo(I a, I b) { return _mm512_mullo_epi32(a, b); }
  template <int kBits>
  static I srl(I a) { return _mm512_srli_epi32(a, kBits); }
  template <int kBits>
  static I sll(I a) { return _mm512_slli_epi32(a, kBits); }
  static M lt(I a, I b) { return _mm512_cmplt_epi32_mask(a, b); }
  static M eq(I a, I b) { return _mm512_cmpeq_epi32_mask(a, b); }
  static I select(M mask, I a, I b) { return _mm512_mask_blend_epi32(mask, b, a); }
};

// The fp32 kernel; streams its state's stores out of place (compact::can_stream).
struct Avx512Kernel {
  // Masked-off lanes load zeros and are never stored, so they cannot fault or leak.
  template <GradDtype kGrad, OutDtype kOut, bool kL2>
  static inline void update(const Coefficients& c, const Buffers& b, size_t i, __mmask16 mask,
                            bool stream_out, bool stream_state) {
    __m512 grad = _mm512_mul_ps(load_grad<kGrad>(b.grad, i, mask), c.grad_scale);
    __m512 param = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, b.master_in + i), c.decay_factor);
    if constexpr (kL2) grad = _mm512_fmadd_ps(c.l2_weight_decay, param, grad);
    __m512 exp_avg = _mm512_maskz_loadu_ps(mask, b.exp_avg_in + i);
    exp_avg = _mm512_fmadd_ps(c.one_minus_beta1, _mm512_sub_ps(grad, exp_avg), exp_avg);
    __m512 exp_avg_sq = _mm512_mul_ps(_mm512_maskz_loadu_ps(mask, b.exp_avg_sq_in + i), c.beta2);
    exp_avg_sq = _mm512_fmadd_ps(_mm512_mul_ps(c.one_minus_beta2, grad), grad, exp_avg_sq);
    const __m512 denom = _mm512_add_ps(
        _mm512_div_ps(_mm512_sqrt_ps(exp_avg_sq), c.bias_correction2_sqrt), c.eps);
    param = _mm512_fmadd_ps(c.neg_step_size, _mm512_div_ps(exp_avg, denom), param);
    if (stream_state) {
      _mm512_stream_ps(b.master + i, param);
      _mm512_stream_ps(b.exp_avg + i, exp_avg);
      _mm512_stream_ps(b.exp_avg_sq + i, exp_avg_sq);
    } else {
      _mm512_mask_storeu_ps(b.master + i, mask, param);
      _mm512_mask_storeu_ps(b.exp_avg + i, mask, exp_avg);
      _mm512_mask_storeu_ps(b.exp_avg_sq + i, mask, exp_avg_sq);
    }
    store_out<kOut>(b.param_out, i, param, mask, stream_out);
  }

  template <GradDtype kGrad, OutDtype kOut, bool kL2>
  static void run(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
    const Coefficients c = broadcast(s);
    // Each step advances the destination by exactly one vector, so
    // alignment at `begin` holds for the whole loop.
    const uintptr_t out_address =
        reinterpret_cast<uintptr_t>(b.param_out) + begin * out_element_bytes<kOut>();
    const bool stream_out =
        kOut != OutDtype::kNone && out_address % (16 * out_element_bytes<kOut>()) == 0;
    const bool stream_state = compact::can_stream<Avx512Lanes>(
        b.master + begin, b.master_in + begin, b.exp_avg + begin, b.exp_avg_sq + begin, 4);
    size_t i = begin;
    for (; i + 16 <= end; i += 16) {
      update<kGrad, kOut, kL2>(c, b, i, __mmask16(0xFFFF), stream_out, stream_state);
    }
    if (i < end) {
      update<kGrad, kOut, kL2>(c, b, i, __mmask16((1u << (end - i)) - 1u), false, false);
    }
    // Non-temporal stores are weakly ordered: make them visible before the
    // pool reports this task done.
    if (stream_out || stream_state) _mm_sfence();
  }
};

}  // namespace

void step_avx512(const StepScalars& s, const Buffers& b, size_t begin, size_t end) {
  run_variant<Avx512Kernel>(s, b, begin, end);
}

void step_compact_avx512(const StepScalars& s, const Buffers& b, const CompactMoments& m,
                         size_t begin, size_t end) {
  compact::run<Avx512Lanes>(s, b, m, begin, end);
}

}  // namespace offloadd::adam
