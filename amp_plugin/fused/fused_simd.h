// The number formats and vector types of amp_plugin's fused CPU kernels (master_step.cpp).
//
// BF16 bit conversions (round to nearest even, as c10 does; stochastic rounding from a
// counter-based hash of the element's index and a key), and vector types with the same
// operations, V1 (plain C++), V8 (AVX2 + FMA + F16C), V16 (AVX-512), and V8P and V16P (sixteen and
// thirty-two elements in two vectors, for all-16-bit streams), which compute the same bits: a loop
// written once over a vector type gives the same results at every width.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__AVX2__) && defined(__F16C__)
#define AMP_PLUGIN_SIMD 1
#include <immintrin.h>
#endif
// The avx512 build: V16 below, 16 elements at a time. Every width computes the same bits as
// the scalar code.
#if defined(AMP_PLUGIN_SIMD) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define AMP_PLUGIN_AVX512 1
#endif

// The vector types' operations, the loads and stores of the policies and the update are a few
// instructions each: the inner loops must inline them (GCC's heuristics otherwise leave calls,
// with the constants read through pointers, in the loop over a template instantiation this large).
#if defined(__GNUC__)
#define AMP_INLINE __attribute__((always_inline)) inline
#define AMP_LAMBDA_INLINE __attribute__((always_inline))
#else
#define AMP_INLINE inline
#define AMP_LAMBDA_INLINE
#endif

namespace {

using BF16Bits = uint16_t;

AMP_INLINE float bf16_to_float(BF16Bits b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// a * b + c where torch's fused Adam has a fused multiply-add: its builds for FMA CPUs (and the
// compiler's contractions in them, which its scalar tails get too) round once; its x86-64 default
// build, for CPUs without FMA (and ATEN_CPU_CAPABILITY=default), has none and rounds the product
// first. amp_plugin's generic variant is built for such CPUs (no -mfma): so is the rounding.
AMP_INLINE float fma_as_torch(float a, float b, float c) {
#if defined(__x86_64__) && !defined(__FMA__)
  return a * b + c;
#else
  return std::fma(a, b, c);
#endif
}

// g times maximize's sign (1 or -1). The same number either way; a NaN keeps its sign through the
// product but not through a negation, which is what torch's x86-64 default build runs (its compiler
// turns the product by the constant -1 into one).
AMP_INLINE float times_sign_as_torch(float g, float sign) {
#if defined(__x86_64__) && !defined(__FMA__)
  return sign < 0 ? -g : g;
#else
  return g * sign;
#endif
}

// Round to nearest even, as c10::BFloat16 does; NaN stays NaN.
AMP_INLINE BF16Bits float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return 0x7fc0;
  }
  return static_cast<BF16Bits>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// A BF16 number with stochastic rounding: rounds up (in magnitude) with probability
// low16(f) / 2**16, given 16 uniform random bits r; NaN stays NaN.
AMP_INLINE BF16Bits bf16_stochastic(float f, uint32_t r) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return 0x7fc0;
  }
  return static_cast<BF16Bits>((u + r) >> 16);
}

// The random bits of stochastic rounding: a counter-based hash (MurmurHash3's finaliser) of the
// element's index and a per-tensor, per-step key, so the bits do not depend on threads or vector
// width, and amp_plugin/master_weights/_stochastic.py computes the same with torch ops. A rounding
// takes the hash's high 16 bits; Adam's two moments share one hash per element, exp_avg taking
// the high 16 bits and exp_avg_sq the low 16.
constexpr uint32_t kIndexMultiplier = 0x9e3779b1u;
constexpr uint32_t kMix1 = 0x85ebca6bu;
constexpr uint32_t kMix2 = 0xc2b2ae35u;
AMP_INLINE uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= kMix1;
  h ^= h >> 13;
  h *= kMix2;
  h ^= h >> 16;
  return h;
}
AMP_INLINE uint32_t sr_hash(uint32_t key, int64_t i) { return fmix32(static_cast<uint32_t>(i) * kIndexMultiplier + key); }

AMP_INLINE uint32_t nonfinite(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}

template <typename Half>
AMP_INLINE float to_float(Half h) {
  if constexpr (std::is_same_v<Half, _Float16>) {
    return static_cast<float>(h);
  } else {
    return bf16_to_float(h);
  }
}

