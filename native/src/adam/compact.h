// Adam over compact moments: bf16 with stochastic rounding, or 8-bit block-wise
// (the formats are specified in offloadd/formats.py; offloadd/moment_codec.py is
// the torch encoder/decoder these kernels reproduce byte for byte).
//
// One algorithm for every ISA: each kernel TU defines a traits type V (its
// vector registers, loads, stores and arithmetic) and instantiates this code
// with it.  The Adam arithmetic below is the same operation sequence as that
// TU's fp32 kernel (V::fmadd is fused in the SIMD TUs and not in the scalar
// one), so a compact step equals: decode the moments, run the fp32 kernel of
// the same ISA, encode the new moments.
//
// Hazard (ODR across ISA flags, see variants.h): every function here is a
// template instantiated with the including TU's traits type, which lives in an
// anonymous namespace, so no instantiation is shared between TUs compiled with
// different -m flags.  This header includes nothing that defines functions.
#pragma once

#include "adam.h"

namespace offloadd::adam::compact {

// blockwise8 code layout: a code's magnitude is an fp32 value's (biased
// exponent << 3 | top 3 mantissa bits) minus a bias mapping 1.0 to the largest
// code (120 signed, 248 unsigned).
constexpr int kDroppedBits = 23 - 3;
constexpr uint32_t kSignedBias = (127u - 15u) << 3;
constexpr uint32_t kUnsignedBias = (127u - 31u) << 3;
constexpr uint32_t kSmallestCode = 1u << 3;
constexpr uint32_t kSignedHalfSmallestBits = (127u - 15u) << 23;  // 2^-15
constexpr size_t kBlockElements = 256;

template <class V>
struct Coefficients {
  typename V::F grad_scale, l2_weight_decay, decay_factor, one_minus_beta1, beta2,
      one_minus_beta2, eps, bias_correction2_sqrt, neg_step_size;

