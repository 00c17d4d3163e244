// Fused CPU kernels for FP32 master weights over an FP16/BF16 model.
//
// unscale_into_: one pass per tensor that reads the half-precision gradient, writes the
//   unscaled FP32 master gradient and flags any inf/NaN (stock torch needs a copy pass and an
//   unscale pass over the FP32 copy).
// adam_step_: Adam/AdamW on the FP32 masters (torch.optim's fused Adam update, in float with
//   double-precision step constants) that also writes each updated weight, rounded to the
//   model's dtype, in the same pass (stock torch needs a separate copy-back pass).
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

namespace {

constexpr int64_t kGrain = 1 << 15;        // elements per parallel task, at least
constexpr int64_t kBlock = 1024;           // elements converted per block, in L1
// An op whose big output (all tensors together) is this large stores it past the cache: it
// would not stay there anyway, and a cached store first reads each line from memory.
constexpr int64_t kStreamBytes = 8 << 20;

using BF16Bits = uint16_t;

inline float bf16_to_float(BF16Bits b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as c10::BFloat16 does; NaN stays NaN.
inline BF16Bits float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return 0x7fc0;
  }
  return static_cast<BF16Bits>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline uint32_t nonfinite(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return (u & 0x7f800000u) == 0x7f800000u;
}

template <typename Half>
inline float to_float(Half h) {
  if constexpr (std::is_same_v<Half, _Float16>) {
    return static_cast<float>(h);
  } else {
    return bf16_to_float(h);
  }
}

template <typename Half>
inline Half from_float(float f) {
  if constexpr (std::is_same_v<Half, _Float16>) {
    return static_cast<_Float16>(f);  // round to nearest even
  } else {
    return float_to_bf16(f);
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

#if defined(AMP_PLUGIN_SIMD)
template <typename Half>
inline __m128i pack8(const float* src) {
  const __m256 x = _mm256_loadu_ps(src);
  if constexpr (std::is_same_v<Half, _Float16>) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {  // float_to_bf16, eight at a time
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  }
}
#endif

#if defined(AMP_PLUGIN_AVX512)
template <typename Half>
inline __m256i pack16(const float* src) {
  const __m512 x = _mm512_loadu_ps(src);
  if constexpr (std::is_same_v<Half, _Float16>) {
    return _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {  // float_to_bf16, sixteen at a time
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7fc0));
    return _mm512_cvtepi32_epi16(r);  // every lane is below 2**16: the truncation is exact
  }
}
#endif

template <typename Half>
void from_float_block(const float* src, Half* dst, int64_t n, bool stream) {
  int64_t i = 0;
#if defined(AMP_PLUGIN_AVX512)
  if (stream) {
    for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 32 != 0; ++i) {
      dst[i] = from_float<Half>(src[i]);
    }
    for (; i + 16 <= n; i += 16) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + i), pack16<Half>(src + i));
    }
  } else {
    for (; i + 16 <= n; i += 16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), pack16<Half>(src + i));
    }
  }
#elif defined(AMP_PLUGIN_SIMD)
  if (stream) {
    for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % 16 != 0; ++i) {
      dst[i] = from_float<Half>(src[i]);
    }
    for (; i + 8 <= n; i += 8) {
      _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), pack8<Half>(src + i));
    }
  } else {
    for (; i + 8 <= n; i += 8) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), pack8<Half>(src + i));
    }
  }
