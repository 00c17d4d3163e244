// Fused CPU kernels for FP32 master weights over an FP16/BF16 model.
//
// nonfinite_check_: the inf/NaN check of the step decision; reads the half-precision
//   gradients only (2 bytes per element).
// adam_step_: Adam/AdamW on the FP32 masters (torch.optim's fused Adam update, bit for bit)
//   in one pass per tensor: reads the gradient (FP32, or the model's FP16/BF16 gradient times
//   the unscale factor), the master and its moments, writes them back and writes the updated
//   weight, rounded to the model's dtype, into the model. Stock torch needs four passes
//   (copy the half gradients to FP32, unscale, Adam, copy back).
// adam_step_bf16_: the same update for a BF16 model without an FP32 master tensor: either the
//   model's BF16 weight is the FP32 master rounded to nearest and a signed 16-bit remainder
//   makes the FP32 value exact (master="bf16_split"), or there is no master and the updated
//   FP32 value is written back with stochastic rounding (master="stochastic").
// Adam's moments may be FP32 or BF16 (computed in FP32, rounded once when stored: stochastically
//   with moment_keys, one key per tensor, else to nearest).
// unscale_into_, unscale_copy: FP32 master gradients materialized from half gradients (copy,
//   unscale and inf check in one pass), for when something reads them or the step needs them.
//
// Built on first use by amp_plugin/fused/__init__.py with torch.utils.cpp_extension.load;
// the ops appear as torch.ops.amp_plugin.*.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__)
#define AMP_PLUGIN_SIMD 1
#include <immintrin.h>
#endif
// The avx512 build: the conversion loops below take 16 elements at a time (the Adam loop is
// vectorised by the compiler, 512 bits wide with -mprefer-vector-width=512). Every path
// computes the same bits as the scalar code.
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

constexpr int64_t kGrain = 1 << 15;        // elements per parallel task, at least
constexpr int64_t kBlock = 1024;           // elements converted per block, in L1
// An op whose big output (all tensors together) is this large stores it past the cache: it
// would not stay there anyway, and a cached store first reads each line from memory.
constexpr int64_t kStreamBytes = 8 << 20;

using BF16Bits = uint16_t;

AMP_INLINE float bf16_to_float(BF16Bits b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
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
// width, and amp_plugin/master_weights/_stochastic.py computes the same with torch ops.
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
AMP_INLINE uint32_t sr_bits(uint32_t key, int64_t i) {
  return fmix32(static_cast<uint32_t>(i) * kIndexMultiplier + key) >> 16;
}

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

// Block conversions between the half type and float; with stream=true the stores into the
// big output (FP32 master grads, the model's half weights) are non-temporal.
template <typename Half>
void to_float_block(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(AMP_PLUGIN_AVX512)
  if constexpr (std::is_same_v<Half, _Float16>) {
    for (; i + 16 <= n; i += 16) {
      _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
    }
  }
#endif
#if defined(AMP_PLUGIN_SIMD)
  if constexpr (std::is_same_v<Half, _Float16>) {  // GCC does not vectorise _Float16 casts itself
    for (; i + 8 <= n; i += 8) {
      _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    }
  }
#endif
  for (; i < n; ++i) {
    dst[i] = to_float<Half>(src[i]);
  }
}

void store_floats(const float* src, float* dst, int64_t n, bool stream) {
  int64_t i = 0;
#if defined(AMP_PLUGIN_AVX512)
  if (stream) {
    for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 64 != 0; ++i) {
      dst[i] = src[i];
    }
    for (; i + 16 <= n; i += 16) {
      _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
    }
  }
#elif defined(AMP_PLUGIN_SIMD)
  if (stream) {
    for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 32 != 0; ++i) {
      dst[i] = src[i];
    }
    for (; i + 8 <= n; i += 8) {
      _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
    }
  }
#endif
  std::memcpy(dst + i, src + i, sizeof(float) * (n - i));
}

// Non-temporal stores are weakly ordered: each thread that issued them fences before its
// task ends, so the op's results are visible when it returns.
inline void fence_streams() {
#if defined(AMP_PLUGIN_SIMD)
  _mm_sfence();
#endif
}

void check_pair(const at::Tensor& half, const at::Tensor& fp32, const char* what) {
  TORCH_CHECK(half.device().is_cpu() && fp32.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(half.scalar_type() == at::kHalf || half.scalar_type() == at::kBFloat16, what,
              ": expected a float16 or bfloat16 tensor, got ", half.scalar_type());
  TORCH_CHECK(fp32.scalar_type() == at::kFloat, what, ": expected a float32 tensor, got ", fp32.scalar_type());
  TORCH_CHECK(half.is_contiguous() && fp32.is_contiguous(), what, ": tensors must be contiguous");
  TORCH_CHECK(half.numel() == fp32.numel(), what, ": sizes differ (", half.numel(), " vs ", fp32.numel(), ")");
}

void check_scalar(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.numel() == 1 && t.device().is_cpu(), what,
              " must be a one-element float32 CPU tensor");
}

template <typename Half>
void unscale_one(const at::Tensor& half, const at::Tensor& out, float inv_scale, bool stream,
                 std::atomic<uint32_t>& found) {
  const Half* in = reinterpret_cast<const Half*>(half.const_data_ptr());
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, half.numel(), kGrain, [&](int64_t begin, int64_t end) {
    const float s = inv_scale;  // a local: no store can alias it
    alignas(64) float block[kBlock];
    uint32_t bad = 0;
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t n = std::min(kBlock, end - b);
      to_float_block(in + b, block, n);
      for (int64_t i = 0; i < n; ++i) {  // the value is checked before it is scaled, as torch's unscale does
        bad |= nonfinite(block[i]);
        block[i] = block[i] * s;
      }
      store_floats(block, dst + b, n, stream);
    }
    if (stream) {
      fence_streams();
    }
    if (bad) {
      found.store(1, std::memory_order_relaxed);
    }
  });
}

