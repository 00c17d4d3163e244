// C++ CPU kernels for the "kernel" backend of amp_plugin.emulation (CpuHalfEmulation).
//
// While installed, these replace the CPU kernels of aten::mm, addmm, bmm and baddbmm (the
// default overloads: what F.linear, torch.matmul and their backward reach). A call with
// FP16/BF16 operands, in a thread where that dtype is emulated, upcasts the operands to
// FP32, runs the FP32 CPU kernel and rounds the result to the input dtype once: the same
// computation as the Python handlers in amp_plugin/emulation/_ops.py, bit for bit, without
// a trip into Python. Every other call goes straight to the FP32/native CPU kernel
// (at::cpu::*, the structured kernel the dispatcher would have run).
//
//   emulation_install() / emulation_uninstall(): register / remove the kernels (the
//     dispatcher's previous CPU kernels take over again).
//   emulation_sync(int? mask): set the dtypes emulated in the calling thread (bit 1: FP16,
//     bit 2: BF16, 0: off; None leaves it as is); returns this thread's per-op counts of
//     emulated calls (mm, addmm, bmm, baddbmm), resetting them, followed by the number of
//     FP32 buffers it holds. Calls in other dtypes go to the native kernel.

#include <ATen/ATen.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <c10/util/accumulate.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

namespace {

enum Op { kMm = 0, kAddmm, kBmm, kBaddbmm, kNumOps };

// Operands at least this large (elements) are upcast into per-thread FP32 buffers reused
// while emulation stays on (see _SCRATCH_MIN_NUMEL in _common.py), and so is the FP32 result
// before it is rounded: a fresh allocation this large costs more than the conversion (the
// memory comes back from the OS zeroed, page by page).
constexpr int64_t kScratchMinNumel = 32768;
constexpr int kResultSlot = 3;  // slots 0-2: operands

constexpr int64_t kHalfBit = 1;      // _DTYPE_BITS in amp_plugin/emulation/_common.py
constexpr int64_t kBFloat16Bit = 2;

thread_local int64_t tl_mask = 0;  // the dtypes emulated in this thread
thread_local std::array<int64_t, kNumOps> tl_counts{};
thread_local std::array<at::Tensor, 4> tl_scratch;

inline bool emulated(const at::Tensor& a) {
  if (tl_mask == 0) {
    return false;
  }
  const auto dt = a.scalar_type();
  return (dt == at::kHalf && (tl_mask & kHalfBit)) || (dt == at::kBFloat16 && (tl_mask & kBFloat16Bit));
}

// t.float(), keeping t's strides; large dense operands go into the thread's buffer `slot`.
at::Tensor upcast(const at::Tensor& t, int slot) {
  const int64_t n = t.numel();
  if (n < kScratchMinNumel ||
      !(t.is_contiguous() || (t.dim() >= 2 && t.transpose(-1, -2).is_contiguous()))) {
    return t.to(at::kFloat);
  }
  at::Tensor& buf = tl_scratch[slot];
  if (!buf.defined() || buf.numel() < n) {
    buf = at::empty({n}, t.options().dtype(at::kFloat));
  }
  at::Tensor view = buf.as_strided(t.sizes(), t.strides());
  view.copy_(t);
  return view;
}

// A contiguous FP32 tensor of `sizes` for an op's result: in the thread's buffer when large.
at::Tensor result_buffer(at::IntArrayRef sizes) {
  const int64_t n = c10::multiply_integers(sizes);
  if (n < kScratchMinNumel) {
    return at::empty(sizes, at::kFloat);
  }
  at::Tensor& buf = tl_scratch[kResultSlot];
  if (!buf.defined() || buf.numel() < n) {
    buf = at::empty({n}, at::kFloat);
  }
  return buf.narrow(0, 0, n).view(sizes);
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (emulated(a) && b.scalar_type() == a.scalar_type()) {
    ++tl_counts[kMm];
    const at::Tensor ua = upcast(a, 0), ub = upcast(b, 1);
    if (a.dim() != 2 || b.dim() != 2) {
      return at::cpu::mm(ua, ub).to(a.scalar_type());  // raises the kernel's own error
    }
    at::Tensor out = result_buffer({a.size(0), b.size(1)});
    return at::cpu::mm_out(out, ua, ub).to(a.scalar_type());
  }
  return at::cpu::mm(a, b);
}

at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) {
  if (emulated(a) && b.scalar_type() == a.scalar_type()) {
    ++tl_counts[kBmm];
    const at::Tensor ua = upcast(a, 0), ub = upcast(b, 1);
    if (a.dim() != 3 || b.dim() != 3) {
      return at::cpu::bmm(ua, ub).to(a.scalar_type());  // raises the kernel's own error
    }
    at::Tensor out = result_buffer({a.size(0), a.size(1), b.size(2)});
    return at::cpu::bmm_out(out, ua, ub).to(a.scalar_type());
  }
  return at::cpu::bmm(a, b);
}

