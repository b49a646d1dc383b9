// Bit-exact scalar conversions between fp32 and the 16-bit float formats.
//
// They reproduce torch's c10::BFloat16 / c10::Half rounding (round to
// nearest, ties to even, subnormals kept), so a param_out written by any
// kernel equals `master.to(torch.bfloat16 / torch.float16)` bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace offloadd::adam {

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

inline float float_from_bits(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// bf16 is the top half of an fp32, so widening is exact.
inline float float_from_bf16(uint16_t bf16) { return float_from_bits(uint32_t(bf16) << 16); }

// Any NaN becomes 0xFFFF, as torch's vectorized `.to(torch.bfloat16)` does
// (c10's scalar constructor would give 0x7FC0; tensors use the vector path).
inline constexpr uint16_t kBFloat16Nan = 0xFFFF;

inline uint16_t bf16_from_float(float value) {
  uint32_t bits = float_bits(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return kBFloat16Nan;
  // Adding 0x7FFF plus the lowest kept bit rounds ties towards the even result.
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// Rounds `mantissa >> shift` to nearest, ties to even.
inline uint32_t shift_round_even(uint32_t mantissa, uint32_t shift) {
  uint32_t kept = mantissa >> shift;
  uint32_t remainder = mantissa & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (remainder > half || (remainder == half && (kept & 1u))) ++kept;
  return kept;
}

inline uint16_t fp16_from_float(float value) {
  const uint32_t bits = float_bits(value);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  // NaN: quiet, its payload's top 10 bits kept, as vcvtps2ph (the vector paths, and
  // torch's `.to(torch.float16)`) does.
  if (magnitude > 0x7F800000u) return sign | 0x7E00u | uint16_t((magnitude >> 13) & 0x3FFu);
  if (magnitude >= 0x477FF000u) return sign | 0x7C00u;  // rounds past 65504: inf
  if (magnitude >= 0x38800000u) {                       // normal fp16 (>= 2^-14)
    // Rebias the exponent (127 -> 15); a rounding carry may bump the exponent, which is right.
    uint32_t rebased = magnitude - (112u << 23);
    return sign | uint16_t(shift_round_even(rebased, 13));
  }
  const uint32_t exponent = magnitude >> 23;
  if (exponent < 102u) return sign;  // below half the smallest subnormal (2^-25)
  // Subnormal fp16: units of 2^-24; a carry into 0x400 yields the smallest normal.
  const uint32_t mantissa = (magnitude & 0x7FFFFFu) | 0x800000u;
  return sign | uint16_t(shift_round_even(mantissa, 126u - exponent));
}

}  // namespace offloadd::adam