// out[i] = float(half_grads[i]) * inv_scale; found_inf = 1 if any half value is inf/NaN.
void unscale_into_(at::TensorList half_grads, at::TensorList out, const at::Tensor& found_inf,
                   const at::Tensor& inv_scale) {
  TORCH_CHECK(half_grads.size() == out.size(), "unscale_into_: list lengths differ");
  check_scalar(found_inf, "unscale_into_: found_inf");
  check_scalar(inv_scale, "unscale_into_: inv_scale");
  const float s = inv_scale.item<float>();
  int64_t out_bytes = 0;
  for (size_t t = 0; t < half_grads.size(); ++t) {
    check_pair(half_grads[t], out[t], "unscale_into_");
    out_bytes += out[t].numel() * static_cast<int64_t>(sizeof(float));
  }
  const bool stream = out_bytes >= kStreamBytes;
  std::atomic<uint32_t> found{0};
  for (size_t t = 0; t < half_grads.size(); ++t) {
    if (half_grads[t].scalar_type() == at::kHalf) {
      unscale_one<_Float16>(half_grads[t], out[t], s, stream, found);
    } else {
      unscale_one<BF16Bits>(half_grads[t], out[t], s, stream, found);
    }
  }
  if (found.load()) {
    found_inf.fill_(1.0);
  }
}

// New contiguous FP32 tensors float(half_grads[i]) * inv_scale (the FP32 master gradients
// a step materializes), in one op whatever their number; found_inf as unscale_into_.
std::vector<at::Tensor> unscale_copy(at::TensorList half_grads, const at::Tensor& found_inf,
                                     const at::Tensor& inv_scale) {
  std::vector<at::Tensor> out;
  out.reserve(half_grads.size());
  for (const at::Tensor& g : half_grads) {
    out.push_back(at::empty(g.sizes(), g.options().dtype(at::kFloat)));
  }
  unscale_into_(half_grads, out, found_inf, inv_scale);
  return out;
}

// ---------------------------------------------------------------------------------------
// The inf/NaN check of the step decision: a read-only pass over the half-precision
// gradients (2 bytes per element), 16 at a time with integer compares on the exponent bits.

template <typename Half>
constexpr uint16_t exponent_mask() {
  return std::is_same_v<Half, _Float16> ? 0x7c00 : 0x7f80;
}

template <typename Half>
bool any_nonfinite(const uint16_t* x, int64_t n) {
  constexpr uint16_t mask = exponent_mask<Half>();
  int64_t i = 0;
#if defined(AMP_PLUGIN_SIMD)
  {
    // Four streams at once, a quarter of the range each: one sequential stream per core does
    // not keep enough reads in flight to run at the memory's bandwidth.
    const __m256i m = _mm256_set1_epi16(static_cast<short>(mask));
    __m256i bad = _mm256_setzero_si256();
    const int64_t quarter = (n / 64) * 16;
    const uint16_t* x1 = x + quarter;
    const uint16_t* x2 = x + 2 * quarter;
    const uint16_t* x3 = x + 3 * quarter;
    auto check = [&](const uint16_t* p) {
      const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), m);
      bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(v, m));
    };
    for (int64_t j = 0; j < quarter; j += 16) {
      check(x + j);
      check(x1 + j);
      check(x2 + j);
      check(x3 + j);
    }
    for (i = 4 * quarter; i + 16 <= n; i += 16) {
      check(x + i);
    }
    if (!_mm256_testz_si256(bad, bad)) {
      return true;
    }
  }
#endif
  uint32_t bad = 0;
  for (; i < n; ++i) {
    bad |= (x[i] & mask) == mask;
  }
  return bad != 0;
}

// A piece of one tensor's elements, [begin, end): the kernels split all their tensors into
// such spans and run them in one parallel region, so small tensors cost no region of their
// own and the threads share the work of every tensor evenly.
struct Span {
  size_t tensor;
  int64_t begin;
  int64_t end;
};

std::vector<Span> spans_of(const std::vector<int64_t>& numels, int64_t chunk) {
  std::vector<Span> spans;
  for (size_t t = 0; t < numels.size(); ++t) {
    for (int64_t b = 0; b < numels[t]; b += chunk) {
      spans.push_back({t, b, std::min(numels[t], b + chunk)});
    }
  }
  return spans;
}

// Run fn(span) for every span: in one parallel region, or on this thread when there is
// little work (below kGrain elements: waking the other threads would cost more).
template <typename Fn>
void for_spans(const std::vector<Span>& spans, int64_t total, Fn fn) {
  if (total < kGrain) {
    for (const Span& span : spans) {
      fn(span);
    }
    fence_streams();
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(spans.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      fn(spans[s]);
    }
    fence_streams();  // a task that streamed fences before it ends (cheap when it did not)
  });
}