// Vector types: V1 (plain C++), V8 (AVX2 + FMA + F16C), V16 (AVX-512). Each has float
// arithmetic, FP16/BF16 conversions that round like c10's (nearest even, NaN kept) into H
// (its 16-bit lanes), stores of one or two H (two: one wider store, whole 32 or 64 bytes when
// non-temporal), and the split-master loads and stores.
struct V1 {
  using F = float;
  using H = uint16_t;
  static constexpr int64_t kWidth = 1;
  static constexpr bool kPaired = true;  // adam_vectors takes two vectors per loop step
  AMP_INLINE static F set1(float x) { return x; }
  AMP_INLINE static F load(const float* p) { return *p; }
  AMP_INLINE static void store(float* p, F x) { *p = x; }
  AMP_INLINE static F add(F a, F b) { return a + b; }
  AMP_INLINE static F sub(F a, F b) { return a - b; }
  AMP_INLINE static F mul(F a, F b) { return a * b; }
  AMP_INLINE static F div(F a, F b) { return a / b; }
  AMP_INLINE static F sqrt(F a) { return std::sqrt(a); }
  AMP_INLINE static F fma(F a, F b, F c) { return fma_as_torch(a, b, c); }
  AMP_INLINE static F load_f16(const _Float16* p) { return static_cast<float>(*p); }
  AMP_INLINE static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  AMP_INLINE static H to_f16(F x) {
    const _Float16 h = static_cast<_Float16>(x);
    H bits;
    std::memcpy(&bits, &h, sizeof bits);
    return bits;
  }
  AMP_INLINE static bool no_nan(F x) { return x == x; }
  using M = bool;  // a lane mask, all lanes alike (select)
  AMP_INLINE static M mask(bool b) { return b; }
  AMP_INLINE static F select(M m, F a, F b) { return m ? a : b; }
  template <bool kNoNaN = false>  // kNoNaN: the caller knows no lane is NaN (ignored here: one branch per value)
  AMP_INLINE static H to_bf16(F x) {
    return float_to_bf16(x);
  }
  AMP_INLINE static void store_h(void* p, H x, bool) { *static_cast<H*>(p) = x; }
  AMP_INLINE static void store_h2(void* p, H x, H y, bool) {
    static_cast<H*>(p)[0] = x;
    static_cast<H*>(p)[1] = y;
  }
  // The remainder scheme: the weight is the FP32 value rounded to nearest (half away from zero
  // in magnitude), the signed remainder the difference of the bit patterns.
  AMP_INLINE static F load_rem(const uint16_t* hi, const uint16_t* lo) {
    const uint32_t u = (static_cast<uint32_t>(*hi) << 16) + static_cast<uint32_t>(static_cast<int16_t>(*lo));
    float f;
    std::memcpy(&f, &u, sizeof f);
    return f;
  }
  AMP_INLINE static void store_rem(uint16_t* hi, uint16_t* lo, F x) {
    uint32_t u;
    std::memcpy(&u, &x, sizeof u);
    const uint32_t low = u & 0xffffu;
    *hi = static_cast<uint16_t>((u >> 16) + (low >> 15));
    *lo = static_cast<uint16_t>(low);
  }
  template <bool kNoNaN = false>
  AMP_INLINE static H to_bf16_sr(F x, uint32_t key, int64_t i) {
    return bf16_stochastic(x, sr_hash(key, i) >> 16);
  }
  template <bool kNoNaN = false>
  AMP_INLINE static void store_sr_pair(uint16_t* m, uint16_t* v, F mi, F vi, uint32_t key, int64_t i) {
    const uint32_t h = sr_hash(key, i);
    *m = bf16_stochastic(mi, h >> 16);
    *v = bf16_stochastic(vi, h & 0xffffu);
  }
};