  explicit Coefficients(const StepScalars& s)
      : grad_scale(V::setf(s.grad_scale)), l2_weight_decay(V::setf(s.l2_weight_decay)),
        decay_factor(V::setf(s.decay_factor)), one_minus_beta1(V::setf(s.one_minus_beta1)),
        beta2(V::setf(s.beta2)), one_minus_beta2(V::setf(s.one_minus_beta2)),
        eps(V::setf(s.eps)), bias_correction2_sqrt(V::setf(s.bias_correction2_sqrt)),
        neg_step_size(V::setf(s.neg_step_size)) {}
};

// The fp32 kernels' update, operation for operation.
template <class V, bool kL2>
inline typename V::F adam_math(const Coefficients<V>& c, typename V::F grad,
                               typename V::F master, typename V::F& exp_avg,
                               typename V::F& exp_avg_sq) {
  using F = typename V::F;
  grad = V::mul(grad, c.grad_scale);
  F param = V::mul(master, c.decay_factor);
  if constexpr (kL2) grad = V::fmadd(c.l2_weight_decay, param, grad);
  exp_avg = V::fmadd(c.one_minus_beta1, V::sub(grad, exp_avg), exp_avg);
  exp_avg_sq = V::fmadd(V::mul(c.one_minus_beta2, grad), grad, V::mul(exp_avg_sq, c.beta2));
  const F denom = V::add(V::div(V::sqrt(exp_avg_sq), c.bias_correction2_sqrt), c.eps);
  return V::fmadd(c.neg_step_size, V::div(exp_avg, denom), param);
}

// ------------------------------------------------------------------ rounding bits

template <class V>
inline typename V::I mul32(typename V::I x, uint32_t constant) {
  return V::mullo(x, V::seti(constant));
}

// lowbias32 (C. Wellons), as moments._hash32.
template <class V>
inline typename V::I hash32(typename V::I x) {
  x = V::xori(x, V::template srl<16>(x));
  x = mul32<V>(x, 0x7FEB352Du);
  x = V::xori(x, V::template srl<15>(x));
  x = mul32<V>(x, 0x846CA68Bu);
  return V::xori(x, V::template srl<16>(x));
}

// Stochastic rounding to bf16: add 16 random bits, truncate; NaN -> 0xFFFF.
template <class V>
inline typename V::I bf16_stochastic(typename V::F value, typename V::I random16) {
  const typename V::I top = V::template srl<16>(V::addi(V::as_int(value), random16));
  return V::select(V::isnan(value), V::seti(0xFFFFu), top);
}

template <class V>
inline typename V::F bf16_load(const uint16_t* source) {
  return V::as_float(V::template sll<16>(V::load_u16(source)));
}

// ------------------------------------------------------------------ 8-bit codes

template <class V, bool kSigned>
inline typename V::I encode_code(typename V::F normalized) {
  using I = typename V::I;
  const I bits = V::as_int(normalized);
  const I magnitude_bits = V::andi(bits, V::seti(0x7FFFFFFFu));
  const I lsb = V::andi(V::template srl<kDroppedBits>(magnitude_bits), V::seti(1));
  const I rounded = V::template srl<kDroppedBits>(
      V::addi(V::addi(magnitude_bits, V::seti((1u << (kDroppedBits - 1)) - 1)), lsb));
  constexpr uint32_t bias = kSigned ? kSignedBias : kUnsignedBias;
  const I magnitude = V::subi(rounded, V::seti(bias));
  const I zero = V::seti(0), smallest = V::seti(kSmallestCode);
  // Below the smallest code: signed rounds to 0 or to it; unsigned never rounds to 0.
  const I below = kSigned
      ? V::select(V::lt(magnitude_bits, V::seti(kSignedHalfSmallestBits)), zero, smallest)
      : V::select(V::eq(magnitude_bits, zero), zero, smallest);
  const I code = V::select(V::lt(rounded, V::seti(bias + kSmallestCode)), below, magnitude);
  if constexpr (kSigned) {
    return V::ori(code, V::andi(V::template srl<24>(bits), V::seti(0x80u)));
  } else {
    return code;
  }
}

template <class V, bool kSigned>
inline typename V::F decode_code(typename V::I code) {
  using I = typename V::I;
  const I magnitude = kSigned ? V::andi(code, V::seti(0x7Fu)) : code;
  constexpr uint32_t bias = kSigned ? kSignedBias : kUnsignedBias;
  I bits = V::select(V::eq(magnitude, V::seti(0)), V::seti(0),
                     V::template sll<kDroppedBits>(V::addi(magnitude, V::seti(bias))));
  if constexpr (kSigned) {
    bits = V::ori(bits, V::template sll<24>(V::andi(code, V::seti(0x80u))));
  }
  return V::as_float(bits);
}

// ------------------------------------------------------------------ streams

// Element i of every stream; tails run on zero-padded copies of these.
template <GradDtype kGrad, OutDtype kOut>
struct Streams {
  float* master;
  const void* grad;
  void* param_out;
  void* exp_avg;     // uint16 bf16 bits or uint8 codes
  void* exp_avg_sq;
  const float* master_in;  // where the state is read (the streams above in place)
  const void* exp_avg_in;
  const void* exp_avg_sq_in;