// found_inf = 1 if any element of any tensor is inf/NaN (never cleared). Reads only.
void nonfinite_check_(at::TensorList grads, const at::Tensor& found_inf) {
  check_scalar(found_inf, "nonfinite_check_: found_inf");
  std::vector<int64_t> numels;
  int64_t total = 0;
  for (const at::Tensor& g : grads) {
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous() &&
                    (g.scalar_type() == at::kHalf || g.scalar_type() == at::kBFloat16),
                "nonfinite_check_: expected contiguous float16/bfloat16 CPU tensors, got ", g.scalar_type());
    numels.push_back(g.numel());
    total += g.numel();
  }
  std::atomic<uint32_t> found{0};
  for_spans(spans_of(numels, 4 * kGrain), total, [&](const Span& span) {
    const at::Tensor& g = grads[span.tensor];
    const uint16_t* x = reinterpret_cast<const uint16_t*>(g.const_data_ptr()) + span.begin;
    const int64_t n = span.end - span.begin;
    if (g.scalar_type() == at::kHalf ? any_nonfinite<_Float16>(x, n) : any_nonfinite<BF16Bits>(x, n)) {
      found.store(1, std::memory_order_relaxed);
    }
  });
  if (found.load()) {
    found_inf.fill_(1.0);
  }
}

// ---------------------------------------------------------------------------------------
// Adam/AdamW on FP32 masters, torch.optim's fused CPU update bit for bit.
//
// One loop body, written once over a vector type V (8 floats with AVX2, 16 with AVX-512, 1
// in plain C++) with its loads and stores of the gradient and the master supplied by small
// policy classes: the gradient is read as FP32 or as the model's FP16/BF16 gradient times
// the unscale factor (the product an unscale pass would have stored), and the master is an
// FP32 tensor, optionally rounded into the model's FP16/BF16 weight in the same pass, or is
// the BF16 weight and a 16-bit extension that together are its bits. Every element is
// independent, so the vector width changes no result; only torch's scalar tail (below)
// rounds differently.

struct AdamConstants {
  float lerp_coefficient;  // 1 - beta1, or -beta1 when the lerp runs from the other end
  bool lerp_from_avg;      // |1 - beta1| < 0.5: exp_avg + w * (grad - exp_avg), else grad + (w - 1) * (...)
  float beta2;
  float sq_coefficient;  // 1 - beta2
  float decay;           // AdamW: 1 - lr * weight_decay; 1 without decoupled decay (exact: p * 1 == p)
  float weight_decay;    // Adam: L2 term added to the gradient
  float bias_correction2_sqrt;
  float eps;
  float step_size;  // lr / bias_correction1
  float sign;       // -1 with maximize
};

// The scalar update. kTail: the roundings of torch's scalar tail loop, which fuses the other
// product of the exp_avg_sq update: exp_avg_sq * beta2 + ((1 - beta2) * grad) * grad.
template <bool kL2, bool kTail>
inline void adam_scalar(float& p, float g, float& m, float& v, const AdamConstants& c) {
  g = g * c.sign;
  if constexpr (kL2) {
    g = std::fma(p, c.weight_decay, g);
  } else {
    p = p * c.decay;
  }
  // exp_avg.lerp_(grad, 1 - beta1) as one fused multiply-add from the nearer end
  const float diff = g - m;
  const float mi = std::fma(c.lerp_coefficient, diff, c.lerp_from_avg ? m : g);
  const float vi = kTail ? std::fma(v, c.beta2, (c.sq_coefficient * g) * g)
                         : std::fma(c.sq_coefficient * g, g, v * c.beta2);
  const float denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
  p = p - (c.step_size * mi) / denom;
  m = mi;
  v = vi;
}

// Vector types: V1 (plain C++), V8 (AVX2 + FMA + F16C), V16 (AVX-512). Each has float
// arithmetic, FP16/BF16 conversions that round like c10's (nearest even, NaN kept) into H
// (its 16-bit lanes), stores of one or two H (two: one wider store, whole 32 or 64 bytes when
// non-temporal), and the split-master loads and stores.
struct V1 {
  using F = float;
  using H = uint16_t;
  static constexpr int64_t kWidth = 1;
  AMP_INLINE static F set1(float x) { return x; }
  AMP_INLINE static F load(const float* p) { return *p; }
  AMP_INLINE static void store(float* p, F x) { *p = x; }
  AMP_INLINE static F add(F a, F b) { return a + b; }
  AMP_INLINE static F sub(F a, F b) { return a - b; }
  AMP_INLINE static F mul(F a, F b) { return a * b; }
  AMP_INLINE static F div(F a, F b) { return a / b; }
  AMP_INLINE static F sqrt(F a) { return std::sqrt(a); }
  AMP_INLINE static F fma(F a, F b, F c) { return std::fma(a, b, c); }
  AMP_INLINE static F load_f16(const _Float16* p) { return static_cast<float>(*p); }
  AMP_INLINE static F load_bf16(const uint16_t* p) { return bf16_to_float(*p); }
  AMP_INLINE static H to_f16(F x) {
    const _Float16 h = static_cast<_Float16>(x);
    H bits;
    std::memcpy(&bits, &h, sizeof bits);
    return bits;
  }
  AMP_INLINE static H to_bf16(F x) { return float_to_bf16(x); }
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
  AMP_INLINE static H to_bf16_sr(F x, uint32_t key, int64_t i) { return bf16_stochastic(x, sr_bits(key, i)); }
};