#if defined(AMP_PLUGIN_SIMD)
struct V8 {
  using F = __m256;
  using H = __m128i;
  static constexpr int64_t kWidth = 8;
  static constexpr bool kPaired = true;  // adam_vectors takes two vectors per loop step
  AMP_INLINE static F set1(float x) { return _mm256_set1_ps(x); }
  AMP_INLINE static F load(const float* p) { return _mm256_loadu_ps(p); }
  AMP_INLINE static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  AMP_INLINE static void stream(float* p, F x) { _mm256_stream_ps(p, x); }  // p 32-byte aligned
  AMP_INLINE static F add(F a, F b) { return _mm256_add_ps(a, b); }
  AMP_INLINE static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  AMP_INLINE static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  AMP_INLINE static F div(F a, F b) { return _mm256_div_ps(a, b); }
  AMP_INLINE static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  AMP_INLINE static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  AMP_INLINE static H load_h(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  AMP_INLINE static F load_f16(const _Float16* p) { return _mm256_cvtph_ps(load_h(p)); }
  AMP_INLINE static F load_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(load_h(p)), 16));
  }
  AMP_INLINE static H narrow(__m256i x) {  // eight 32-bit lanes below 2**16 -> eight 16-bit lanes
    return _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  }
  AMP_INLINE static H to_f16(F x) { return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  AMP_INLINE static bool no_nan(F x) { return _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) == 0; }
  using M = __m256;  // a lane mask in the sign bits (select)
  AMP_INLINE static M mask(bool b) { return _mm256_castsi256_ps(_mm256_set1_epi32(b ? -1 : 0)); }
  AMP_INLINE static F select(M m, F a, F b) { return _mm256_blendv_ps(b, a, m); }
  template <bool kNoNaN = false>  // kNoNaN: no lane of x is NaN, and the NaN handling is left out
  AMP_INLINE static H to_bf16(F x) {  // float_to_bf16, eight at a time
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    if constexpr (!kNoNaN) {
      const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    }
    return narrow(r);
  }
  AMP_INLINE static void store_h(void* p, H x, bool stream) {
    if (stream) {
      _mm_stream_si128(static_cast<__m128i*>(p), x);
    } else {
      _mm_storeu_si128(static_cast<__m128i*>(p), x);
    }
  }
  AMP_INLINE static void store_h2(void* p, H x, H y, bool stream) {
    const __m256i xy = _mm256_inserti128_si256(_mm256_castsi128_si256(x), y, 1);
    if (stream) {
      _mm256_stream_si256(static_cast<__m256i*>(p), xy);
    } else {
      _mm256_storeu_si256(static_cast<__m256i*>(p), xy);
    }
  }
  AMP_INLINE static F load_rem(const uint16_t* hi, const uint16_t* lo) {
    const __m256i h = _mm256_slli_epi32(_mm256_cvtepu16_epi32(load_h(hi)), 16);
    return _mm256_castsi256_ps(_mm256_add_epi32(h, _mm256_cvtepi16_epi32(load_h(lo))));
  }
  // the weight (u >> 16) + (low >> 15), the high half plus one when the low half is at least half an
  // ulp, is (u + 2**15) >> 16 modulo 2**32 (a NaN at the top wraps to 0 either way)
  AMP_INLINE static void store_rem(uint16_t* hi, uint16_t* lo, F x) {
    const __m256i u = _mm256_castps_si256(x);
    store_h(hi, narrow(_mm256_srli_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), 16)), false);
    store_h(lo, narrow(_mm256_and_si256(u, _mm256_set1_epi32(0xffff))), false);
  }
  AMP_INLINE static __m256i mix(__m256i h) {  // fmix32, eight at a time
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kMix1)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kMix2)));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  }
  // sr_hash of elements i .. i + 7: the index times the multiplier, as a scalar plus each lane's offset
  AMP_INLINE static __m256i hash(uint32_t key, int64_t i) {
    const int m = static_cast<int>(kIndexMultiplier);
    const __m256i lanes = _mm256_setr_epi32(0, m, 2 * m, 3 * m, 4 * m, 5 * m, 6 * m, 7 * m);  // wraps, as uint32
    return mix(_mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(i) * kIndexMultiplier + key)),
                                lanes));
  }
  template <bool kNoNaN>
  AMP_INLINE static H round_sr(F x, __m256i r) {  // bf16_stochastic with the random bits r (< 2**16)
    __m256i out = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
    if constexpr (!kNoNaN) {
      const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
      out = _mm256_blendv_epi8(out, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    }
    return narrow(out);
  }
  template <bool kNoNaN = false>
  AMP_INLINE static H to_bf16_sr(F x, uint32_t key, int64_t i) {
    return round_sr<kNoNaN>(x, _mm256_srli_epi32(hash(key, i), 16));
  }
  template <bool kNoNaN = false>
  AMP_INLINE static void store_sr_pair(uint16_t* m, uint16_t* v, F mi, F vi, uint32_t key, int64_t i) {
    const __m256i h = hash(key, i);
    store_h(m, round_sr<kNoNaN>(mi, _mm256_srli_epi32(h, 16)), false);
    store_h(v, round_sr<kNoNaN>(vi, _mm256_and_si256(h, _mm256_set1_epi32(0xffff))), false);
  }
};
#endif

