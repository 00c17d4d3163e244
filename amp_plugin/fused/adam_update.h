// torch.optim's fused Adam/AdamW update (CPU) over amp_plugin's master kinds, bit for bit.
//
// One loop body over a vector type (fused_simd.h), with the loads and stores of the gradient,
// the master and the moments supplied by small policy classes, so that one update serves every
// combination: the gradient FP32 or the model's FP16/BF16 gradient times the unscale factor; the
// master an FP32 tensor (optionally rounded into the model's weight in the same pass), the BF16
// weight with a 16-bit remainder, or the BF16 weight alone, rounded stochastically; the moments
// FP32 or BF16 (rounded to nearest or stochastically).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "fused_simd.h"

namespace {

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
// product of the exp_avg_sq update: exp_avg_sq * beta2 + ((1 - beta2) * grad) * grad. kSigned: g
// comes with maximize's sign (the sign is exact, so folding it into the unscale factor changes no bit).
template <bool kL2, bool kTail, bool kSigned = false>
inline void adam_scalar(float& p, float g, float& m, float& v, const AdamConstants& c) {
  if constexpr (!kSigned) {
    g = times_sign_as_torch(g, c.sign);
  }
  if constexpr (kL2) {
    g = fma_as_torch(p, c.weight_decay, g);
  } else {
    p = p * c.decay;
  }
  // exp_avg.lerp_(grad, 1 - beta1) as one fused multiply-add from the nearer end
  const float diff = g - m;
  const float mi = fma_as_torch(c.lerp_coefficient, diff, c.lerp_from_avg ? m : g);
  const float vi = kTail ? fma_as_torch(v, c.beta2, (c.sq_coefficient * g) * g)
                         : fma_as_torch(c.sq_coefficient * g, g, v * c.beta2);
  const float denom = std::sqrt(vi) / c.bias_correction2_sqrt + c.eps;
  p = p - (c.step_size * mi) / denom;
  m = mi;
  v = vi;
}

// Gradient sources: FP32 as stored, or FP16/BF16 times the unscale factor, maximize's sign
// included (kSigned: the factor is inv_scale * sign, one multiply fewer per element).
struct GradF32 {
  static constexpr bool kSigned = false;
  const float* g;
  template <class V>
  AMP_INLINE typename V::F load(int64_t i) const { return V::load(g + i); }
};
template <typename Half>
struct GradHalf {
  static constexpr bool kSigned = true;
  const Half* g;
  float inv_scale;  // times the sign
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
  static constexpr bool kChecksNaN = std::is_same_v<Half, BF16Bits>;  // the model's weight rounded to BF16
  float* p;
  Half* model;
  template <class V>
  AMP_INLINE typename V::F load(int64_t i) const { return V::load(p + i); }
  template <class V, bool kNoNaN>
  AMP_INLINE static typename V::H to_half(typename V::F x) {
    if constexpr (std::is_same_v<Half, _Float16>) {
      return V::to_f16(x);
    } else {
      return V::template to_bf16<kNoNaN>(x);
    }
  }
  template <class V, bool kNoNaN = false>
  AMP_INLINE void store(int64_t i, typename V::F x) const {
    V::store(p + i, x);
    if constexpr (!std::is_void_v<Half>) {
      V::store_h(model + i, to_half<V, kNoNaN>(x), kStream);
    }
  }
  template <class V, bool kNoNaN = false>
  AMP_INLINE void store2(int64_t i, typename V::F x, typename V::F y) const {
    V::store(p + i, x);
    V::store(p + i + V::kWidth, y);
    if constexpr (!std::is_void_v<Half>) {
      V::store_h2(model + i, to_half<V, kNoNaN>(x), to_half<V, kNoNaN>(y), kStream);
    }
  }
};
struct MasterRemainder {  // the BF16 weight (the master rounded) and the signed remainder
  static constexpr bool kChecksNaN = false;
  uint16_t* hi;
  uint16_t* lo;
  template <class V>
  AMP_INLINE typename V::F load(int64_t i) const { return V::load_rem(hi + i, lo + i); }
  template <class V, bool kNoNaN = false>  // the split is of bits: a NaN needs no handling of its own
  AMP_INLINE void store(int64_t i, typename V::F x) const { V::store_rem(hi + i, lo + i, x); }
  template <class V, bool kNoNaN = false>
  AMP_INLINE void store2(int64_t i, typename V::F x, typename V::F y) const {
    V::store_rem(hi + i, lo + i, x);
    V::store_rem(hi + i + V::kWidth, lo + i + V::kWidth, y);
  }
};
struct MasterStochastic {  // no master: the BF16 weight, written back with stochastic rounding
  static constexpr bool kChecksNaN = true;
  uint16_t* w;
  uint32_t key;
  template <class V>
  AMP_INLINE typename V::F load(int64_t i) const { return V::load_bf16(w + i); }
  template <class V, bool kNoNaN = false>
  AMP_INLINE void store(int64_t i, typename V::F x) const {
    V::store_h(w + i, V::template to_bf16_sr<kNoNaN>(x, key, i), false);
  }
  template <class V, bool kNoNaN = false>
  AMP_INLINE void store2(int64_t i, typename V::F x, typename V::F y) const {
    V::store_h2(w + i, V::template to_bf16_sr<kNoNaN>(x, key, i),
                V::template to_bf16_sr<kNoNaN>(y, key, i + V::kWidth), false);
  }
};

// Moment stores: FP32, or BF16 (read into FP32, rounded once when stored: to nearest, or
// stochastically).
struct MomentsF32 {
  static constexpr bool kChecksNaN = false;
  float* m;
  float* v;
  template <class V>
  AMP_INLINE typename V::F load_m(int64_t i) const { return V::load(m + i); }
  template <class V>
  AMP_INLINE typename V::F load_v(int64_t i) const { return V::load(v + i); }
  template <class V, bool kNoNaN = false>
  AMP_INLINE void store(int64_t i, typename V::F mi, typename V::F vi) const {
    V::store(m + i, mi);
    V::store(v + i, vi);
  }
};
// kStochastic: stochastic rounding keyed by the moments' own key (a moment rounded to nearest cannot
// shrink by less than half its ulp: beta * v rounds back to v for any beta above 1 - 2**-9).
template <bool kStochastic>
struct MomentsBF16 {
  static constexpr bool kChecksNaN = true;
  uint16_t* m;
  uint16_t* v;
  uint32_t key;
  template <class V>
  AMP_INLINE typename V::F load_m(int64_t i) const { return V::load_bf16(m + i); }
  template <class V>
  AMP_INLINE typename V::F load_v(int64_t i) const { return V::load_bf16(v + i); }
  template <class V, bool kNoNaN = false>
  AMP_INLINE void store(int64_t i, typename V::F mi, typename V::F vi) const {
    if constexpr (kStochastic) {
      // one hash: exp_avg takes its high bits, exp_avg_sq its low
      V::template store_sr_pair<kNoNaN>(m + i, v + i, mi, vi, key, i);
    } else {
      V::store_h(m + i, V::template to_bf16<kNoNaN>(mi), false);
      V::store_h(v + i, V::template to_bf16<kNoNaN>(vi), false);
    }
  }
};

// The vectorised update over [i, limit), two vectors at a time where V::kPaired (the model's
// 16-bit weights of both go out in one store), then one; returns where it stopped. The policies
// come by value: their pointers then live in registers, where no store can alias them.
//
// Where no lane of the new master is NaN, no lane of the new moments is either (a NaN moment
// makes the update, and so the master, NaN), and the stores that round to BF16 (kChecksNaN) do
// it without their NaN handling (kNoNaN: a compare and a blend per rounded vector, six of them
// in a bf16_sr step); a vector with a NaN takes the stores' full path. The same bits either way.
template <class V, bool kL2, bool kUnitBc2, class Grad, class Master, class Moments>
int64_t adam_vectors(int64_t i, int64_t limit, const Grad grad, const Master master, const Moments mom,
                     const AdamConstants& c) {
  using F = typename V::F;
  const F sign = V::set1(c.sign), decay = V::set1(c.decay), weight_decay = V::set1(c.weight_decay);
  const F lerp = V::set1(c.lerp_coefficient), beta2 = V::set1(c.beta2), sq = V::set1(c.sq_coefficient);
  const F bc2 = V::set1(c.bias_correction2_sqrt), eps = V::set1(c.eps), step_size = V::set1(c.step_size);
  const typename V::M from_avg = V::mask(c.lerp_from_avg);  // a blend: a branch on it spilled both operands
  auto update = [&](int64_t j) AMP_LAMBDA_INLINE {  // updates the moments at j, returns the new master
    F g = grad.template load<V>(j);
    if constexpr (!Grad::kSigned) {
      g = V::mul(g, sign);
    }
    F p = master.template load<V>(j);
    if constexpr (kL2) {
      g = V::fma(p, weight_decay, g);
    } else {
      p = V::mul(p, decay);
    }
    const F mo = mom.template load_m<V>(j);
    const F mi = V::fma(lerp, V::sub(g, mo), V::select(from_avg, mo, g));
    const F vi = V::fma(V::mul(sq, g), g, V::mul(mom.template load_v<V>(j), beta2));
    const F denom = kUnitBc2 ? V::add(V::sqrt(vi), eps) : V::add(V::div(V::sqrt(vi), bc2), eps);
    const F pi = V::sub(p, V::div(V::mul(step_size, mi), denom));
    if (Moments::kChecksNaN && V::no_nan(pi)) {
      mom.template store<V, Moments::kChecksNaN>(j, mi, vi);
    } else {
      mom.template store<V, false>(j, mi, vi);
    }
    return pi;
  };
  for (; V::kPaired && i + 2 * V::kWidth <= limit; i += 2 * V::kWidth) {
    const F p0 = update(i);
    const F p1 = update(i + V::kWidth);
    if (Master::kChecksNaN && V::no_nan(p0) && V::no_nan(p1)) {
      master.template store2<V, Master::kChecksNaN>(i, p0, p1);
    } else {
      master.template store2<V, false>(i, p0, p1);
    }
  }
  for (; i + V::kWidth <= limit; i += V::kWidth) {
    const F pi = update(i);
    if (Master::kChecksNaN && V::no_nan(pi)) {
      master.template store<V, Master::kChecksNaN>(i, pi);
    } else {
      master.template store<V, false>(i, pi);
    }
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
    adam_scalar<kL2, kTail, Grad::kSigned>(p, grad.template load<V1>(i), m, v, c);
    mom.template store<V1>(i, m, v);
    master.template store<V1>(i, p);
  }
}

// Whether every stream of an update is 16-bit (the BF16 gradient, a lean master, BF16 moments):
// such a loop runs V16P (AVX-512) or V8P, whose 16-bit loads and stores need no widening shuffles.
template <class Grad, class Master, class Moments>
constexpr bool kAll16Bit = std::is_same_v<Grad, GradHalf<BF16Bits>> &&
                           (std::is_same_v<Master, MasterRemainder> || std::is_same_v<Master, MasterStochastic>) &&
                           (std::is_same_v<Moments, MomentsBF16<true>> || std::is_same_v<Moments, MomentsBF16<false>>);

// torch's fused Adam (CPU) updates whole Vectorized<float> vectors of 8 and finishes each tensor
// with a scalar loop over the last numel % 8 elements; its work is split into 16-float units, so
// that tail sits at the end of the tensor whatever the thread count. (torch builds this kernel for
// AVX2 and the default capability only: an AVX512 CPU runs the AVX2 kernel, 8 wide too.)
constexpr int64_t kTorchVectorWidth = 8;
// Parallel tasks start at multiples of this many elements: whole vectors, whole cache lines of
// the FP32 arrays, and 16-byte-aligned stores into an aligned model tensor.
constexpr int64_t kUnit = 64;

// Late in training the bias correction's square root rounds to exactly 1.0f (with torch's default
// beta2 = 0.999 after some 16,600 steps; 1 - beta2**step then lies within 2**-24 of one), and
// sqrt(v) / 1.0f is sqrt(v) for every v, NaN included: the widest loops then skip that division,
// one of the three divider operations per element. (kUnitBc2 is instantiated for the loop that does
// the bulk of an update only: the narrower ones after it see fewer than a vector's elements.)
template <class V, bool kL2, bool kMayBeUnit, class Grad, class Master, class Moments>
int64_t adam_bulk(bool unit_bc2, int64_t i, int64_t limit, const Grad& grad, const Master& master, const Moments& mom,
                  const AdamConstants& c) {
  if constexpr (kMayBeUnit) {
    if (unit_bc2) {
      return adam_vectors<V, kL2, true>(i, limit, grad, master, mom, c);
    }
  }
  return adam_vectors<V, kL2, false>(i, limit, grad, master, mom, c);
}

// One span of a tensor: the widest vectors first, then narrower ones, then single elements
// with the vector roundings, and torch's tail roundings on the tensor's last numel % 8.
template <bool kL2, class Grad, class Master, class Moments>
void adam_span(int64_t begin, int64_t end, int64_t numel, const Grad& grad, const Master& master, const Moments& mom,
               const AdamConstants& c) {
  const int64_t vector_end = numel - numel % kTorchVectorWidth;
  const int64_t limit = std::min(end, vector_end);
  const bool unit = c.bias_correction2_sqrt == 1.0f;
  // the paired loop does the bulk of an all-16-bit update, the plain one of the others
  constexpr bool k16 = kAll16Bit<Grad, Master, Moments>;
  int64_t i = begin;
#if defined(AMP_PLUGIN_AVX512)
  constexpr bool kEightWide = false;
  if constexpr (k16) {
    i = adam_bulk<V16P, kL2, true>(unit, i, limit, grad, master, mom, c);
  }
  i = adam_bulk<V16, kL2, !k16>(unit, i, limit, grad, master, mom, c);
#elif defined(AMP_PLUGIN_SIMD)
  constexpr bool kEightWide = true;
#endif
#if defined(AMP_PLUGIN_SIMD)
  if constexpr (k16) {
    i = adam_bulk<V8P, kL2, kEightWide>(unit, i, limit, grad, master, mom, c);
  }
  i = adam_bulk<V8, kL2, kEightWide && !k16>(unit, i, limit, grad, master, mom, c);
#endif
  adam_scalars<kL2, false>(i, limit, grad, master, mom, c);
  adam_scalars<kL2, true>(std::max(begin, limit), end, grad, master, mom, c);
}

}  // namespace