#if defined(AMP_PLUGIN_SIMD)
struct V8 {
  using F = __m256;
  using H = __m128i;
  static constexpr int64_t kWidth = 8;
  AMP_INLINE static F set1(float x) { return _mm256_set1_ps(x); }
  AMP_INLINE static F load(const float* p) { return _mm256_loadu_ps(p); }
  AMP_INLINE static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
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
  AMP_INLINE static H to_bf16(F x) {  // float_to_bf16, eight at a time
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
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
  AMP_INLINE static void store_rem(uint16_t* hi, uint16_t* lo, F x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i mask = _mm256_set1_epi32(0xffff);
    const __m256i low = _mm256_and_si256(u, mask);
    const __m256i h = _mm256_and_si256(_mm256_add_epi32(_mm256_srli_epi32(u, 16), _mm256_srli_epi32(low, 15)), mask);
    store_h(hi, narrow(h), false);
    store_h(lo, narrow(low), false);
  }
  AMP_INLINE static __m256i mix(__m256i h) {  // fmix32, eight at a time
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kMix1)));
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_mullo_epi32(h, _mm256_set1_epi32(static_cast<int>(kMix2)));
    return _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
  }
  AMP_INLINE static H to_bf16_sr(F x, uint32_t key, int64_t i) {  // bf16_stochastic with sr_bits, eight at a time
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(i))),
                                           _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i hashed = _mm256_add_epi32(_mm256_mullo_epi32(index, _mm256_set1_epi32(static_cast<int>(kIndexMultiplier))),
                                            _mm256_set1_epi32(static_cast<int>(key)));
    const __m256i r = _mm256_srli_epi32(mix(hashed), 16);
    __m256i out = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(x), r), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    out = _mm256_blendv_epi8(out, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    return narrow(out);
  }
};
#endif

#if defined(AMP_PLUGIN_AVX512)
struct V16 {
  using F = __m512;
  using H = __m256i;
  static constexpr int64_t kWidth = 16;
  AMP_INLINE static F set1(float x) { return _mm512_set1_ps(x); }
  AMP_INLINE static F load(const float* p) { return _mm512_loadu_ps(p); }
  AMP_INLINE static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
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
  AMP_INLINE static H to_bf16(F x) {  // float_to_bf16, sixteen at a time
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
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
  AMP_INLINE static void store_rem(uint16_t* hi, uint16_t* lo, F x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i mask = _mm512_set1_epi32(0xffff);
    const __m512i low = _mm512_and_si512(u, mask);
    const __m512i h = _mm512_and_si512(_mm512_add_epi32(_mm512_srli_epi32(u, 16), _mm512_srli_epi32(low, 15)), mask);
    store_h(hi, _mm512_cvtepi32_epi16(h), false);
    store_h(lo, _mm512_cvtepi32_epi16(low), false);
  }
  AMP_INLINE static __m512i mix(__m512i h) {  // fmix32, sixteen at a time
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kMix1)));
    h = _mm512_xor_si512(h, _mm512_srli_epi32(h, 13));
    h = _mm512_mullo_epi32(h, _mm512_set1_epi32(static_cast<int>(kMix2)));
    return _mm512_xor_si512(h, _mm512_srli_epi32(h, 16));
  }
  AMP_INLINE static H to_bf16_sr(F x, uint32_t key, int64_t i) {  // bf16_stochastic with sr_bits, sixteen at a time
    const __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(i))),
                                           _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
    const __m512i hashed = _mm512_add_epi32(_mm512_mullo_epi32(index, _mm512_set1_epi32(static_cast<int>(kIndexMultiplier))),
                                            _mm512_set1_epi32(static_cast<int>(key)));
    const __m512i r = _mm512_srli_epi32(mix(hashed), 16);
    __m512i out = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(x), r), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    out = _mm512_mask_blend_epi32(nan, out, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(out);
  }
};
#endif

// Gradient sources: FP32 as stored, or FP16/BF16 times the unscale factor.
struct GradF32 {
  const float* g;
  template <class V>
  AMP_INLINE typename V::F load(int64_t i) const { return V::load(g + i); }
};
template <typename Half>
struct GradHalf {
  const Half* g;
  float inv_scale;
  template <class V>
  AMP_INLINE typename V::F load(int64_t i) const {
    if constexpr (std::is_same_v<Half, _Float16>) {
      return V::mul(V::load_f16(g + i), V::set1(inv_scale));
    } else {
      return V::mul(V::load_bf16(g + i), V::set1(inv_scale));
    }
  }
};

// Master stores: an FP32 tensor, optionally rounded into the model's weight (Half = void:
// none; kStream: non-temporal stores, which need the model tensor 64-byte aligned); or the
// BF16 weight (high half) and its extension (low half). store2 stores two vectors at i.
template <typename Half, bool kStream = false>
struct MasterF32 {
  float* p;
  Half* model;
  template <class V>
  AMP_INLINE typename V::F load(int64_t i) const { return V::load(p + i); }
  template <class V>
  AMP_INLINE static typename V::H to_half(typename V::F x) {
    if constexpr (std::is_same_v<Half, _Float16>) {
      return V::to_f16(x);
    } else {
      return V::to_bf16(x);
    }
  }
  template <class V>
  AMP_INLINE void store(int64_t i, typename V::F x) const {
    V::store(p + i, x);
    if constexpr (!std::is_void_v<Half>) {
      V::store_h(model + i, to_half<V>(x), kStream);
    }
  }
  template <class V>
  AMP_INLINE void store2(int64_t i, typename V::F x, typename V::F y) const {
    V::store(p + i, x);
    V::store(p + i + V::kWidth, y);
    if constexpr (!std::is_void_v<Half>) {
      V::store_h2(model + i, to_half<V>(x), to_half<V>(y), kStream);
    }
  }
};
struct MasterRemainder {  // the BF16 weight (the master rounded) and the signed remainder
  uint16_t* hi;
  uint16_t* lo;
  template <class V>
  AMP_INLINE typename V::F load(int64_t i) const { return V::load_rem(hi + i, lo + i); }
  template <class V>
  AMP_INLINE void store(int64_t i, typename V::F x) const { V::store_rem(hi + i, lo + i, x); }
  template <class V>
  AMP_INLINE void store2(int64_t i, typename V::F x, typename V::F y) const {
    V::store_rem(hi + i, lo + i, x);
    V::store_rem(hi + i + V::kWidth, lo + i + V::kWidth, y);
  }
};
struct MasterStochastic {  // no master: the BF16 weight, written back with stochastic rounding
  uint16_t* w;
  uint32_t key;
  template <class V>
  AMP_INLINE typename V::F load(int64_t i) const { return V::load_bf16(w + i); }
  template <class V>
  AMP_INLINE void store(int64_t i, typename V::F x) const { V::store_h(w + i, V::to_bf16_sr(x, key, i), false); }
  template <class V>
  AMP_INLINE void store2(int64_t i, typename V::F x, typename V::F y) const {
    V::store_h2(w + i, V::to_bf16_sr(x, key, i), V::to_bf16_sr(y, key, i + V::kWidth), false);
  }
};