#endif
  for (; i < n; ++i) {
    dst[i] = from_float<Half>(src[i]);
  }
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
      for (int64_t i = 0; i < n; ++i) {
        const float f = block[i] * s;
        block[i] = f;
        bad |= nonfinite(f);
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

// out[i] = float(half_grads[i]) * inv_scale; found_inf = 1 if any result is inf/NaN.
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

struct AdamConstants {
  float lerp_weight;  // 1 - beta1
  float beta2;
  float sq_coefficient;  // 1 - beta2
  float decay;           // AdamW: 1 - lr * weight_decay
  float weight_decay;    // Adam: L2 term added to the gradient
  float bias_correction2_sqrt;
  float eps;
  float step_size;  // lr / bias_correction1
  float sign;           // -1 with maximize
};

enum class Decay { kNone, kDecoupled, kL2 };

// kTail: the roundings of torch's scalar tail loop instead (see adam_tensor), which fuses the
// other product of the exp_avg_sq update: exp_avg_sq * beta2 + ((1 - beta2) * grad) * grad.
template <Decay kDecay, bool kSmallLerp, bool kTail = false>
void adam_loop(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
               const AdamConstants& constants) {
  // Locals and restrict pointers: no store aliases the constants or another array, so the
  // loop vectorises.
  float* __restrict__ p = param;
  const float* __restrict__ g = grad;
  float* __restrict__ m = exp_avg;
  float* __restrict__ v = exp_avg_sq;
  const float sign = constants.sign, decay = constants.decay, weight_decay = constants.weight_decay;
  const float lerp_coefficient = kSmallLerp ? constants.lerp_weight : constants.lerp_weight - 1.0f;
  const float beta2 = constants.beta2, sq_coefficient = constants.sq_coefficient;
  const float bias_correction2_sqrt = constants.bias_correction2_sqrt, eps = constants.eps;
  const float step_size = constants.step_size;
  for (int64_t i = 0; i < n; ++i) {
    float gi = g[i] * sign;
    float pi = p[i];
    if constexpr (kDecay == Decay::kDecoupled) {
      pi = pi * decay;
    } else if constexpr (kDecay == Decay::kL2) {
      gi = std::fma(pi, weight_decay, gi);
    }
    // The roundings of torch's vectorised fused Adam: exp_avg.lerp_(grad, 1 - beta1) as one
    // fused multiply-add from the nearer end, the squared-gradient term fused into exp_avg_sq.
    const float diff = gi - m[i];
    const float mi = std::fma(lerp_coefficient, diff, kSmallLerp ? m[i] : gi);
    const float vi = kTail ? std::fma(v[i], beta2, (sq_coefficient * gi) * gi)
                           : std::fma(sq_coefficient * gi, gi, v[i] * beta2);
    const float denom = std::sqrt(vi) / bias_correction2_sqrt + eps;
    pi = pi - (step_size * mi) / denom;
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
  }
}

// torch's fused Adam (CPU) updates whole Vectorized<float> vectors of 8 and finishes each tensor
// with a scalar loop over the last numel % 8 elements; its work is split into 16-float units, so
// that tail sits at the end of the tensor whatever the thread count. (torch builds this kernel for
// AVX2 and the default capability only: an AVX512 CPU runs the AVX2 kernel, 8 wide too.)
constexpr int64_t kTorchVectorWidth = 8;

// One tensor, block by block: the vectorised update (torch's tail roundings on the last
// numel % 8 elements), then the block's new masters (still in L1) rounded into the model.
template <Decay kDecay, bool kSmallLerp>
void adam_tensor(float* p, const float* g, float* m, float* v, void* model, at::ScalarType model_dtype,
                 int64_t numel, const AdamConstants& c, bool stream) {
  const int64_t vector_end = numel - numel % kTorchVectorWidth;
  at::parallel_for(0, numel, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; b += kBlock) {
      const int64_t n = std::min(kBlock, end - b);
      const int64_t n_vector = std::max<int64_t>(0, std::min(n, vector_end - b));
      adam_loop<kDecay, kSmallLerp>(p + b, g + b, m + b, v + b, n_vector, c);
      if (n_vector < n) {
        adam_loop<kDecay, kSmallLerp, true>(p + b + n_vector, g + b + n_vector, m + b + n_vector, v + b + n_vector,
                                            n - n_vector, c);
      }
      if (model_dtype == at::kHalf) {
        from_float_block(p + b, static_cast<_Float16*>(model) + b, n, stream);
      } else if (model_dtype == at::kBFloat16) {
        from_float_block(p + b, static_cast<BF16Bits*>(model) + b, n, stream);
      }
    }
    if (stream) {
      fence_streams();
    }
  });
}

template <Decay kDecay>
void adam_lerp_dispatch(float* p, const float* grad, float* m, float* v, void* model, at::ScalarType model_dtype,
                        int64_t numel, const AdamConstants& c, bool stream) {
  if (std::abs(c.lerp_weight) < 0.5f) {
    adam_tensor<kDecay, true>(p, grad, m, v, model, model_dtype, numel, c, stream);
  } else {
    adam_tensor<kDecay, false>(p, grad, m, v, model, model_dtype, numel, c, stream);
  }
}