#if defined(AMP_PLUGIN_SIMD)
// Sixteen elements as two AVX2 vectors in the order of 16-bit unpacking: a holds elements 0-3 and
// 8-11, b holds 4-7 and 12-15. Reading sixteen 16-bit values into that order is one unpack per
// vector (_mm256_unpacklo/hi_epi16 work within 128-bit lanes), and writing them back is one
// _mm256_packus_epi32 for both, which restores the order: a loop whose every stream is 16-bit
// (the BF16 gradient, weight, remainder and moments) pays no widening or lane-crossing shuffles.
// FP32 streams are reordered with two lane permutes each way. The hash's lane offsets follow the
// order, so every element gets V8's bits. (BF16 streams only: there is no FP16 conversion here.)
struct V8P {
  struct F {
    __m256 a, b;
  };
  using H = __m256i;  // sixteen 16-bit values, in memory order
  struct I {
    __m256i a, b;
  };
  static constexpr int64_t kWidth = 16;
  // one vector pair per loop step: two (four AVX2 registers per value) spill out of the sixteen
  static constexpr bool kPaired = false;
  AMP_INLINE static F set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  AMP_INLINE static F load(const float* p) {
    const __m256 lo = _mm256_loadu_ps(p), hi = _mm256_loadu_ps(p + 8);
    return {_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)};
  }
  AMP_INLINE static void store(float* p, F x) {
    _mm256_storeu_ps(p, _mm256_permute2f128_ps(x.a, x.b, 0x20));
    _mm256_storeu_ps(p + 8, _mm256_permute2f128_ps(x.a, x.b, 0x31));
  }
  AMP_INLINE static F add(F x, F y) { return {_mm256_add_ps(x.a, y.a), _mm256_add_ps(x.b, y.b)}; }
  AMP_INLINE static F sub(F x, F y) { return {_mm256_sub_ps(x.a, y.a), _mm256_sub_ps(x.b, y.b)}; }
  AMP_INLINE static F mul(F x, F y) { return {_mm256_mul_ps(x.a, y.a), _mm256_mul_ps(x.b, y.b)}; }
  AMP_INLINE static F div(F x, F y) { return {_mm256_div_ps(x.a, y.a), _mm256_div_ps(x.b, y.b)}; }
  AMP_INLINE static F sqrt(F x) { return {_mm256_sqrt_ps(x.a), _mm256_sqrt_ps(x.b)}; }
  AMP_INLINE static F fma(F x, F y, F z) { return {_mm256_fmadd_ps(x.a, y.a, z.a), _mm256_fmadd_ps(x.b, y.b, z.b)}; }
  AMP_INLINE static H load_h(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  AMP_INLINE static I bits(F x) { return {_mm256_castps_si256(x.a), _mm256_castps_si256(x.b)}; }
  AMP_INLINE static F floats(I x) { return {_mm256_castsi256_ps(x.a), _mm256_castsi256_ps(x.b)}; }
  AMP_INLINE static F load_bf16(const uint16_t* p) {  // each value into the high half of its lane
    const __m256i x = load_h(p), zero = _mm256_setzero_si256();
    return floats({_mm256_unpacklo_epi16(zero, x), _mm256_unpackhi_epi16(zero, x)});
  }
  AMP_INLINE static H narrow(I x) { return _mm256_packus_epi32(x.a, x.b); }  // lanes below 2**16, memory order
  // no lane of either vector is NaN (an unordered compare of the two is true where either is)
  AMP_INLINE static bool no_nan(F x) { return _mm256_movemask_ps(_mm256_cmp_ps(x.a, x.b, _CMP_UNORD_Q)) == 0; }
  using M = __m256;  // a lane mask in the sign bits, for both vectors (select)
  AMP_INLINE static M mask(bool b) { return V8::mask(b); }
  AMP_INLINE static F select(M m, F x, F y) { return {_mm256_blendv_ps(y.a, x.a, m), _mm256_blendv_ps(y.b, x.b, m)}; }
  template <bool kNoNaN>
  AMP_INLINE static __m256i nan_to_qnan(__m256 f, __m256i r) {  // r, or a quiet NaN where f is NaN
    if constexpr (kNoNaN) {
      return r;
    } else {
      return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
    }
  }
  template <bool kNoNaN = false>
  AMP_INLINE static H to_bf16(F x) {  // float_to_bf16, sixteen at a time
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff);
    auto round = [&](__m256 f) AMP_LAMBDA_INLINE {
      const __m256i u = _mm256_castps_si256(f);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
      return nan_to_qnan<kNoNaN>(f, _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, half), lsb), 16));
    };
    return narrow({round(x.a), round(x.b)});
  }
  AMP_INLINE static void store_h(void* p, H x, bool stream) {
    if (stream) {
      _mm256_stream_si256(static_cast<__m256i*>(p), x);
    } else {
      _mm256_storeu_si256(static_cast<__m256i*>(p), x);
    }
  }
  AMP_INLINE static void store_h2(void* p, H x, H y, bool stream) {
    store_h(p, x, stream);
    store_h(static_cast<uint16_t*>(p) + 16, y, stream);
  }
  // the remainder offset by 2**15 (an unsigned 16-bit value) joined below the weight, less 2**15:
  // (weight << 16) + remainder, as V8's sign extension gives it
  AMP_INLINE static F load_rem(const uint16_t* hi, const uint16_t* lo) {
    const __m256i h = load_h(hi), l = _mm256_xor_si256(load_h(lo), _mm256_set1_epi16(static_cast<int16_t>(0x8000)));
    const __m256i offset = _mm256_set1_epi32(0x8000);
    return floats({_mm256_sub_epi32(_mm256_unpacklo_epi16(l, h), offset),
                   _mm256_sub_epi32(_mm256_unpackhi_epi16(l, h), offset)});
  }
  AMP_INLINE static void store_rem(uint16_t* hi, uint16_t* lo, F x) {  // V8's, on both vectors
    const __m256i mask = _mm256_set1_epi32(0xffff), half = _mm256_set1_epi32(0x8000);
    const I u = bits(x);
    const __m256i ha = _mm256_srli_epi32(_mm256_add_epi32(u.a, half), 16);
    store_h(hi, narrow({ha, _mm256_srli_epi32(_mm256_add_epi32(u.b, half), 16)}), false);
    store_h(lo, narrow({_mm256_and_si256(u.a, mask), _mm256_and_si256(u.b, mask)}), false);
  }
  // sr_hash of elements i .. i + 15 in this order: the index times the multiplier, as a scalar plus each lane's offset
  AMP_INLINE static I hash(uint32_t key, int64_t i) {
    const int m = static_cast<int>(kIndexMultiplier);
    const __m256i base = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(i) * kIndexMultiplier + key));
    const __m256i lanes_a = _mm256_setr_epi32(0, m, 2 * m, 3 * m, 8 * m, 9 * m, 10 * m, 11 * m);  // wraps, as uint32
    const __m256i lanes_b = _mm256_setr_epi32(4 * m, 5 * m, 6 * m, 7 * m, 12 * m, 13 * m, 14 * m, 15 * m);
    return {V8::mix(_mm256_add_epi32(base, lanes_a)), V8::mix(_mm256_add_epi32(base, lanes_b))};
  }
  template <bool kNoNaN>
  AMP_INLINE static __m256i round_sr1(__m256 x, __m256i r) {  // bf16_stochastic with the random bits r (< 2**16)
    return nan_to_qnan<kNoNaN>(x, _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16));
  }
  template <bool kNoNaN = false>
  AMP_INLINE static H to_bf16_sr(F x, uint32_t key, int64_t i) {
    const I h = hash(key, i);
    const __m256i ra = round_sr1<kNoNaN>(x.a, _mm256_srli_epi32(h.a, 16));
    return narrow({ra, round_sr1<kNoNaN>(x.b, _mm256_srli_epi32(h.b, 16))});
  }
  template <bool kNoNaN = false>
  AMP_INLINE static void store_sr_pair(uint16_t* m, uint16_t* v, F mi, F vi, uint32_t key, int64_t i) {
    const I h = hash(key, i);
    const __m256i mask = _mm256_set1_epi32(0xffff);
    const __m256i ma = round_sr1<kNoNaN>(mi.a, _mm256_srli_epi32(h.a, 16));
    const __m256i va = round_sr1<kNoNaN>(vi.a, _mm256_and_si256(h.a, mask));
    store_h(m, narrow({ma, round_sr1<kNoNaN>(mi.b, _mm256_srli_epi32(h.b, 16))}), false);
    store_h(v, narrow({va, round_sr1<kNoNaN>(vi.b, _mm256_and_si256(h.b, mask))}), false);
  }
};
#endif

