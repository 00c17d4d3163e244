"""Tensor-Core-style FP16/BF16 matmul numerics on CPU, at FP32 speed.

Why this exists
---------------
On a GPU, half-precision training is fast because Tensor Cores take FP16/BF16
inputs, multiply them exactly, accumulate the products in FP32 and round the
result to the output dtype once. A CPU without native half-precision units runs
PyTorch's FP16/BF16 GEMMs and convolutions one to two orders of magnitude slower
than FP32 (a 512x512 FP16 ``mm`` takes some 35-80x the FP32 time on x86 cores),
which makes CPU experiments with "real" half precision painfully slow.

:class:`CpuHalfEmulation` is a context manager that, for CPU tensors in FP16 or
BF16, runs the matmul family of aten ops as::

    out = op(*[t.float() for t in half_operands]).to(half_dtype)

i.e. the operands are upcast to FP32, the ordinary FP32 kernel does the work, and
the result is rounded to the input dtype exactly once. For ``mm`` this is
bit-for-bit ``(a.float() @ b.float()).to(a.dtype)``; for ``addmm`` it is
``torch.addmm(bias.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(dtype)``.

The numerics
------------
* **Half inputs are exact in FP32.** Every FP16 value (11-bit significand,
  exponents down to the subnormal 2**-24) and every BF16 value (8-bit significand,
  FP32's exponent range) is exactly representable in FP32, so the upcast loses
  nothing.
* **Products are exact.** An FP16 x FP16 product has at most 22 significant bits
  and a BF16 x BF16 product at most 16, both within FP32's 24, so the FP32 GEMM
  forms every product exactly (for BF16: unless the product leaves FP32's
  exponent range, as it would on the GPU too).
* **Accumulation is FP32.** The products are summed in FP32, as in a Tensor
  Core's FP32 accumulator. Partial sums may exceed 65504 without harm.
* **One rounding.** Only the final result is rounded (round-to-nearest-even) to
  FP16/BF16, which is what the GPU's output conversion does. (Where a GPU kernel rounds
  an intermediate to half, the emulation does too: the attention probabilities before
  ``P V``, a convolution's output before its bias; see below.) A result outside
  FP16's range becomes ``inf`` (a product above 65504 gives ``inf`` in FP16),
  exactly where a GPU run would overflow.

What is reproduced is the error model (exact products, FP32 sums, one output
rounding), not the bits of one particular GPU: the order in which an FP32 GEMM
sums its products differs between any two GEMM implementations, Tensor Cores
included.

Native or emulated: ``emulate="auto"``
--------------------------------------
Where the CPU has half-precision units and PyTorch hands the dtype's GEMMs to oneDNN, the
native kernels are faithful too (oneDNN accumulates in FP32 and rounds once) and faster than
the emulation: a BF16 GEMM on ``avx512_bf16``/AMX-BF16 takes a quarter to a half of the FP32
time, while the emulation runs at FP32 speed. :func:`cpu_half_path` decides per dtype, once per
process, from what the CPU reports (:func:`cpu_features`): BF16 runs natively with
``avx512_bf16`` or AMX-BF16, FP16 natively with AMX-FP16 (with ``avx512_fp16`` alone native
FP16 is no faster than the emulation; without either it measured 6-30x the FP32 time even on
``avx512_bf16`` CPUs), everything else is emulated.
:func:`should_emulate` (what ``emulate="auto"`` asks) follows it, and
``CpuHalfEmulation(dtypes="auto")`` emulates exactly the dtypes it does not run natively;
``CpuHalfEmulation(dtypes=torch.float16)`` emulates FP16 and lets BF16 ops run natively in the
same context. The native paths are checked against the one-rounding bound by
``tests/emulation/test_cpu_paths.py`` on the CPUs that take them.

What is covered
---------------
Inside the context, when the operands are CPU tensors of one emulated half dtype:

* ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``addmv``, ``dot``,
  ``_addmm_activation``; the ``out=`` forms of ``mm``, ``bmm``, ``addmm``,
  ``baddbmm`` and the in-place ``addmm_``, ``baddbmm_``, ``addmv_``: the FP32 kernel on the
  upcast operands (bias and activation included), rounded once. ``torch.matmul``,
  ``F.linear``, ``einsum``, ``tensordot``, ``nn.MultiheadAttention`` (``need_weights=True``
  path) reach the dispatcher as these ops, so they are covered too.
* ``convolution`` (all of ``F.conv1d/2d/3d`` and ``conv_transpose*``, any stride, padding,
  dilation, groups): the FP32 convolution without bias, rounded once, then, as cuDNN does
  it (``output.add_(bias)`` after the convolution), the bias added in the half dtype: a
  second, correctly rounded, half addition. ``convolution_backward``: the FP32 kernel, each
  of the three gradients rounded once (the bias gradient is an FP32 sum, as the GPU's
  reduction of a half gradient with an FP32 accumulator).
* Scaled-dot-product attention: on CPU, ``F.scaled_dot_product_attention`` without
  dropout runs ``_scaled_dot_product_flash_attention_for_cpu`` and, in backward,
  ``..._backward``. Both are computed as a GPU flash-attention kernel does: scores in FP32,
  the unnormalised probabilities ``exp(S - rowmax)`` rounded to the half dtype for the
  ``P V`` product (FP32 accumulation), the result divided by the FP32 row sum and rounded
  once; ``logsumexp`` stays FP32. Backward: ``P`` rounded to half for ``dV = P^T dO``, the
  score gradients ``dS = P (dP - rowsum(dO O))`` rounded to half for ``dQ`` and ``dK``, each
  gradient accumulated in FP32 and rounded once, ``O`` being the stored half output. Exact
  for rows of up to one GPU key block (64-128 keys); beyond that a GPU rounds each
  probability relative to a running maximum: the same error per element, other bits. See
  ``_attention.py``. With ``dropout_p > 0`` PyTorch uses the math path, which on CPU
  already upcasts half inputs to FP32 itself, so nothing is intercepted there.
* Recurrent layers: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` (and the cells) in half are built
  from ``addmm``/``mm`` (emulated) and elementwise gate ops (``sigmoid``, ``tanh``, ``mul``,
  ``add``: native half, each result rounded), except where PyTorch hands ``nn.LSTM`` to
  oneDNN: BF16 on CPUs with AVX-512 BW/VL/DQ or AVX-NE-CONVERT, FP16 without grad on CPUs
  with oneDNN FP16. That path, ``mkldnn_rnn_layer`` and ``mkldnn_rnn_layer_backward``, runs
  the whole layer in FP32 (gates and states included) and rounds its outputs and gradients
  once. Neither is bit for bit what cuDNN's fused RNN kernels do; the matmuls' error model
  (FP32 sums, one rounding) is kept in both.
* Autograd: the backward of every covered op is built from covered ops (the
  backward of ``mm`` is two ``mm`` calls on half tensors, that of ``convolution``
  is ``convolution_backward``), so gradients get the same treatment. The backward
  must run inside the context too (ops are intercepted when they execute).
  The bias gradient of ``F.linear``/``addmm`` is a plain ``sum`` and runs natively.
* ``torch.autocast("cpu", dtype=torch.float16 / torch.bfloat16)``: autocast casts
  sit above the interception point, so the ops arrive here in half and are
  emulated.
* Fused CPU fast paths (``_transformer_encoder_layer_fwd``, used by
  ``nn.TransformerEncoderLayer`` in eval mode without grad,
  ``_native_multi_head_attention``, ``_trilinear``): the ``addmm``/``bmm`` calls
  inside them are emulated, everything else in them runs natively.

In short, for CPU tensors of an emulated half dtype:

* FP32 kernel, rounded once: the matmul family above, ``convolution`` (then its bias, as a
  half add), ``convolution_backward``.
* FP32 with a GPU flash kernel's intermediate roundings: the SDPA flash forward/backward.
* FP32 throughout, outputs rounded once: ``mkldnn_rnn_layer(_backward)`` (oneDNN's LSTM);
  SDPA with dropout (PyTorch's math path upcasts by itself).
* Native half kernels: elementwise ops, reductions, softmax, norms, losses, the RNN gate
  arithmetic, optimizer updates.

What is not covered
-------------------
* Everything else runs untouched in its native half kernel: elementwise ops,
  reductions (``sum``, ``mean``), ``softmax``, ``layer_norm``, losses, optimizer
  updates. (Many of these already accumulate in FP32 internally on CPU.)
* FP32/FP64/integer tensors, non-CPU tensors and the half dtypes not being emulated are
  never touched; neither are ops with mixed operand dtypes (the native kernel raises as usual).
* ``mm.dtype``/``bmm.dtype``/``addmm.dtype``/``baddbmm.dtype`` (explicit output
  dtype), ``addbmm``, ``vdot``, ``addr`` (an outer product has nothing to
  accumulate), the ``out=`` forms not listed above, sparse, quantized and nested
  tensors.
* Emulation is per thread: ops run by other Python threads keep their native
  numerics.
* The FP32 kernels are used as configured: under
  ``torch.set_float32_matmul_precision("high"/"medium")`` oneDNN may compute FP32
  matmuls with reduced-precision internals on CPUs that support it, and the
  emulation inherits that. Keep the default ``"highest"`` for Tensor-Core numerics.

How it is intercepted (``backend=``)
------------------------------------
``"kernel"`` (the default where the installed torch offers
``torch.library.get_kernel``): while at least one thread is inside the context
(or :meth:`CpuHalfEmulation.keep_installed` is held), a small Python kernel is
registered for the CPU dispatch key of each covered op (and removed again when
the last context exits). It sits below autograd, autocast and any Python dispatch
mode, so it sees exactly the ops that reach the CPU kernels, including those
issued from inside fused C++ kernels. Ops that are
not covered never touch Python, so their cost is unchanged. A covered op checks a
thread-local flag: reached from a thread without an active context, it calls the
original kernel (a few microseconds of Python and a brief hold of the GIL while
the kernels are registered). Registering and removing the kernels costs a
fraction of a millisecond per outermost enter/exit: keep one context around a
whole step rather than around single ops, or hold
:meth:`CpuHalfEmulation.keep_installed` around code that enters many short
contexts. (Un)registering while other threads are running ops is best avoided;
hold ``keep_installed()`` in multi-threaded programs, or use the "mode" backend.
Where :mod:`amp_plugin.fused` is built, ``mm``, ``addmm``, ``bmm`` and ``baddbmm`` get C++
kernels instead of Python ones (the same computation, without entering Python per call):
:func:`native_kernels_available` says whether they run, :func:`python_kernels_only` turns them
off for a comparison.

``"mode"``: a :class:`torch.utils._python_dispatch.TorchDispatchMode`, strictly
thread-local and cheap to enter. Every aten op executed in the context makes one
call into Python (a dict lookup for ops that are not covered), about ten
microseconds per op on a slow core; the fused fast-path kernels above are
re-dispatched to their CPU kernel with the mode visible so the matmuls inside
them are seen, and, under ``torch.inference_mode()`` (where composite ops such as
``matmul`` and ``conv2d`` reach the mode undecomposed), composite ops are
decomposed with the mode visible.

Both backends give bit-identical results.

Memory: large operands (32768 elements and up) are upcast into
FP32 buffers that each thread reuses while its emulation is on and frees when the
outermost context exits; a fresh multi-megabyte allocation per upcast would cost
more than the conversion. So, inside a context, the FP32 size of the largest
operands stays allocated (one buffer per operand position).
"""

from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.emulation._backends import native_kernels_available, python_kernels_only
from amp_plugin.emulation._context import CpuHalfEmulation, should_emulate
from amp_plugin.emulation._cpu import CpuFeatures, CpuPath, cpu_features, cpu_half_path
from amp_plugin.emulation._ops import EMULATED_OPS

__all__ = [
    "EMULATED_OPS",
    "HALF_DTYPES",
    "CpuFeatures",
    "CpuHalfEmulation",
    "CpuPath",
    "cpu_features",
    "cpu_half_path",
    "native_kernels_available",
    "python_kernels_only",
    "should_emulate",
]