// Moment stores: FP32, or BF16 (read into FP32, rounded once when stored: to nearest, or
// stochastically).
struct MomentsF32 {
  float* m;
  float* v;
  template <class V>
  AMP_INLINE typename V::F load_m(int64_t i) const { return V::load(m + i); }
  template <class V>
  AMP_INLINE typename V::F load_v(int64_t i) const { return V::load(v + i); }
  template <class V>
  AMP_INLINE void store(int64_t i, typename V::F mi, typename V::F vi) const {
    V::store(m + i, mi);
    V::store(v + i, vi);
  }
};
// kStochastic: stochastic rounding with the moments' own keys (a moment rounded to nearest cannot
// shrink by less than half its ulp: beta * v rounds back to v for any beta above 1 - 2**-9).
template <bool kStochastic>
struct MomentsBF16 {
  uint16_t* m;
  uint16_t* v;
  uint32_t key_m;
  uint32_t key_v;
  template <class V>
  AMP_INLINE typename V::F load_m(int64_t i) const { return V::load_bf16(m + i); }
  template <class V>
  AMP_INLINE typename V::F load_v(int64_t i) const { return V::load_bf16(v + i); }
  template <class V>
  AMP_INLINE void store(int64_t i, typename V::F mi, typename V::F vi) const {
    if constexpr (kStochastic) {
      V::store_h(m + i, V::to_bf16_sr(mi, key_m, i), false);
      V::store_h(v + i, V::to_bf16_sr(vi, key_v, i), false);
    } else {
      V::store_h(m + i, V::to_bf16(mi), false);
      V::store_h(v + i, V::to_bf16(vi), false);
    }
  }
};

// The keys of a tensor's exp_avg and exp_avg_sq roundings from its key (_stochastic.moment_keys).
constexpr uint32_t kMomentSaltM = 0x6a09e667u;
constexpr uint32_t kMomentSaltV = 0xbb67ae85u;

// The vectorised update over [i, limit), two vectors at a time (the model's 16-bit weights of
// both go out in one store), then one; returns where it stopped. The policies come by value:
// their pointers then live in registers, where no store can alias them.
template <class V, bool kL2, class Grad, class Master, class Moments>
int64_t adam_vectors(int64_t i, int64_t limit, const Grad grad, const Master master, const Moments mom,
                     const AdamConstants& c) {
  using F = typename V::F;
  const F sign = V::set1(c.sign), decay = V::set1(c.decay), weight_decay = V::set1(c.weight_decay);
  const F lerp = V::set1(c.lerp_coefficient), beta2 = V::set1(c.beta2), sq = V::set1(c.sq_coefficient);
  const F bc2 = V::set1(c.bias_correction2_sqrt), eps = V::set1(c.eps), step_size = V::set1(c.step_size);
  const bool from_avg = c.lerp_from_avg;
  auto update = [&](int64_t j) AMP_LAMBDA_INLINE {  // updates the moments at j, returns the new master
    F g = V::mul(grad.template load<V>(j), sign);
    F p = master.template load<V>(j);
    if constexpr (kL2) {
      g = V::fma(p, weight_decay, g);
    } else {
      p = V::mul(p, decay);
    }
    const F mo = mom.template load_m<V>(j);
    const F mi = V::fma(lerp, V::sub(g, mo), from_avg ? mo : g);
    const F vi = V::fma(V::mul(sq, g), g, V::mul(mom.template load_v<V>(j), beta2));
    const F denom = V::add(V::div(V::sqrt(vi), bc2), eps);
    mom.template store<V>(j, mi, vi);
    return V::sub(p, V::div(V::mul(step_size, mi), denom));
  };
  for (; i + 2 * V::kWidth <= limit; i += 2 * V::kWidth) {
    const F p0 = update(i);
    const F p1 = update(i + V::kWidth);
    master.template store2<V>(i, p0, p1);
  }
  for (; i + V::kWidth <= limit; i += V::kWidth) {
    master.template store<V>(i, update(i));
  }
  return i;
}

