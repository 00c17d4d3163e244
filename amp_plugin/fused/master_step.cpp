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
//   with moment_keys, one key per tensor, one hash per element for both moments, else to nearest).
// unscale_into_, unscale_copy: FP32 master gradients materialized from half gradients (copy,
//   unscale and inf check in one pass), for when something reads them or the step needs them.
//
// The number formats and vector types are in fused_simd.h, torch's fused Adam update over the
// master kinds' loads and stores in adam_update.h; this file holds the passes and the ops.
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

#include "adam_update.h"
#include "fused_simd.h"

namespace {

constexpr int64_t kGrain = 1 << 15;        // elements per parallel task, at least
constexpr int64_t kBlock = 1024;           // elements converted per block, in L1
// An op whose big output (all tensors together) is this large stores it past the cache: it
// would not stay there anyway, and a cached store first reads each line from memory.
constexpr int64_t kStreamBytes = 8 << 20;

// Block conversions between the half type and float; with stream=true the stores into the
// big output (FP32 master grads, the model's half weights) are non-temporal.

// FP16 -> float, V::kWidth at a time (GCC does not vectorise _Float16 casts itself); returns where it stopped.
template <class V>
int64_t f16_to_float_vectors(const _Float16* src, float* dst, int64_t i, int64_t n) {
  for (; i + V::kWidth <= n; i += V::kWidth) {
    V::store(dst + i, V::load_f16(src + i));
  }
  return i;
}

template <typename Half>
void to_float_block(const Half* src, float* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<Half, _Float16>) {
#if defined(AMP_PLUGIN_AVX512)
    i = f16_to_float_vectors<V16>(src, dst, i, n);
#endif
#if defined(AMP_PLUGIN_SIMD)
    i = f16_to_float_vectors<V8>(src, dst, i, n);
#endif
  }
  for (; i < n; ++i) {
    dst[i] = to_float<Half>(src[i]);
  }
}

// Non-temporal stores of floats, V::kWidth at a time from the first aligned address; returns where it stopped.
template <class V>
int64_t stream_floats(const float* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i < n && reinterpret_cast<uintptr_t>(dst + i) % (sizeof(float) * V::kWidth) != 0; ++i) {
    dst[i] = src[i];
  }
  for (; i + V::kWidth <= n; i += V::kWidth) {
    V::stream(dst + i, V::load(src + i));
  }
  return i;
}

void store_floats(const float* src, float* dst, int64_t n, bool stream) {
  int64_t i = 0;
#if defined(AMP_PLUGIN_AVX512)
  if (stream) {
    i = stream_floats<V16>(src, dst, n);
  }
#elif defined(AMP_PLUGIN_SIMD)
  if (stream) {
    i = stream_floats<V8>(src, dst, n);
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

// The key of a tensor's moment roundings from its key (_stochastic.moments_key).
constexpr uint32_t kMomentsSalt = 0x6a09e667u;


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
      adam_span<kL2>(begin, end, job.numel,
                     GradHalf<_Float16>{static_cast<const _Float16*>(job.grad), job.inv_scale * job.c.sign}, master, mom, job.c);
      break;
    default:
      adam_span<kL2>(begin, end, job.numel,
                     GradHalf<BF16Bits>{static_cast<const BF16Bits*>(job.grad), job.inv_scale * job.c.sign}, master, mom, job.c);
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
    adam_job_master<kL2>(job, begin, end, MomentsBF16<true>{m, v, fmix32(job.moment_key ^ kMomentsSalt)});
  } else if (job.bf16_moments) {
    adam_job_master<kL2>(job, begin, end, MomentsBF16<false>{m, v, 0});
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