// One Adam/AdamW step over FP32 masters; writes each updated master, rounded, into the
// matching model tensor (None for parameters that are their own FP32 master). Each state
// step tensor is incremented first, as torch.optim's fused Adam does.
void adam_step_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList state_steps, const c10::List<std::optional<at::Tensor>>& model_params, double lr,
                double beta1, double beta2, double weight_decay, double eps, bool adamw, bool maximize) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && state_steps.size() == n &&
                  model_params.size() == n,
              "adam_step_: list lengths differ");
  int64_t model_bytes = 0;
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    TORCH_CHECK(p.device().is_cpu() && p.scalar_type() == at::kFloat && p.is_contiguous(),
                "adam_step_: masters must be contiguous float32 CPU tensors");
    for (const at::Tensor* other : {&grads[t], &exp_avgs[t], &exp_avg_sqs[t]}) {
      TORCH_CHECK(other->device().is_cpu() && other->scalar_type() == at::kFloat && other->is_contiguous() &&
                      other->numel() == p.numel(),
                  "adam_step_: grads and moments must be contiguous float32 CPU tensors shaped like the masters");
    }
    TORCH_CHECK(state_steps[t].device().is_cpu() && state_steps[t].numel() == 1,
                "adam_step_: step must be a one-element CPU tensor");
    const std::optional<at::Tensor> model = model_params.get(t);
    if (model.has_value() && model->defined()) {
      check_pair(*model, p, "adam_step_");
      model_bytes += model->numel() * static_cast<int64_t>(model->element_size());
    }
  }
  const bool stream = model_bytes >= kStreamBytes;
  for (size_t t = 0; t < n; ++t) {
    const at::Tensor& p = params[t];
    state_steps[t].add_(1);
    const double step = state_steps[t].item<double>();
    const double bias_correction1 = 1 - std::pow(beta1, step);
    const double bias_correction2 = 1 - std::pow(beta2, step);
    AdamConstants c{};
    c.lerp_weight = static_cast<float>(1 - beta1);
    c.beta2 = static_cast<float>(beta2);
    c.sq_coefficient = static_cast<float>(1 - beta2);
    c.decay = static_cast<float>(1 - lr * weight_decay);
    c.weight_decay = static_cast<float>(weight_decay);
    c.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
    c.eps = static_cast<float>(eps);
    c.step_size = static_cast<float>(lr / bias_correction1);
    c.sign = maximize ? -1.0f : 1.0f;
    const float* grad = grads[t].const_data_ptr<float>();
    const std::optional<at::Tensor> model = model_params.get(t);
    const bool has_model = model.has_value() && model->defined();
    void* model_data = has_model ? model->data_ptr() : nullptr;
    const at::ScalarType model_dtype = has_model ? model->scalar_type() : at::kFloat;
    float* pp = p.data_ptr<float>();
    float* mp = exp_avgs[t].data_ptr<float>();
    float* vp = exp_avg_sqs[t].data_ptr<float>();
    if (weight_decay == 0) {
      adam_lerp_dispatch<Decay::kNone>(pp, grad, mp, vp, model_data, model_dtype, p.numel(), c, stream);
    } else if (adamw) {
      adam_lerp_dispatch<Decay::kDecoupled>(pp, grad, mp, vp, model_data, model_dtype, p.numel(), c, stream);
    } else {
      adam_lerp_dispatch<Decay::kL2>(pp, grad, mp, vp, model_data, model_dtype, p.numel(), c, stream);
    }
  }
}

}  // namespace

TORCH_LIBRARY(amp_plugin, m) {
  m.def("unscale_into_(Tensor[] half_grads, Tensor(a!)[] out, Tensor(b!) found_inf, Tensor inv_scale) -> ()");
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] state_steps, Tensor(e!)?[] model_params, float lr, float beta1, float beta2, "
      "float weight_decay, float eps, bool adamw, bool maximize) -> ()");
}

TORCH_LIBRARY_IMPL(amp_plugin, CPU, m) {
  m.impl("unscale_into_", &unscale_into_);
  m.impl("adam_step_", &adam_step_);
}