at::Tensor addmm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                 const at::Scalar& alpha) {
  const auto dt = a.scalar_type();
  if (emulated(a) && b.scalar_type() == dt && c.scalar_type() == dt) {
    ++tl_counts[kAddmm];
    const at::Tensor uc = upcast(c, 2), ua = upcast(a, 0), ub = upcast(b, 1);
    if (a.dim() != 2 || b.dim() != 2) {
      return at::cpu::addmm(uc, ua, ub, beta, alpha).to(dt);  // raises the kernel's own error
    }
    at::Tensor out = result_buffer({a.size(0), b.size(1)});
    return at::cpu::addmm_out(out, uc, ua, ub, beta, alpha).to(dt);
  }
  return at::cpu::addmm(c, a, b, beta, alpha);
}

at::Tensor baddbmm(const at::Tensor& c, const at::Tensor& a, const at::Tensor& b, const at::Scalar& beta,
                   const at::Scalar& alpha) {
  const auto dt = a.scalar_type();
  if (emulated(a) && b.scalar_type() == dt && c.scalar_type() == dt) {
    ++tl_counts[kBaddbmm];
    const at::Tensor uc = upcast(c, 2), ua = upcast(a, 0), ub = upcast(b, 1);
    if (a.dim() != 3 || b.dim() != 3) {
      return at::cpu::baddbmm(uc, ua, ub, beta, alpha).to(dt);  // raises the kernel's own error
    }
    at::Tensor out = result_buffer({a.size(0), a.size(1), b.size(2)});
    return at::cpu::baddbmm_out(out, uc, ua, ub, beta, alpha).to(dt);
  }
  return at::cpu::baddbmm(c, a, b, beta, alpha);
}

std::mutex g_lock;
std::unique_ptr<torch::Library> g_library;  // set while the kernels are registered

// Replacing the CPU kernels is the point: drop the dispatcher's "Overriding a previously
// registered kernel" warning while registering.
class SilentWarnings : public c10::WarningHandler {
 public:
  void process(const c10::Warning&) override {}
};

void emulation_install() {
  std::lock_guard<std::mutex> guard(g_lock);
  if (g_library) {
    return;
  }
  SilentWarnings silent;
  c10::WarningUtils::WarningHandlerGuard quiet(&silent);
  auto lib = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::CPU,
                                              __FILE__, __LINE__);
  lib->impl("mm", TORCH_FN(mm));
  lib->impl("addmm", TORCH_FN(addmm));
  lib->impl("bmm", TORCH_FN(bmm));
  lib->impl("baddbmm", TORCH_FN(baddbmm));
  g_library = std::move(lib);
}

void emulation_uninstall() {
  std::lock_guard<std::mutex> guard(g_lock);
  g_library.reset();  // deregisters: the previous CPU kernels are computed again
}

std::vector<int64_t> emulation_sync(std::optional<int64_t> mask) {
  std::vector<int64_t> result(tl_counts.begin(), tl_counts.end());
  tl_counts = {};
  if (mask.has_value()) {
    tl_mask = *mask;
    if (tl_mask == 0) {
      tl_scratch = {};  // the FP32 buffers live only while emulation is on
    }
  }
  result.push_back(std::count_if(tl_scratch.begin(), tl_scratch.end(), [](const at::Tensor& t) { return t.defined(); }));
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(amp_plugin, m) {
  m.def("emulation_install() -> ()", &emulation_install);
  m.def("emulation_uninstall() -> ()", &emulation_uninstall);
  m.def("emulation_sync(int? mask) -> int[]", &emulation_sync);
}