#if defined(AMP_PLUGIN_AVX512)
struct V16 {
  using F = __m512;
  using H = __m256i;
  static constexpr int64_t kWidth = 16;
  static constexpr bool kPaired = true;
  AMP_INLINE static F set1(float x) { return _mm512_set1_ps(x); }
  AMP_INLINE static F load(const float* p) { return _mm512_loadu_ps(p); }
  AMP_INLINE static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  AMP_INLINE static void stream(float* p, F x) { _mm512_stream_ps(p, x); }  // p 64-byte aligned
  AMP_INLINE static F add(F a, F b) { return _mm512_add_ps(a, b); }
  AMP_INLINE static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  AMP_INLINE static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  AMP_INLINE static F div(F a, F b) { return _mm512_div_ps(a, b); }
  AMP_INLINE static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  AMP_INLINE static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  AMP_INLINE static H load_h(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  AMP_INLINE static F load_f16(const _Float16* p) { return _mm512_cvtph_ps(load_h(p)); }
  AMP_INLINE static F load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(load_h(p)), 16));
  }
  AMP_INLINE static H to_f16(F x) { return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  AMP_INLINE static bool no_nan(F x) { return _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) == 0; }
  using M = __mmask16;  // a lane mask (select)
  AMP_INLINE static M mask(bool b) { return b ? 0xffff : 0; }
  AMP_INLINE static F select(M m, F a, F b) { return _mm512_mask_blend_ps(m, b, a); }
  template <bool kNoNaN = false>  // kNoNaN: no lane of x is NaN, and the NaN handling is left out
  AMP_INLINE static H to_bf16(F x) {  // float_to_bf16, sixteen at a time
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    if constexpr (!kNoNaN) {
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
    }
    return _mm512_cvtepi32_epi16(r);  // every lane is below 2**16: the truncation is exact
  }
  AMP_INLINE static void store_h(void* p, H x, bool stream) {
    if (stream) {
      _mm256_stream_si256(static_cast<__m256i*>(p), x);
    } else {
      _mm256_storeu_si256(static_cast<__m256i*>(p), x);
    }
  }
  AMP_INLINE static void store_h2(void* p, H x, H y, bool stream) {
    const __m512i xy = _mm512_inserti64x4(_mm512_castsi256_si512(x), y, 1);
    if (stream) {
      _mm512_stream_si512(static_cast<__m512i*>(p), xy);
    } else {
      _mm512_storeu_si512(p, xy);
    }
  }
  AMP_INLINE static F load_rem(const uint16_t* hi, const uint16_t* lo) {
    const __m512i h = _mm512_slli_epi32(_mm512_cvtepu16_epi32(load_h(hi)), 16);
    return _mm512_castsi512_ps(_mm512_add_epi32(h, _mm512_cvtepi16_epi32(load_h(lo))));
  }
  AMP_INLINE static void store_rem(uint16_t* hi, uint16_t* lo, F x) {  // as V8's; the truncations keep the low halves
    const __m512i u = _mm512_castps_si512(x);
    store_h(hi, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x8000)), 16)), false);
    store_h(lo, _mm512_cvtepi32_epi16(u), false);
  }
  AMP_INLINE static __m512i mix(__m512i h) {  // fmix32, sixteen at a time
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kMix1)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kMix2)));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  }
  // sr_hash of elements i .. i + 15: the index times the multiplier, as a scalar plus each lane's offset
  AMP_INLINE static __m512i hash(uint32_t key, int64_t i) {
    const int m = static_cast<int>(kIndexMultiplier);
    const __m512i lanes = _mm512_set_epi32(15 * m, 14 * m, 13 * m, 12 * m, 11 * m, 10 * m, 9 * m, 8 * m, 7 * m, 6 * m,
                                           5 * m, 4 * m, 3 * m, 2 * m, m, 0);  // wraps, as uint32
    return mix(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(i) * kIndexMultiplier + key)),
                                lanes));
  }
  template <bool kNoNaN>
  AMP_INLINE static H round_sr(F x, __m512i r) {  // bf16_stochastic with the random bits r (< 2**16)
    __m512i out = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    if constexpr (!kNoNaN) {
      const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      out = _mm512_mask_blend_epi32(nan, out, _mm512_set1_epi32(0x7fc0));
    }
    return _mm512_cvtepi32_epi16(out);
  }
  template <bool kNoNaN = false>
  AMP_INLINE static H to_bf16_sr(F x, uint32_t key, int64_t i) {
    return round_sr<kNoNaN>(x, _mm512_srli_epi32(hash(key, i), 16));
  }
  template <bool kNoNaN = false>
  AMP_INLINE static void store_sr_pair(uint16_t* m, uint16_t* v, F mi, F vi, uint32_t key, int64_t i) {
    const __m512i h = hash(key, i);
    store_h(m, round_sr<kNoNaN>(mi, _mm512_srli_epi32(h, 16)), false);
    store_h(v, round_sr<kNoNaN>(vi, _mm512_and_si512(h, _mm512_set1_epi32(0xffff))), false);
  }
};
#endif