template <bool kL2, bool kTail, class Grad, class Master, class Moments>
void adam_scalars(int64_t i, int64_t limit, const Grad grad, const Master master, const Moments mom,
                  const AdamConstants& c) {
  for (; i < limit; ++i) {
    float p = master.template load<V1>(i);
    float m = mom.template load_m<V1>(i);
    float v = mom.template load_v<V1>(i);
    adam_scalar<kL2, kTail>(p, grad.template load<V1>(i), m, v, c);
    mom.template store<V1>(i, m, v);
    master.template store<V1>(i, p);
  }
}

// torch's fused Adam (CPU) updates whole Vectorized<float> vectors of 8 and finishes each tensor
// with a scalar loop over the last numel % 8 elements; its work is split into 16-float units, so
// that tail sits at the end of the tensor whatever the thread count. (torch builds this kernel for
// AVX2 and the default capability only: an AVX512 CPU runs the AVX2 kernel, 8 wide too.)
constexpr int64_t kTorchVectorWidth = 8;
// Parallel tasks start at multiples of this many elements: whole vectors, whole cache lines of
// the FP32 arrays, and 16-byte-aligned stores into an aligned model tensor.
constexpr int64_t kUnit = 64;

// One span of a tensor: the widest vectors first, then narrower ones, then single elements
// with the vector roundings, and torch's tail roundings on the tensor's last numel % 8.
template <bool kL2, class Grad, class Master, class Moments>
void adam_span(int64_t begin, int64_t end, int64_t numel, const Grad& grad, const Master& master, const Moments& mom,
               const AdamConstants& c) {
  const int64_t vector_end = numel - numel % kTorchVectorWidth;
  const int64_t limit = std::min(end, vector_end);
  int64_t i = begin;
#if defined(AMP_PLUGIN_AVX512)
  i = adam_vectors<V16, kL2>(i, limit, grad, master, mom, c);
#endif
#if defined(AMP_PLUGIN_SIMD)
  i = adam_vectors<V8, kL2>(i, limit, grad, master, mom, c);
#endif
  adam_scalars<kL2, false>(i, limit, grad, master, mom, c);
  adam_scalars<kL2, true>(std::max(begin, limit), end, grad, master, mom, c);
}

// One tensor's update: what it reads and writes, and its constants.
struct AdamJob {
  int64_t numel;
  const void* grad;
  at::ScalarType grad_dtype;  // kFloat: used as it is; kHalf/kBFloat16: times inv_scale
  float inv_scale;
  float* p;  // the FP32 master, or nullptr for a BF16 weight (hi) with a remainder (lo) or none
  void* model;
  at::ScalarType model_dtype;  // kHalf/kBFloat16: write the rounded master there; kFloat: no model
  bool stream;                 // non-temporal stores into the model
  uint16_t* hi;
  uint16_t* lo;  // p == nullptr: the remainder, or nullptr for stochastic rounding with `key`
  uint32_t key;
  void* m;
  void* v;
  bool bf16_moments;
  bool sr_moments;  // BF16 moments rounded stochastically, keyed by moment_key
  uint32_t moment_key;
  AdamConstants c;
  bool l2;
};

template <bool kL2, class Master, class Moments>
void adam_job_grad(const AdamJob& job, int64_t begin, int64_t end, const Master& master, const Moments& mom) {
  switch (job.grad_dtype) {
    case at::kFloat:
      adam_span<kL2>(begin, end, job.numel, GradF32{static_cast<const float*>(job.grad)}, master, mom, job.c);
      break;
    case at::kHalf:
      adam_span<kL2>(begin, end, job.numel, GradHalf<_Float16>{static_cast<const _Float16*>(job.grad), job.inv_scale},
                     master, mom, job.c);
      break;
    default:
      adam_span<kL2>(begin, end, job.numel, GradHalf<BF16Bits>{static_cast<const BF16Bits*>(job.grad), job.inv_scale},
                     master, mom, job.c);
      break;
  }
}

template <bool kL2, class Moments>
void adam_job_master(const AdamJob& job, int64_t begin, int64_t end, const Moments& mom) {
  if (job.p == nullptr) {
    job.lo != nullptr ? adam_job_grad<kL2>(job, begin, end, MasterRemainder{job.hi, job.lo}, mom)
                      : adam_job_grad<kL2>(job, begin, end, MasterStochastic{job.hi, job.key}, mom);
  } else if (job.model_dtype == at::kHalf) {
    auto* model = static_cast<_Float16*>(job.model);
    job.stream ? adam_job_grad<kL2>(job, begin, end, MasterF32<_Float16, true>{job.p, model}, mom)
               : adam_job_grad<kL2>(job, begin, end, MasterF32<_Float16>{job.p, model}, mom);
  } else if (job.model_dtype == at::kBFloat16) {
    auto* model = static_cast<BF16Bits*>(job.model);
    job.stream ? adam_job_grad<kL2>(job, begin, end, MasterF32<BF16Bits, true>{job.p, model}, mom)
               : adam_job_grad<kL2>(job, begin, end, MasterF32<BF16Bits>{job.p, model}, mom);
  } else {
    adam_job_grad<kL2>(job, begin, end, MasterF32<void>{job.p, nullptr}, mom);
  }
}

template <bool kL2>
void adam_job(const AdamJob& job, int64_t begin, int64_t end) {
  auto* m = static_cast<uint16_t*>(job.m);
  auto* v = static_cast<uint16_t*>(job.v);
  if (job.bf16_moments && job.sr_moments) {
    const uint32_t key_m = fmix32(job.moment_key ^ kMomentSaltM), key_v = fmix32(job.moment_key ^ kMomentSaltV);
    adam_job_master<kL2>(job, begin, end, MomentsBF16<true>{m, v, key_m, key_v});
  } else if (job.bf16_moments) {
    adam_job_master<kL2>(job, begin, end, MomentsBF16<false>{m, v, 0, 0});
  } else {
    adam_job_master<kL2>(job, begin, end, MomentsF32{static_cast<float*>(job.m), static_cast<float*>(job.v)});
  }
}