  static constexpr size_t grad_bytes() { return kGrad == GradDtype::kFloat32 ? 4 : 2; }
  static constexpr size_t out_bytes() {
    return kOut == OutDtype::kNone ? 0 : (kOut == OutDtype::kFloat32 ? 4 : 2);
  }
};

inline void copy_bytes(void* destination, const void* source, size_t nbytes) {
  auto* d = static_cast<unsigned char*>(destination);
  const auto* s = static_cast<const unsigned char*>(source);
  for (size_t k = 0; k < nbytes; ++k) d[k] = s[k];
}

template <GradDtype kGrad, OutDtype kOut>
inline Streams<kGrad, kOut> offset(const Streams<kGrad, kOut>& s, size_t i, size_t moment_bytes) {
  using S = Streams<kGrad, kOut>;
  return {s.master + i, static_cast<const unsigned char*>(s.grad) + i * S::grad_bytes(),
          s.param_out == nullptr ? nullptr
                                 : static_cast<unsigned char*>(s.param_out) + i * S::out_bytes(),
          static_cast<unsigned char*>(s.exp_avg) + i * moment_bytes,
          static_cast<unsigned char*>(s.exp_avg_sq) + i * moment_bytes,
          s.master_in + i,
          static_cast<const unsigned char*>(s.exp_avg_in) + i * moment_bytes,
          static_cast<const unsigned char*>(s.exp_avg_sq_in) + i * moment_bytes};
}

// Runs `body(staged streams)` on zero-padded copies of the first n (< capacity)
// elements of `s` and copies the results back: the same vector code as full spans.
template <size_t kCapacity, size_t kMomentBytes, GradDtype kGrad, OutDtype kOut, class Body>
inline void staged(const Streams<kGrad, kOut>& s, size_t n, Body body) {
  using S = Streams<kGrad, kOut>;
  alignas(64) float master[kCapacity] = {};
  alignas(64) float grad[kCapacity] = {};       // float-sized slots also hold bf16 grads
  alignas(64) float out[kCapacity] = {};
  alignas(64) unsigned char exp_avg[kCapacity * kMomentBytes] = {};
  alignas(64) unsigned char exp_avg_sq[kCapacity * kMomentBytes] = {};
  copy_bytes(master, s.master_in, n * 4);
  copy_bytes(grad, s.grad, n * S::grad_bytes());
  copy_bytes(exp_avg, s.exp_avg_in, n * kMomentBytes);
  copy_bytes(exp_avg_sq, s.exp_avg_sq_in, n * kMomentBytes);
  const S local{master,  grad,       kOut == OutDtype::kNone ? nullptr : out,
                exp_avg, exp_avg_sq, master,
                exp_avg, exp_avg_sq};
  body(local);
  copy_bytes(s.master, master, n * 4);
  if (S::out_bytes() != 0) copy_bytes(s.param_out, out, n * S::out_bytes());
  copy_bytes(s.exp_avg, exp_avg, n * kMomentBytes);
  copy_bytes(s.exp_avg_sq, exp_avg_sq, n * kMomentBytes);
}

// ------------------------------------------------------------------ streaming stores

// Out of place (the state read from other buffers than those written), the written
// state is not read again this pass: a task's full vectors go out as streaming stores
// (no read-for-ownership of the destination lines) where each written stream starts
// the task (`master` etc. at its first element) aligned to its vector's bytes; the task
// ends with V::fence(). Also the fp32 kernels' test, with 4-byte moments.
template <class V>
inline bool can_stream(const float* master, const float* master_in, const void* exp_avg,
                       const void* exp_avg_sq, size_t moment_bytes) {
  const auto aligned = [](const void* address, size_t nbytes) {
    return reinterpret_cast<uintptr_t>(address) % nbytes == 0;
  };
  return master != master_in && aligned(master, V::kLanes * 4) &&
         aligned(exp_avg, V::kLanes * moment_bytes) &&
         aligned(exp_avg_sq, V::kLanes * moment_bytes);
}

// `value` stored at `destination` with the traits' `stream_store` or plain `store`.
template <class Destination, class Value>
inline void put(void (*store)(Destination*, Value), void (*stream_store)(Destination*, Value),
                Destination* destination, Value value, bool stream) {
  if (stream) {
    stream_store(destination, value);
  } else {
    store(destination, value);
  }
}

// ------------------------------------------------------------------ bf16 moments

// Elements [0, V::kLanes) of `s`; `index` numbers element 0 for the rounding bits.
template <class V, GradDtype kGrad, OutDtype kOut, bool kL2>
inline void bf16_vector(const Coefficients<V>& c, const Streams<kGrad, kOut>& s, uint32_t index,
                        uint32_t key, bool stream) {
  using F = typename V::F;
  using I = typename V::I;
  auto* exp_avg_bits = static_cast<uint16_t*>(s.exp_avg);
  auto* exp_avg_sq_bits = static_cast<uint16_t*>(s.exp_avg_sq);
  F exp_avg = bf16_load<V>(static_cast<const uint16_t*>(s.exp_avg_in));
  F exp_avg_sq = bf16_load<V>(static_cast<const uint16_t*>(s.exp_avg_sq_in));
  const F param = adam_math<V, kL2>(c, V::template load_grad<kGrad>(s.grad, 0),
                                    V::loadf(s.master_in), exp_avg, exp_avg_sq);
  put(V::storef, V::streamf, s.master, param, stream);
  V::template store_out<kOut>(s.param_out, 0, param);
  const I random = hash32<V>(V::xori(V::addi(V::seti(index), V::iota()), V::seti(key)));
  put(V::store_u16, V::stream_u16, exp_avg_bits,
      bf16_stochastic<V>(exp_avg, V::andi(random, V::seti(0xFFFFu))), stream);
  put(V::store_u16, V::stream_u16, exp_avg_sq_bits,
      bf16_stochastic<V>(exp_avg_sq, V::template srl<16>(random)), stream);
}

template <class V, GradDtype kGrad, OutDtype kOut, bool kL2>
void run_bf16(const StepScalars& scalars, const Streams<kGrad, kOut>& all, uint32_t key,
              size_t begin, size_t end) {
  const Coefficients<V> c(scalars);
  const Streams<kGrad, kOut> first = offset(all, begin, 2);
  const bool stream =
      can_stream<V>(first.master, first.master_in, first.exp_avg, first.exp_avg_sq, 2);
  size_t i = begin;
  for (; i + V::kLanes <= end; i += V::kLanes) {
    bf16_vector<V, kGrad, kOut, kL2>(c, offset(all, i, 2), uint32_t(i), key, stream);
  }
  if (i < end) {
    staged<V::kLanes, 2>(offset(all, i, 2), end - i, [&](const Streams<kGrad, kOut>& local) {
      bf16_vector<V, kGrad, kOut, kL2>(c, local, uint32_t(i), key, false);
    });
  }
  if (stream) V::fence();
}

// ------------------------------------------------------------------ blockwise8 moments

// A block's scales: read from the state's `*_in`, written to the new state's.
struct BlockScales {
  float exp_avg_in, exp_avg_sq_in;
  float& exp_avg;
  float& exp_avg_sq;
};

// One whole block (kBlockElements elements of `s`; a short last block runs staged,
// its padding all zeros, which leave the absmax alone).
template <class V, GradDtype kGrad, OutDtype kOut, bool kL2>
void blockwise8_block(const Coefficients<V>& c, const Streams<kGrad, kOut>& s,
                      const BlockScales& scales, bool stream) {
  using F = typename V::F;
  alignas(64) float exp_avg_new[kBlockElements];
  alignas(64) float exp_avg_sq_new[kBlockElements];
  auto* exp_avg_codes = static_cast<uint8_t*>(s.exp_avg);
  auto* exp_avg_sq_codes = static_cast<uint8_t*>(s.exp_avg_sq);
  const auto* exp_avg_codes_in = static_cast<const uint8_t*>(s.exp_avg_in);
  const auto* exp_avg_sq_codes_in = static_cast<const uint8_t*>(s.exp_avg_sq_in);
  const F exp_avg_old_scale = V::setf(scales.exp_avg_in);
  const F exp_avg_sq_old_scale = V::setf(scales.exp_avg_sq_in);
  F exp_avg_max = V::setf(0.0f), exp_avg_sq_max = V::setf(0.0f);
  for (size_t j = 0; j < kBlockElements; j += V::kLanes) {
    F exp_avg =
        V::mul(decode_code<V, true>(V::load_u8(exp_avg_codes_in + j)), exp_avg_old_scale);
    F exp_avg_sq = V::mul(decode_code<V, false>(V::load_u8(exp_avg_sq_codes_in + j)),
                          exp_avg_sq_old_scale);
    const F param = adam_math<V, kL2>(c, V::template load_grad<kGrad>(s.grad, j),
                                      V::loadf(s.master_in + j), exp_avg, exp_avg_sq);
    put(V::storef, V::streamf, s.master + j, param, stream);
    V::template store_out<kOut>(s.param_out, j, param);
    V::storef(exp_avg_new + j, exp_avg);
    V::storef(exp_avg_sq_new + j, exp_avg_sq);
    exp_avg_max = V::maxf(exp_avg_max, V::absf(exp_avg));
    exp_avg_sq_max = V::maxf(exp_avg_sq_max, exp_avg_sq);
  }
  const float exp_avg_scale = scales.exp_avg = V::hmax(exp_avg_max);
  const float exp_avg_sq_scale = scales.exp_avg_sq = V::hmax(exp_avg_sq_max);
  // An all-zero block keeps scale 0 and divides by 1, so its codes are zero too.
  const F exp_avg_divisor = V::setf(exp_avg_scale == 0.0f ? 1.0f : exp_avg_scale);
  const F exp_avg_sq_divisor = V::setf(exp_avg_sq_scale == 0.0f ? 1.0f : exp_avg_sq_scale);
  for (size_t j = 0; j < kBlockElements; j += V::kLanes) {
    put(V::store_u8, V::stream_u8, exp_avg_codes + j,
        encode_code<V, true>(V::div(V::loadf(exp_avg_new + j), exp_avg_divisor)), stream);
    put(V::store_u8, V::stream_u8, exp_avg_sq_codes + j,
        encode_code<V, false>(V::div(V::loadf(exp_avg_sq_new + j), exp_avg_sq_divisor)),
        stream);
  }
}

// [begin, end) must start on a block boundary (tasks are whole blocks but the last).
template <class V, GradDtype kGrad, OutDtype kOut, bool kL2>
void run_blockwise8(const StepScalars& scalars, const Streams<kGrad, kOut>& all,
                    const CompactMoments& m, size_t begin, size_t end) {
  const Coefficients<V> c(scalars);
  const Streams<kGrad, kOut> first = offset(all, begin, 1);
  const bool stream =
      can_stream<V>(first.master, first.master_in, first.exp_avg, first.exp_avg_sq, 1);
  for (size_t i = begin; i < end; i += kBlockElements) {
    const size_t block = i / kBlockElements;
    const BlockScales scales{m.exp_avg_scales_in[block], m.exp_avg_sq_scales_in[block],
                             m.exp_avg_scales[block], m.exp_avg_sq_scales[block]};
    const Streams<kGrad, kOut> here = offset(all, i, 1);
    if (i + kBlockElements <= end) {
      blockwise8_block<V, kGrad, kOut, kL2>(c, here, scales, stream);
    } else {
      staged<kBlockElements, 1>(here, end - i, [&](const Streams<kGrad, kOut>& local) {
        blockwise8_block<V, kGrad, kOut, kL2>(c, local, scales, false);
      });
    }
  }
  if (stream) V::fence();
}

// ------------------------------------------------------------------ dispatch

template <class V, GradDtype kGrad, OutDtype kOut, bool kL2>
void run_format(const StepScalars& s, const Buffers& b, const CompactMoments& m, size_t begin,
                size_t end) {
  const Streams<kGrad, kOut> all{b.master,    b.grad,       b.param_out,
                                 m.exp_avg,   m.exp_avg_sq, b.master_in,
                                 m.exp_avg_in, m.exp_avg_sq_in};
  if (m.format == MomentFormat::kBFloat16) {
    run_bf16<V, kGrad, kOut, kL2>(s, all, m.rounding_key, begin, end);
  } else {
    run_blockwise8<V, kGrad, kOut, kL2>(s, all, m, begin, end);
  }
}

template <class V, GradDtype kGrad, bool kL2>
void run_out(const StepScalars& s, const Buffers& b, const CompactMoments& m, size_t begin,
             size_t end) {
  switch (b.out_dtype) {
    case OutDtype::kNone:
      return run_format<V, kGrad, OutDtype::kNone, kL2>(s, b, m, begin, end);
    case OutDtype::kFloat32:
      return run_format<V, kGrad, OutDtype::kFloat32, kL2>(s, b, m, begin, end);
    case OutDtype::kBFloat16:
      return run_format<V, kGrad, OutDtype::kBFloat16, kL2>(s, b, m, begin, end);
    case OutDtype::kFloat16:
      return run_format<V, kGrad, OutDtype::kFloat16, kL2>(s, b, m, begin, end);
  }
}

template <class V, bool kL2>
void run_grad(const StepScalars& s, const Buffers& b, const CompactMoments& m, size_t begin,
              size_t end) {
  if (b.grad_dtype == GradDtype::kFloat32) {
    run_out<V, GradDtype::kFloat32, kL2>(s, b, m, begin, end);
  } else {
    run_out<V, GradDtype::kBFloat16, kL2>(s, b, m, begin, end);
  }
}

template <class V>
void run(const StepScalars& s, const Buffers& b, const CompactMoments& m, size_t begin,
         size_t end) {
  if (s.l2_weight_decay != 0.0f) {
    run_grad<V, true>(s, b, m, begin, end);
  } else {
    run_grad<V, false>(s, b, m, begin, end);
  }
}

}  // namespace offloadd::adam::compact