#if defined(AMP_PLUGIN_AVX512)
// V8P at twice the width: thirty-two elements as two AVX-512 vectors in 16-bit unpack order. The
// AVX-512 unpacks and packs work within 128-bit lanes too, so a holds elements 0-3, 8-11, 16-19
// and 24-27, b the other sixteen, and one pack of both restores memory order: no vpmovzxwd or
// vpmovdw (lane-crossing shuffles) for the 16-bit streams. 16-bit streams only: the loops of
// kAll16Bit (adam_update.h) read and write nothing else.
struct V16P {
  struct F {
    __m512 a, b;
  };
  using H = __m512i;  // thirty-two 16-bit values, in memory order
  struct I {
    __m512i a, b;
  };
  static constexpr int64_t kWidth = 32;
  static constexpr bool kPaired = true;  // thirty-two registers: no spills
  AMP_INLINE static F set1(float x) { return {_mm512_set1_ps(x), _mm512_set1_ps(x)}; }
  AMP_INLINE static F add(F x, F y) { return {_mm512_add_ps(x.a, y.a), _mm512_add_ps(x.b, y.b)}; }
  AMP_INLINE static F sub(F x, F y) { return {_mm512_sub_ps(x.a, y.a), _mm512_sub_ps(x.b, y.b)}; }
  AMP_INLINE static F mul(F x, F y) { return {_mm512_mul_ps(x.a, y.a), _mm512_mul_ps(x.b, y.b)}; }
  AMP_INLINE static F div(F x, F y) { return {_mm512_div_ps(x.a, y.a), _mm512_div_ps(x.b, y.b)}; }
  AMP_INLINE static F sqrt(F x) { return {_mm512_sqrt_ps(x.a), _mm512_sqrt_ps(x.b)}; }
  AMP_INLINE static F fma(F x, F y, F z) { return {_mm512_fmadd_ps(x.a, y.a, z.a), _mm512_fmadd_ps(x.b, y.b, z.b)}; }
  AMP_INLINE static H load_h(const void* p) { return _mm512_loadu_si512(p); }
  AMP_INLINE static I bits(F x) { return {_mm512_castps_si512(x.a), _mm512_castps_si512(x.b)}; }
  AMP_INLINE static F floats(I x) { return {_mm512_castsi512_ps(x.a), _mm512_castsi512_ps(x.b)}; }
  AMP_INLINE static F load_bf16(const uint16_t* p) {  // each value into the high half of its lane
    const __m512i x = load_h(p), zero = _mm512_setzero_si512();
    return floats({_mm512_unpacklo_epi16(zero, x), _mm512_unpackhi_epi16(zero, x)});
  }
  AMP_INLINE static H narrow(I x) { return _mm512_packus_epi32(x.a, x.b); }  // lanes below 2**16, memory order
  // no lane of either vector is NaN (an unordered compare of the two is true where either is)
  AMP_INLINE static bool no_nan(F x) { return _mm512_cmp_ps_mask(x.a, x.b, _CMP_UNORD_Q) == 0; }
  using M = __mmask16;  // a lane mask, for both vectors (select)
  AMP_INLINE static M mask(bool b) { return V16::mask(b); }
  AMP_INLINE static F select(M m, F x, F y) {
    return {_mm512_mask_blend_ps(m, y.a, x.a), _mm512_mask_blend_ps(m, y.b, x.b)};
  }
  template <bool kNoNaN>
  AMP_INLINE static __m512i nan_to_qnan(__m512 f, __m512i r) {  // r, or a quiet NaN where f is NaN
    if constexpr (kNoNaN) {
      return r;
    } else {
      return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7fc0));
    }
  }
  template <bool kNoNaN = false>
  AMP_INLINE static H to_bf16(F x) {  // float_to_bf16, thirty-two at a time
    const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7fff);
    auto round = [&](__m512 f) AMP_LAMBDA_INLINE {
      const __m512i u = _mm512_castps_si512(f);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
      return nan_to_qnan<kNoNaN>(f, _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, half), lsb), 16));
    };
    return narrow({round(x.a), round(x.b)});
  }
  AMP_INLINE static void store_h(void* p, H x, bool stream) {
    if (stream) {
      _mm512_stream_si512(static_cast<__m512i*>(p), x);
    } else {
      _mm512_storeu_si512(p, x);
    }
  }
  AMP_INLINE static void store_h2(void* p, H x, H y, bool stream) {
    store_h(p, x, stream);
    store_h(static_cast<uint16_t*>(p) + 32, y, stream);
  }
  AMP_INLINE static F load_rem(const uint16_t* hi, const uint16_t* lo) {  // as V8P's
    const __m512i h = load_h(hi), l = _mm512_xor_si512(load_h(lo), _mm512_set1_epi16(static_cast<int16_t>(0x8000)));
    const __m512i offset = _mm512_set1_epi32(0x8000);
    return floats({_mm512_sub_epi32(_mm512_unpacklo_epi16(l, h), offset),
                   _mm512_sub_epi32(_mm512_unpackhi_epi16(l, h), offset)});
  }
  AMP_INLINE static void store_rem(uint16_t* hi, uint16_t* lo, F x) {  // V8's, on both vectors
    const __m512i mask = _mm512_set1_epi32(0xffff), half = _mm512_set1_epi32(0x8000);
    const I u = bits(x);
    const __m512i ha = _mm512_srli_epi32(_mm512_add_epi32(u.a, half), 16);
    store_h(hi, narrow({ha, _mm512_srli_epi32(_mm512_add_epi32(u.b, half), 16)}), false);
    store_h(lo, narrow({_mm512_and_si512(u.a, mask), _mm512_and_si512(u.b, mask)}), false);
  }
  // sr_hash of elements i .. i + 31 in this order: the index times the multiplier, as a scalar plus each lane's offset
  AMP_INLINE static I hash(uint32_t key, int64_t i) {
    const int m = static_cast<int>(kIndexMultiplier);
    const __m512i base = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(i) * kIndexMultiplier + key));
    const __m512i lanes_a = _mm512_setr_epi32(0, m, 2 * m, 3 * m, 8 * m, 9 * m, 10 * m, 11 * m, 16 * m, 17 * m,
                                              18 * m, 19 * m, 24 * m, 25 * m, 26 * m, 27 * m);  // wraps, as uint32
    const __m512i lanes_b = _mm512_add_epi32(lanes_a, _mm512_set1_epi32(4 * m));
    return {V16::mix(_mm512_add_epi32(base, lanes_a)), V16::mix(_mm512_add_epi32(base, lanes_b))};
  }
  template <bool kNoNaN>
  AMP_INLINE static __m512i round_sr1(__m512 x, __m512i r) {  // bf16_stochastic with the random bits r (< 2**16)
    return nan_to_qnan<kNoNaN>(x, _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16));
  }
  template <bool kNoNaN = false>
  AMP_INLINE static H to_bf16_sr(F x, uint32_t key, int64_t i) {
    const I h = hash(key, i);
    const __m512i ra = round_sr1<kNoNaN>(x.a, _mm512_srli_epi32(h.a, 16));
    return narrow({ra, round_sr1<kNoNaN>(x.b, _mm512_srli_epi32(h.b, 16))});
  }
  template <bool kNoNaN = false>
  AMP_INLINE static void store_sr_pair(uint16_t* m, uint16_t* v, F mi, F vi, uint32_t key, int64_t i) {
    const I h = hash(key, i);
    const __m512i mask = _mm512_set1_epi32(0xffff);
    const __m512i ma = round_sr1<kNoNaN>(mi.a, _mm512_srli_epi32(h.a, 16));
    const __m512i va = round_sr1<kNoNaN>(vi.a, _mm512_and_si512(h.a, mask));
    store_h(m, narrow({ma, round_sr1<kNoNaN>(mi.b, _mm512_srli_epi32(h.b, 16))}), false);
    store_h(v, narrow({va, round_sr1<kNoNaN>(vi.b, _mm512_and_si512(h.b, mask))}), false);
  }
};
#endif

}  // namespace
