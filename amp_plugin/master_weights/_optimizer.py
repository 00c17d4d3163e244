""":class:`MasterWeightOptimizer`: an optimizer over half-precision parameters that updates
FP32 masters (see the package docstring)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from amp_plugin import fused as _fused
from amp_plugin.master_weights import _checkpoint
from amp_plugin.master_weights._adopt import add_group, adopt_group
from amp_plugin.master_weights._grads import GradSession, begin_session, clear_grads, end_session, warn_grads_changed
from amp_plugin.master_weights._identity import derived, restore
from amp_plugin.master_weights._kernels import StepKernel
from amp_plugin.master_weights._parameter import WRAPPED, Record, resync
from amp_plugin.master_weights._refusals import check_moments_rounding, check_wrappable
from amp_plugin.master_weights._shown import ShownGrads, show_unscaled
from amp_plugin.master_weights._step import run_step
from amp_plugin.master_weights._stochastic import SRGenerator, shared_seed
from amp_plugin.master_weights._unscale import unscale_grads
from amp_plugin.scaling.unscale import InvScaleOn

__all__ = ["FUSED_MODES", "MASTER_KINDS", "MOMENTS_ROUNDINGS", "MasterWeightOptimizer"]

MASTER_KINDS = ("fp32", "bf16_split", "stochastic")  # the built-in kinds (_kinds.KINDS may hold more)
MOMENTS_ROUNDINGS = ("stochastic", "nearest")
FUSED_MODES = (None, True, False, "torch", "triton", "compiled")


class MasterWeightOptimizer(Optimizer):
    """Wrap an optimizer built over half-precision parameters so it updates FP32 masters.

    Args:
        optimizer: an optimizer (SGD, Adam, AdamW, SparseAdam, fused or foreach, ...)
            constructed over the model's parameters. Its half-precision parameters are
            replaced in its param groups by FP32 masters (:class:`MasterParameter`); existing
            optimizer state is moved over and upcast. Not ``LBFGS`` (its ``step`` re-evaluates
            the closure), not an optimizer that is already wrapped (``ValueError``), not one
            over DTensor parameters (``TypeError``: under FSDP2 the sharded FP32 parameters
            are the masters).
        fused: how the step runs.

            - ``None`` (default): on the CPU, amp_plugin's fused kernels
              (:mod:`amp_plugin.fused`) when they are available: the inf check reads the half
              gradients, and, when the wrapped optimizer is ``Adam``/``AdamW`` built with
              ``fused=True``, one pass per tensor reads the half gradient, updates the master
              and its moments (torch's fused update, bit for bit) and writes the rounded
              weight into the model. On other devices (CUDA), with ``Adam``/``AdamW(fused=True)``,
              torch's multi-tensor kernels end to end, with the lean kinds' bit handling in
              Triton kernels (``"triton"``), or, without Triton, compiled (``"compiled"``).
            - ``True``: require amp_plugin's kernels and the one-pass Adam step (a
              ``ValueError`` says why not).
            - ``"torch"``: torch's kernels, any device: a multi-tensor copy-and-unscale into
              FP32 gradients, torch's fused Adam/AdamW on the masters, a multi-tensor copy
              into the model (requires ``Adam``/``AdamW``; ``ValueError`` otherwise).
            - ``"triton"``: the same, with the lean kinds' joins and stores (and BF16 moments'
              roundings) in two Triton kernels per group (on the CPU in Triton's interpreter,
              for tests); what ``None`` picks off the CPU (falling back to ``"compiled"`` with a
              warning if Triton is missing or fails).
            - ``"compiled"``: the same passes compiled by ``torch.compile``, one per tensor
              (falling back to ``"torch"`` with a warning if compiling fails).
            - ``False``: stock torch ops: copy and unscale, then the wrapped optimizer's own
              ``step()``, then a copy into the model.

            Every path computes the same masters, bit for bit. A parameter or gradient a
            kernel cannot take (not contiguous, sparse) goes the stock way.
        master: how the masters are stored.

            - ``"fp32"`` (default): an FP32 tensor per half parameter (4 bytes per parameter);
              the model's weight is the master rounded to nearest.
            - ``"bf16_split"``: for a BF16 model: the model's BF16 weight
              is the master rounded to nearest and a signed 16-bit remainder makes it exact (2
              bytes per parameter: AdamW's training state is 14 bytes per parameter instead of
              16). The masters (:meth:`fp32_masters`) are FP32 AdamW's given the same gradients,
              bit for bit (see :mod:`amp_plugin.master_weights._split` for the one tie rule).
            - ``"stochastic"``: for a BF16 model: no master; the weight is
              updated in FP32 and written back with stochastic rounding (seeded by ``sr_seed``).

            With ``Adam``/``AdamW(fused=True)`` the kinds without an FP32 tensor run torch's fused
            Adam update (amp_plugin's kernel on the CPU, torch's multi-tensor kernels elsewhere);
            any other optimizer runs its own ``step()`` on the FP32 values rebuilt for it, and the
            kind stores the result (the optimizer on FP32 copies, bit for bit). Their param groups hold
            placeholder masters (FP32, NaN-valued) that key the optimizer state and carry the FP32
            master gradients. FP16 parameters are refused (``ValueError``). See
            ``docs/master_weights.md`` for the bytes per parameter and checkpoint conversion.
        moments_dtype: ``None``/``torch.float32`` (default) or ``torch.bfloat16``: the per-element
            optimizer state of the half-precision parameters (Adam's ``exp_avg``/``exp_avg_sq``,
            SGD's ``momentum_buffer``, ...) stored in BF16, computed in FP32 inside the step and
            rounded once when stored (any ``master`` kind, any optimizer; FP32 parameters keep
            FP32 state).
        moments_rounding: how BF16 moments are rounded when stored. ``"stochastic"``
            (default): seeded stochastic rounding (``sr_seed``), so a moment decays as the FP32
            one does on average, for any beta. ``"nearest"``: round to nearest, which cannot
            move a moment by less than half its ulp: with a beta above ``1 - 2**-9``
            (0.998046875; torch's default beta2 0.999 is) ``exp_avg_sq`` can never shrink and
            the updates shrink instead; a :class:`FrozenMomentWarning` says so. Ignored with
            FP32 moments.
        sr_seed: the seed of the stochastic roundings (``master="stochastic"``, BF16 moments)
            (default: drawn from torch's generator, so ``torch.manual_seed``/``seed_everything``
            fixes it). With a ``torch.distributed`` process group initialized, rank 0's seed is
            taken by every rank (a broadcast while the wrapper is built), so replicas round alike.
            Carried, with its step counter, in the state dict.
        accumulate_fp32: sum the gradients of several backward passes before a step in FP32
            (the default; see "Accumulation" below). It costs two Python hook calls per
            half-precision parameter and backward; ``False`` leaves accumulation to autograd
            (in the half dtype), for a loop known to run one backward per step (the Lightning
            plugin passes ``False`` in automatic optimization with ``accumulate_grad_batches=1``).
        unscaled_model_grads: after a loss scaler's ``unscale_(opt)``, the model's ``p.grad`` show
            the unscaled gradients (rounded to their dtype), as ``torch.amp.GradScaler`` leaves an
            FP32 model's, and what user code changes in them reaches the step, element by element
            (the default). It costs the FP32 master gradients and a copy, once per explicit
            ``unscale_``. ``False`` leaves the model's gradients scaled (the Lightning plugin shows
            them itself where a hook may read them).

    Use it like the optimizer it wraps; a loss scaler's ``unscale_`` on it checks the model's
    half-precision gradients for inf/NaN and makes the unscaled FP32 master gradients
    available::

        opt = MasterWeightOptimizer(torch.optim.AdamW(model.half().parameters(), fused=True))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                                          # optional, for clipping
        torch.nn.utils.clip_grad_norm_(opt.master_params(), max_norm)  # the grads the step uses
        scaler.step(opt)   # updates the masters, then copies them into the model
        scaler.update()

    Gradients (``master="fp32"``). A master's gradient is transient (:class:`MasterParameter`):
    ``None`` outside a step; from ``scaler.unscale_(opt)``, ``opt.sync_grads()`` (no scaler)
    or, without either, the start of ``step()``, until the step ends, it is the model's
    gradient times the unscale factor. Reading ``master.grad`` materializes it in FP32 (the
    bits a copy-then-unscale pass stores); the step then uses it as it is (clipped, edited,
    replaced; ``None`` leaves the parameter out). On the fused CPU path a gradient nobody read
    is never stored in FP32: the Adam kernel reads the half gradient and the factor. So with
    AdamW the training state is 16 bytes per parameter (half weight and gradient, FP32 master
    and two moments), plus 4 per parameter whose master gradient was read, until the step.
    The step frees every master gradient. A read without ``unscale_`` or ``sync_grads()``
    (``clip_grad_norm_(opt.master_params(), c)`` in a plain loop without a scaler) starts the
    same from the model's gradients, so what a read gives is what the step uses.

    Accumulation (several backward passes before a step: Lightning's
    ``accumulate_grad_batches``, or a plain loop): the micro-batch gradients are summed in
    FP32, as in Lightning's ``bf16-mixed``, not in the half dtype; the step uses the FP32 sum
    and the model's gradient holds it rounded once. The sum exists from the second backward of
    a window to the step: 4 bytes per parameter during a window, none when every step has one
    backward (:mod:`amp_plugin.master_weights._accumulate`). Under DDP the all-reduced model
    gradient is used instead.

    The model's gradients. After a loss scaler's ``unscale_(opt)`` they show the unscaled
    values (``unscaled_model_grads``), so torch's AMP recipe (``scaler.unscale_(opt);
    clip_grad_norm_(model.parameters(), c); scaler.step(opt)``) trains as with an FP32 model:
    the clip's edit reaches the FP32 master gradients where it changed a value. Without an
    explicit ``unscale_`` (or with ``unscaled_model_grads=False``) they stay as backward left
    them, scaled; changing them then after the step began (``sync_grads()``, a master
    gradient read) is almost always a mistake: the step warns once (:class:`MasterGradWarning`);
    it then uses a master gradient that was already read as it is, and otherwise the changed
    model gradient, still scaled. ``torch.amp.GradScaler`` is such a case: its ``unscale_``
    reads and unscales the masters' gradients only, so the recipe's
    ``clip_grad_norm_(model.parameters(), c)`` clips scaled values and changes nothing the step
    uses (warned); clip ``opt.master_params()`` with it. A sparse half gradient
    (``nn.Embedding(sparse=True)``) becomes a coalesced sparse FP32 master gradient (duplicates
    summed in FP32), for optimizers that take sparse gradients (SGD, SparseAdam).

    The masters follow the model. Every ``step()`` (and :meth:`master_params`,
    :meth:`state_dict`) first re-copies the master of any half-precision parameter written
    since the wrapper last synchronised it: in-place writes (``weight.zero_()``, ``fill_``,
    ``nn.init``, ``model.load_state_dict``, an EMA/SWA swap with ``copy_``), seen through the
    parameter's ``_version``, and ``param.data = tensor``, seen through its ``data_ptr()``
    (two int reads per parameter per step). Writes through ``param.data.<op>_()`` leave no
    trace: call :meth:`sync_masters` with the parameters written. A write that leaves the weight
    as the FP32 master rounds to (the EMA swap undone, the model's state loaded after the
    optimizer's) keeps the master as it is; ``master="bf16_split"`` cannot tell it from a new
    value (the weight is its master's high half) and clears the remainder: load the model's
    state before the optimizer's. A step writes back only the
    parameters that had a gradient (torch's optimizers leave the others alone), so a frozen
    parameter keeps whatever was written into it.

    ``requires_grad`` of a master is its model parameter's, and setting it sets the model
    parameter's: Lightning's ``toggle_optimizer``, which sets ``requires_grad=False`` on the
    other optimizers' parameters, freezes the model's parameters.

    One model parameter in several wrappers (two optimizers over a shared layer) has one
    master, so every optimizer's update lands. ``step(closure, **kwargs)`` passes ``kwargs``
    to the wrapped optimizer's ``step`` (they send the step the stock way).

    Host syncs: none of its own on the CPU paths beyond reading the found-inf flag (the
    scaler's ``step`` does that, once); on CUDA the step reads no device value (a tensor
    ``lr`` stays on the device).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        fused: bool | str | None = None,
        master: str = "fp32",
        moments_dtype: torch.dtype | None = None,
        sr_seed: int | None = None,
        accumulate_fp32: bool = True,
        moments_rounding: str = "stochastic",
        unscaled_model_grads: bool = True,
    ) -> None:
        if not any(fused is mode or (isinstance(mode, str) and fused == mode) for mode in FUSED_MODES):
            raise TypeError(
                f"fused={fused!r} is not allowed: fused must be None (automatic), True, False, 'torch', 'triton' "
                "or 'compiled'."
            )
        kind, moments = check_wrappable(optimizer, fused, master, moments_dtype)
        check_moments_rounding(optimizer, moments_rounding, moments)
        # torch.optim.Optimizer.__init__ would rebuild param_groups; share the inner ones instead.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.fused = fused
        self.master = master
        self.moments_dtype = moments
        self._kind = kind
        self.moments_rounding = moments_rounding
        # BF16 moments rounded stochastically
        self.sr_moments = moments is torch.bfloat16 and moments_rounding == "stochastic"
        # the stochastic roundings' seed (rank 0's under torch.distributed) and step counter
        self._sr: SRGenerator | None = None
        if master == "stochastic" or self.sr_moments:
            self._sr = SRGenerator(shared_seed(sr_seed))
        elif sr_seed is not None:
            raise ValueError(
                f"sr_seed={sr_seed!r} is not allowed with master={master!r} and moments_dtype={moments}, "
                "which round nothing randomly: sr_seed seeds master='stochastic' and BF16 moments "
                "(moments_rounding='stochastic')."
            )
        self._model_params: list[torch.Tensor] = []
        self._master_params: list[torch.Tensor] = []
        self._half_models: list[torch.Tensor] = []  # the half-precision parameters, in order...
        self._half_masters: list[
            Any
        ] = []  # ...their MasterParameters (placeholders for kinds without an FP32 tensor)...
        self._records: list[Record] = []  # ...and their records
        self._own: list[torch.Tensor] = []  # FP32 parameters: their own master
        self._index_of: dict[int, int] = {}  # id(master) -> its position among the half-precision params
        self._session: GradSession | None = None
        if not isinstance(accumulate_fp32, bool):
            raise TypeError(f"accumulate_fp32={accumulate_fp32!r} is not allowed: it must be True or False.")
        if not isinstance(unscaled_model_grads, bool):
            raise TypeError(f"unscaled_model_grads={unscaled_model_grads!r} is not allowed: it must be True or False.")
        self._unscaled_model_grads = unscaled_model_grads
        self._shown: ShownGrads | None = None  # the model gradients shown unscaled since unscale_
        self._accumulate_fp32 = accumulate_fp32
        self._accumulators: list[Any] = []  # the hooked gradient accumulators it keeps alive (_accumulate.py)
        self._warned_grads = False
        # the step kernels that fit (worked out at the first step; the optimizer's type and parameters do not change)
        self._chosen: list[StepKernel] | None = None
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        # isinstance(wrapper, type(optimizer)) holds, as for Lightning's LightningOptimizer: a callback
        # that checks for the user's class (BaseFinetuning, a scheduler factory) finds it
        self.__class__ = derived(type(self), type(optimizer))
        self._patch_step_function()
        for group in optimizer.param_groups:
            adopt_group(self, group)
        WRAPPED.add(optimizer)

    # ------------------------------------------------------------------ shared state
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def master_params(self) -> list[torch.Tensor]:
        """The masters, in the order the model parameters were given to the optimizer (up to
        date with the model: see the class docstring): FP32 :class:`MasterParameter`s, and the
        FP32 parameters themselves. For the kinds without an FP32 tensor (``"bf16_split"``,
        ``"stochastic"``) the half-precision parameters' masters are placeholders: their
        ``grad`` is the FP32 master gradient (clip it, read it), their values are NaN
        (:meth:`fp32_masters` gives the values)."""
        self._refresh_masters()
        return list(self._master_params)

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters, in the same order as :meth:`master_params`."""
        return list(self._model_params)

    def master_tensors(self) -> list[torch.Tensor]:
        """The tensors that store the half-precision parameters' masters, beyond the model's
        own weights: their FP32 :class:`MasterParameter`s, the int16 remainders with
        ``master="bf16_split"``, none with ``"stochastic"``. What memory accounting should count."""
        return [t for r in self._records for t in self._kind.storage(r)]

    @torch.no_grad()
    def fp32_masters(self) -> list[torch.Tensor]:
        """The FP32 master values of the half-precision parameters, in model order (new tensors):
        the masters, joined from weight and remainder with ``master="bf16_split"``, the weights
        upcast with ``"stochastic"``."""
        self._refresh_masters()
        return [self._kind.fp32(p, r) for p, r in zip(self._half_models, self._records)]

    # ------------------------------------------------------------------ optimizer API
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of model parameters, as ``torch.optim.Optimizer.add_param_group``.

        Raises:
            ValueError: a parameter is already in this optimizer (as torch raises for a
                parameter in two groups), or is a master of a MasterWeightOptimizer.
        """
        add_group(self, param_group)
        self._chosen = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (set to ``None``, or zeroed in place) and drop the
        masters' (transient) gradients. A wrapped optimizer whose class overrides ``zero_grad``
        gets it called first, as without the wrapper (torch's own has nothing left to do here)."""
        if type(self.optimizer).zero_grad is not Optimizer.zero_grad:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        clear_grads(self, set_to_none)

    @torch.no_grad()
    def unscale_grads_(
        self, inv_scale_on: InvScaleOn, amax: dict[torch.device, torch.Tensor] | None = None
    ) -> dict[torch.device, torch.Tensor]:
        """Check the model's gradients for inf/NaN and make ``model_grad * inv_scale`` the
        masters' gradients (see the class docstring); unscale FP32 parameters' gradients in
        place. Called by a loss scaler's ``unscale_``. Returns one found-inf tensor per device.

        Contiguous CPU half gradients are only read (amp_plugin's inf-check kernel); the FP32
        master gradient is materialized if read, and the fused step reads the half gradient. So
        are those the step's fused passes read on any device (``fused="triton"``, ``"compiled"``:
        checked by torch's check-and-unscale op with a factor of one, upcast a slab at a time in
        the step). The others (another device, ``fused=False`` or ``"torch"``) are copied into FP32 and
        unscaled with torch's multi-tensor ops (two per device), freed after the step; sparse
        or strided ones one by one (sparse ones upcast and coalesced first). No host sync.
        With ``amax`` given, the largest magnitude of the still scaled gradients is folded into
        it (one tensor per device, :func:`amp_plugin.scaling.unscale.record_amax`).
        """
        return unscale_grads(self, inv_scale_on, amax)

    def show_unscaled_grads(self) -> None:
        """Write the unscaled gradients into the model's ``p.grad`` (rounded to their dtype) and
        take what user code changes there into the step (see ``unscaled_model_grads``); a loss
        scaler's ``unscale_`` calls it. Nothing happens with ``unscaled_model_grads=False`` or
        outside a step (before ``unscale_``)."""
        if self._unscaled_model_grads and self._session is not None:
            self._shown = show_unscaled(self)

    def sync_grads(self) -> None:
        """Make the model's gradients the masters' gradients (no scaling, no inf check): read
        ``master.grad`` for FP32 copies. ``step()`` does this itself when needed; call it to
        inspect or clip the master gradients before stepping without a loss scaler (a
        disabled scaler's ``unscale_`` calls it)."""
        begin_session(self, None)

    @torch.no_grad()
    def sync_masters(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Copy half-precision model parameters into their masters.

        ``step()`` notices in-place writes and ``param.data = ...`` itself; call this after
        writes it cannot see (``param.data.copy_(...)``, ``param.data.zero_()``). A master re-copied
        from a changed weight loses its FP32 digits below the parameter's precision (an FP32 master
        the weight still rounds to is kept; a ``bf16_split`` remainder is cleared), so name the
        parameters you wrote.

        Args:
            params: the model parameters to re-copy; ``None`` (default): all of them.
        """
        wanted = None if params is None else {id(p) for p in params}
        for model_p, record in zip(self._half_models, self._records):
            if wanted is None or id(model_p) in wanted:
                resync(model_p, record)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        """Update the masters with the wrapped optimizer's rule, then copy them into the model.

        Without a loss scaler in between, the model's gradients are the masters' gradients as
        they are (so a plain loop ``loss.backward(); opt.step()`` works). ``kwargs`` go to the
        wrapped optimizer's ``step`` (they send the step the stock way). Returns the
        closure's loss when a closure is given, else what the wrapped ``step`` returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            end_session(self)  # the closure's backward wrote new gradients
        self._refresh_masters()
        if self._session is not None and self._session.auto:
            self._session.renew_all()  # a master gradient was read, then backward ran again: take the new ones
        if self._shown is not None:
            self._shown.take_edits()  # what user code changed in the unscaled model gradients
        try:
            result = run_step(self, self._session or begin_session(self, None), kwargs)
        finally:
            end_session(self)
        return loss if closure is not None else result

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict (moments in their dtype) plus ``"master_params"``
        (the FP32 values of the half-precision parameters' masters, in model order, whatever
        the kind), ``"master_kind"``, and where something is rounded stochastically
        ``"sr_generator"`` (the rounding's seed and step counter)."""
        return _checkpoint.state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (of any ``master`` kind and moments dtype),
        or a plain one of the wrapped optimizer type (then the masters are re-cast from the
        model's weights). FP32 values this optimizer cannot hold exactly (FP32 moments into BF16
        ones, FP32 masters into ``master="stochastic"``) are rounded to nearest, with a
        :class:`~amp_plugin.master_weights.MasterRoundingWarning` that names them."""
        _checkpoint.load_state_dict(self, state_dict)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled and copied by the wrapped optimizer's class: the class that makes ``isinstance``
        hold is built at run time (:func:`~amp_plugin.master_weights._identity.derived`), so pickle cannot name it."""
        base = getattr(type(self), "_amp_base", type(self))
        return (restore, (base, type(self.optimizer), self.__getstate__()))

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickling for ``ddp_spawn``) leaves out what lives for one step
        (the gradient session, which holds the fused kernels' op namespace, and the shown model
        gradients), the step kernels chosen (worked out again at the next step) and autograd's
        gradient accumulators it keeps alive (nodes of the original's graph, which no copy has)."""
        state = self.__dict__.copy()
        state.update(_session=None, _shown=None, _chosen=None, _accumulators=[])
        return state

    # ------------------------------------------------------------------ internals: gradients (_grads.py, _unscale.py)
    def _warn_grads_changed(self) -> None:
        if not self._warned_grads:
            self._warned_grads = True
            warn_grads_changed(stacklevel=5)

    # ------------------------------------------------------------------ internals: the step (_step.py)
    def _all_cpu(self) -> bool:
        return all(p.device.type == "cpu" for p in self._model_params)

    def _kernel_ops(self) -> Any | None:
        """amp_plugin's CPU kernels, when this wrapper may use them."""
        return _fused.kernels() if self.fused is None or self.fused is True else None

    def _refresh_masters(self) -> None:
        """Re-copy the master of every half-precision parameter written since the last sync."""
        for model_p, record in zip(self._half_models, self._records):
            if model_p._version != record.version or model_p.data_ptr() != record.ptr:
                resync(model_p, record)