// Every job, in spans of kAdamChunk elements (whole kUnits) run in one parallel region.
constexpr int64_t kAdamChunk = 1 << 16;

void run_adam_jobs(const std::vector<AdamJob>& jobs) {
  std::vector<int64_t> numels;
  int64_t total = 0;
  for (const AdamJob& job : jobs) {
    numels.push_back(job.numel);
    total += job.numel;
  }
  for_spans(spans_of(numels, kAdamChunk), total, [&](const Span& span) {
    const AdamJob& job = jobs[span.tensor];
    if (job.l2) {
      adam_job<true>(job, span.begin, span.end);
    } else {
      adam_job<false>(job, span.begin, span.end);
    }
  });
}

AdamConstants adam_constants(const at::Tensor& state_step, double lr, double beta1, double beta2, double weight_decay,
                             double eps, bool adamw, bool maximize) {
  // state_step += 1, as torch's _foreach_add_ does it, without an op call per tensor
  double step;
  if (state_step.scalar_type() == at::kFloat) {
    float* s = state_step.data_ptr<float>();
    *s = *s + 1.0f;
    step = *s;
  } else if (state_step.scalar_type() == at::kDouble) {
    double* s = state_step.data_ptr<double>();
    *s = *s + 1.0;
    step = *s;
  } else {
    state_step.add_(1);
    step = state_step.item<double>();
  }
  const double bias_correction1 = 1 - std::pow(beta1, step);
  const double bias_correction2 = 1 - std::pow(beta2, step);
  AdamConstants c{};
  const float lerp_weight = static_cast<float>(1 - beta1);
  c.lerp_from_avg = std::abs(lerp_weight) < 0.5f;
  c.lerp_coefficient = c.lerp_from_avg ? lerp_weight : lerp_weight - 1.0f;
  c.beta2 = static_cast<float>(beta2);
  c.sq_coefficient = static_cast<float>(1 - beta2);
  c.decay = (adamw && weight_decay != 0) ? static_cast<float>(1 - lr * weight_decay) : 1.0f;
  c.weight_decay = static_cast<float>(weight_decay);
  c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  c.eps = static_cast<float>(eps);
  c.step_size = static_cast<float>(lr / bias_correction1);
  c.sign = maximize ? -1.0f : 1.0f;
  return c;
}

void check_grad(const at::Tensor& grad, int64_t numel, const char* what) {
  TORCH_CHECK(grad.device().is_cpu() && grad.is_contiguous() && grad.numel() == numel &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kHalf ||
                   grad.scalar_type() == at::kBFloat16),
              what, ": grads must be contiguous float32, float16 or bfloat16 CPU tensors shaped like the masters");
}

void check_moments(const at::Tensor& p, const at::Tensor& m, const at::Tensor& v, const at::Tensor& step,
                   const char* what) {
  for (const at::Tensor* t : {&m, &v}) {
    TORCH_CHECK(t->device().is_cpu() && (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16) &&
                    t->scalar_type() == m.scalar_type() && t->is_contiguous() && t->numel() == p.numel(),
                what, ": moments must be contiguous CPU tensors shaped like the masters, both float32 or both bfloat16");
  }
  TORCH_CHECK(step.device().is_cpu() && step.numel() == 1, what, ": step must be a one-element CPU tensor");
}

// One Adam/AdamW step over FP32 masters; writes each updated master, rounded, into the
// matching model tensor (None for parameters that are their own FP32 master). A gradient is
// FP32 (used as it is) or the model's FP16/BF16 gradient, multiplied by grad_inv_scale as it
// is read. Each state step tensor is incremented first, as torch.optim's fused Adam does.
void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList state_steps, const c10::List<std::optional<at::Tensor>>& model_params, double lr,
                double beta1, double beta2, double weight_decay, double eps, bool adamw, bool maximize,
                double grad_inv_scale, at::IntArrayRef moment_keys) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && state_steps.size() == n &&
                  model_params.size() == n && (moment_keys.empty() || moment_keys.size() == n),
              "adam_step_: list lengths differ");
  int64_t model_bytes = 0;
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous(),
                "adam_step_: masters must be contiguous float32 CPU tensors");
    check_grad(grads[t], p.numel(), "adam_step_");
    check_moments(p, exp_avgs[t], exp_avg_sqs[t], state_steps[t], "adam_step_");
    const std::optional<at::Tensor> model = model_params.get(t);
    if (model.has_value() && model->defined()) {
      check_pair(*model, p, "adam_step_");
      model_bytes += model->numel() * static_cast<int64_t>(model->element_size());
    }
  }
  const bool stream_big = model_bytes >= kStreamBytes;
  std::vector<AdamJob> jobs;
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    const std::optional<at::Tensor> model = model_params.get(t);
    const bool has_model = model.has_value() && model->defined();
    AdamJob job{};
    job.numel = p.numel();
    job.grad = grads[t].const_data_ptr();
    job.grad_dtype = grads[t].scalar_type();
    job.inv_scale = static_cast<float>(grad_inv_scale);
    job.p = p.data_ptr<float>();
    job.model = has_model ? model->data_ptr() : nullptr;
    job.model_dtype = has_model ? model->scalar_type() : at::kFloat;
    // Non-temporal stores need aligned addresses: every span starts kUnit elements apart.
    job.stream = stream_big && has_model && reinterpret_cast<uintptr_t>(job.model) % 64 == 0;
    job.m = exp_avgs[t].data_ptr();
    job.v = exp_avg_sqs[t].data_ptr();
    job.bf16_moments = exp_avgs[t].scalar_type() == at::kBFloat16;
    job.sr_moments = !moment_keys.empty();
    job.moment_key = job.sr_moments ? static_cast<uint32_t>(moment_keys[t]) : 0;
    job.c = adam_constants(state_steps[t], lr, beta1, beta2, weight_decay, eps, adamw, maximize);
    job.l2 = !adamw && weight_decay != 0;
    jobs.push_back(job);
  }
  run_adam_jobs(jobs);
}

// The same step for a BF16 model without FP32 master tensors. Per tensor: with a remainder
// (int16, shaped like the weight), the weight and the remainder together are the FP32 master
// (weight = master rounded to nearest, ties away from zero); without one (None), the weight is
// read as the FP32 value and the update written back with stochastic rounding, its random bits
// hashed from sr_keys[t] and the element's index.
void adam_step_bf16_(at::TensorList weights, const c10::List<std::optional<at::Tensor>>& remainders,
                     at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                     at::TensorList state_steps, at::IntArrayRef sr_keys, double lr, double beta1, double beta2,
                     double weight_decay, double eps, bool adamw, bool maximize, double grad_inv_scale,
                     at::IntArrayRef moment_keys) {
  const size_t n = weights.size();
  TORCH_CHECK(remainders.size() == n && grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n &&
                  state_steps.size() == n && sr_keys.size() == n && (moment_keys.empty() || moment_keys.size() == n),
              "adam_step_bf16_: list lengths differ");
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& w = weights[t];
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
                "adam_step_bf16_: weights must be contiguous bfloat16 CPU tensors");
    const std::optional<at::Tensor> rem = remainders.get(t);
    if (rem.has_value() && rem->defined()) {
      TORCH_CHECK(rem->device().is_cpu() && rem->scalar_type() == at::kShort && rem->is_contiguous() &&
                      rem->numel() == w.numel(),
                  "adam_step_bf16_: remainders must be contiguous int16 CPU tensors shaped like the weights");
    }
    check_grad(grads[t], w.numel(), "adam_step_bf16_");
    check_moments(w, exp_avgs[t], exp_avg_sqs[t], state_steps[t], "adam_step_bf16_");
  }
  std::vector<AdamJob> jobs;
  for (size_t t = 0; t < n; ++t) {
    const std::optional<at::Tensor> rem = remainders.get(t);
    AdamJob job{};
    job.numel = weights[t].numel();
    job.grad = grads[t].const_data_ptr();
    job.grad_dtype = grads[t].scalar_type();
    job.inv_scale = static_cast<float>(grad_inv_scale);
    job.hi = static_cast<uint16_t*>(weights[t].data_ptr());
    job.lo = rem.has_value() && rem->defined() ? static_cast<uint16_t*>(rem->data_ptr()) : nullptr;
    job.key = static_cast<uint32_t>(sr_keys[t]);
    job.model_dtype = at::kFloat;
    job.m = exp_avgs[t].data_ptr();
    job.v = exp_avg_sqs[t].data_ptr();
    job.bf16_moments = exp_avgs[t].scalar_type() == at::kBFloat16;
    job.sr_moments = !moment_keys.empty();
    job.moment_key = job.sr_moments ? static_cast<uint32_t>(moment_keys[t]) : 0;
    job.c = adam_constants(state_steps[t], lr, beta1, beta2, weight_decay, eps, adamw, maximize);
    job.l2 = !adamw && weight_decay != 0;
    jobs.push_back(job);
  }
  run_adam_jobs(jobs);
}

}  // namespace

TORCH_LIBRARY(amp_plugin, m) {
  m.def("unscale_into_(Tensor[] half_grads, Tensor(a!)[] out, Tensor(b!) found_inf, Tensor inv_scale) -> ()");
  m.def("nonfinite_check_(Tensor[] grads, Tensor(a!) found_inf) -> ()");
  m.def("unscale_copy(Tensor[] half_grads, Tensor(a!) found_inf, Tensor inv_scale) -> Tensor[]");
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] state_steps, Tensor(e!)?[] model_params, float lr, float beta1, float beta2, "
      "float weight_decay, float eps, bool adamw, bool maximize, float grad_inv_scale=1.0, "
      "int[] moment_keys=[]) -> ()");
  m.def(
      "adam_step_bf16_(Tensor(a!)[] weights, Tensor(b!)?[] remainders, Tensor[] grads, Tensor(c!)[] exp_avgs, "
      "Tensor(d!)[] exp_avg_sqs, Tensor(e!)[] state_steps, int[] sr_keys, float lr, float beta1, float beta2, "
      "float weight_decay, float eps, bool adamw, bool maximize, float grad_inv_scale=1.0, "
      "int[] moment_keys=[]) -> ()");
}

TORCH_LIBRARY_IMPL(amp_plugin, CPU, m) {
  m.impl("unscale_into_", &unscale_into_);
  m.impl("nonfinite_check_", &nonfinite_check_);
  m.impl("unscale_copy", &unscale_copy);
  m.impl("adam_step_", &adam_step_);
  m.impl("adam_step_bf16_", &adam_step_bf16_);
}
