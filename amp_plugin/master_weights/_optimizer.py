""":class:`MasterWeightOptimizer`: an optimizer over half-precision parameters that updates
FP32 masters (see the package docstring)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch.optim import Optimizer

from amp_plugin import fused as _fused
from amp_plugin.dtypes import HALF_DTYPES
from amp_plugin.fused import adam as _adam
from amp_plugin.master_weights import _split
from amp_plugin.master_weights._grads import (
    GradSession,
    eager_unscale,
    unscaled_copy,
    warn_grads_changed,
)
from amp_plugin.master_weights._multi_tensor import torch_adam_step
from amp_plugin.master_weights._parameter import (
    MASTER_TENSORS,
    MASTERS,
    WRAPPED,
    MasterParameter,
    Record,
    refresh,
    resync,
    set_grad,
)
from amp_plugin.master_weights._refusals import (
    already_wrapped,
    by_device_dtype,
    check_fused_possible,
    check_split_possible,
    flag,
    refuse_dtensors,
    unscale_in_place,
    upcast_state,
)
from amp_plugin.scaler import unscale_grouped

__all__ = ["FUSED_MODES", "MASTER_KINDS", "MasterWeightOptimizer"]

MASTER_KINDS = ("fp32", "bf16_split")
FUSED_MODES = (None, True, False, "torch")
InvScaleOn = Callable[[torch.device], torch.Tensor]


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
              torch's multi-tensor kernels end to end (``fused="torch"``).
            - ``True``: require amp_plugin's kernels and the one-pass Adam step (a
              ``ValueError`` says why not).
            - ``"torch"``: torch's kernels, any device: a multi-tensor copy-and-unscale into
              FP32 gradients, torch's fused Adam/AdamW on the masters, a multi-tensor copy
              into the model (requires ``Adam``/``AdamW``; ``ValueError`` otherwise).
            - ``False``: stock torch ops: copy and unscale, then the wrapped optimizer's own
              ``step()``, then a copy into the model.

            Every path computes the same masters, bit for bit. A parameter or gradient a
            kernel cannot take (not contiguous, sparse) goes the stock way.
        master: how the masters are stored.

            - ``"fp32"`` (default): an FP32 tensor per half parameter (4 bytes per parameter);
              the model's weight is the master rounded to nearest.
            - ``"bf16_split"``: for a BF16 model and ``Adam``/``AdamW``: the master's high 16
              bits *are* the model's BF16 weight and a 16-bit extension holds the low 16 (2
              bytes per parameter: AdamW's training state is 14 bytes per parameter instead of
              16). The masters evolve exactly as FP32 masters do given the same gradients,
              but the model's weight is the master truncated toward zero, not rounded (see
              :mod:`amp_plugin.master_weights._split`). The step always runs torch's fused
              Adam update (amp_plugin's kernel on the CPU, torch's kernel elsewhere). The
              param groups hold the model's BF16 parameters themselves (there is no FP32
              tensor): ``master_params()`` returns them, a loss scaler unscales their
              gradients in place (exact for power-of-two scales: BF16 has FP32's range), and
              ``state_dict()["master_params"]`` holds the joined FP32 masters, so checkpoints
              move between the two kinds. FP16 parameters are refused (``ValueError``).

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
    The step frees every master gradient.

    The model's gradients stay as backward left them: scaled. Changing them after
    ``unscale_`` is almost always a mistake (``clip_grad_norm_(model.parameters())`` from
    the plain-AMP recipe): the step warns once (:class:`MasterGradWarning`); it then uses a
    master gradient that was already read as it is, and otherwise the changed model
    gradient, still scaled. A sparse half gradient (``nn.Embedding(sparse=True)``) becomes a
    coalesced sparse FP32 master gradient (duplicates summed in FP32), for optimizers that
    take sparse gradients (SGD, SparseAdam).

    The masters follow the model. Every ``step()`` (and :meth:`master_params`,
    :meth:`state_dict`) first re-copies the master of any half-precision parameter written
    since the wrapper last synchronised it: in-place writes (``weight.zero_()``, ``fill_``,
    ``nn.init``, ``model.load_state_dict``, an EMA/SWA swap with ``copy_``), seen through the
    parameter's ``_version``, and ``param.data = tensor``, seen through its ``data_ptr()``
    (two int reads per parameter per step). Writes through ``param.data.<op>_()`` leave no
    trace: call :meth:`sync_masters` with the parameters written. A step writes back only the
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

    def __init__(self, optimizer: Optimizer, fused: bool | str | None = None, master: str = "fp32") -> None:
        if not any(fused is mode or (isinstance(mode, str) and fused == mode) for mode in FUSED_MODES):
            raise TypeError(f"fused={fused!r} is not allowed: fused must be None (automatic), True, False or 'torch'.")
        if master not in MASTER_KINDS:
            raise ValueError(f"master={master!r} is not allowed: master must be 'fp32' or 'bf16_split'.")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer={type(optimizer).__name__} is not allowed: MasterWeightOptimizer wraps a "
                "torch.optim.Optimizer."
            )
        if isinstance(optimizer, MasterWeightOptimizer):
            raise TypeError("optimizer is already a MasterWeightOptimizer: wrap the inner optimizer once.")
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "optimizer=LBFGS is not allowed: LBFGS evaluates its closure several times inside one "
                "step() and updates the parameters between evaluations, but MasterWeightOptimizer copies "
                "the FP32 masters into the model once per step, so every evaluation would see stale "
                "weights. Run LBFGS on an FP32 model without MasterWeightOptimizer, or use a first-order "
                "optimizer (SGD, Adam, AdamW) with master weights."
            )
        refuse_dtensors(optimizer)
        if optimizer in WRAPPED or any(p in MASTER_TENSORS for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(already_wrapped(type(optimizer).__name__))
        if fused is True or fused == "torch":  # checked before the optimizer's parameters are swapped for masters
            check_fused_possible(optimizer, fused)
        if master == "bf16_split":
            check_split_possible(optimizer)
        # torch.optim.Optimizer.__init__ would rebuild param_groups; share the inner ones instead.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.fused = fused
        self.master = master
        self._model_params: list[torch.Tensor] = []
        self._master_params: list[torch.Tensor] = []
        self._half_models: list[torch.Tensor] = []  # the half-precision parameters, in order...
        self._half_masters: list[Any] = []  # ...their MasterParameters (master="fp32")...
        self._records: list[Record] = []  # ...and their records
        self._own: list[torch.Tensor] = []  # FP32 parameters: their own master
        self._index_of: dict[int, int] = {}  # id(master) -> its position among the half-precision params
        self._low_bits_of: dict[int, torch.Tensor] = {}  # master="bf16_split": id(param) -> its low 16 bits
        self._session: GradSession | None = None
        self._warned_grads = False
        # adam_ineligible's verdicts (amp_plugin's kernels, torch's), worked out at the first step
        self._reasons: dict[str, str | None] = {}
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, OrderedDict())
        self._patch_step_function()
        for group in optimizer.param_groups:
            self._adopt_group(group)
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
        FP32 parameters themselves. With ``master="bf16_split"``: the model's parameters
        (the BF16 ones hold the masters' high halves; :meth:`fp32_masters` joins them)."""
        self._refresh_masters()
        return list(self._master_params)

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters, in the same order as :meth:`master_params`."""
        return list(self._model_params)

    def master_tensors(self) -> list[torch.Tensor]:
        """The tensors that store the half-precision parameters' masters, beyond the model's
        own weights: their FP32 :class:`MasterParameter`s, or, with ``master="bf16_split"``,
        the int16 extensions (the masters' low 16 bits). What memory accounting should count."""
        if self.master == "bf16_split":
            return cast("list[torch.Tensor]", [r.low_bits for r in self._records])  # set for split masters
        return list(self._half_masters)

    @torch.no_grad()
    def fp32_masters(self) -> list[torch.Tensor]:
        """The FP32 master values of the half-precision parameters, in model order: copies,
        joined from the two halves with ``master="bf16_split"``, detached clones otherwise."""
        self._refresh_masters()
        if self.master == "bf16_split":
            # low_bits is set for split masters
            return [_split.join(p, cast(torch.Tensor, r.low_bits)) for p, r in zip(self._half_models, self._records)]
        return [m.detach().clone() for m in self._half_masters]

    # ------------------------------------------------------------------ optimizer API
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of model parameters, as ``torch.optim.Optimizer.add_param_group``.

        Raises:
            ValueError: a parameter is already in this optimizer (as torch raises for a
                parameter in two groups), or is a master of a MasterWeightOptimizer.
        """
        self.optimizer.add_param_group(param_group)
        group = self.optimizer.param_groups[-1]
        held = {id(t) for t in (*self._model_params, *self._master_params)}
        if any(id(p) in held for p in group["params"]):
            self.optimizer.param_groups.pop()
            raise ValueError(
                "some parameters appear in more than one parameter group: the new group repeats a parameter "
                "this MasterWeightOptimizer already holds (as a model parameter or as its FP32 master). Give "
                "each parameter to one group only."
            )
        if any(p in MASTER_TENSORS for p in group["params"]):
            self.optimizer.param_groups.pop()
            raise ValueError(already_wrapped("the new group"))
        try:
            refuse_dtensors(self.optimizer)
            if self.master == "bf16_split":
                check_split_possible(self.optimizer)
        except (TypeError, ValueError):
            self.optimizer.param_groups.pop()
            raise
        self._adopt_group(group)
        self._reasons.clear()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients (set to ``None``, or zeroed in place) and drop the
        masters' (transient) gradients."""
        self._end_session()
        if set_to_none:
            for p in self._model_params:
                p.grad = None
            return
        dense = []
        for p in self._model_params:
            g = p.grad
            if g is None:
                continue
            g.detach_()
            if g.is_sparse:
                g.zero_()
            else:
                dense.append(g)
        if dense:
            torch._foreach_zero_(dense)

    @torch.no_grad()
    def unscale_grads_(self, inv_scale_on: InvScaleOn) -> dict[torch.device, torch.Tensor]:
        """Check the model's gradients for inf/NaN and make ``model_grad * inv_scale`` the
        masters' gradients (see the class docstring); unscale FP32 parameters' gradients in
        place. Called by a loss scaler's ``unscale_``. Returns one found-inf tensor per device.

        Contiguous CPU half gradients are only read (amp_plugin's inf-check kernel); the FP32
        master gradient is materialized if read, and the fused step reads the half gradient.
        The others (another device, ``fused=False`` or ``"torch"``) are copied into FP32 and
        unscaled with torch's multi-tensor ops (two per device), freed after the step; sparse
        or strided ones one by one (sparse ones upcast and coalesced first). No host sync.
        """
        if self.master == "bf16_split":  # the BF16 gradients are unscaled in place, exactly
            return unscale_in_place(self.optimizer, inv_scale_on)
        session = self._begin_session(inv_scale_on)
        found = unscale_grouped(by_device_dtype(self._own_grads()), inv_scale_on)
        ops = self._kernel_ops()
        checked, eager, single = [], [], []
        for i, grad in enumerate(session.grads):
            if grad is None:
                continue
            if grad.is_sparse or not grad.is_contiguous():
                single.append(i)  # one by one: a coalesced sparse copy, or a contiguous one
            elif ops is not None and grad.is_cpu and grad.dtype in HALF_DTYPES:
                checked.append(grad)  # stays pending: the step reads it
            else:
                eager.append(i)
        if checked:
            _adam.nonfinite_check(ops, checked, flag(found, torch.device("cpu")))
        grads = cast("list[torch.Tensor]", session.grads)  # at the indices in eager and single: not None
        devices = {grads[i].device for i in eager}
        for device in devices:
            index = eager if len(devices) == 1 else [i for i in eager if grads[i].device == device]
            copies = eager_unscale([grads[i] for i in index], inv_scale_on(device), flag(found, device), ops)
            session.eager.update(zip(index, copies))
        for i in single:
            grad = grads[i]
            out = unscaled_copy(grad, None)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [out._values() if out.is_sparse else out], flag(found, grad.device), inv_scale_on(grad.device)
            )
            session.eager[i] = out
        return found

    def sync_grads(self) -> None:
        """Make the model's gradients the masters' gradients (no scaling, no inf check): read
        ``master.grad`` for FP32 copies. ``step()`` does this itself when needed; call it to
        inspect or clip the master gradients before stepping without a loss scaler (a
        disabled scaler's ``unscale_`` calls it)."""
        if self.master != "bf16_split":
            self._begin_session(None)

    @torch.no_grad()
    def sync_masters(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Copy half-precision model parameters into their masters.

        ``step()`` notices in-place writes and ``param.data = ...`` itself; call this after
        writes it cannot see (``param.data.copy_(...)``, ``param.data.zero_()``). A re-copied
        master loses its FP32 digits below the parameter's precision, so name the parameters
        you wrote.

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
            self._end_session()  # the closure's backward wrote new gradients
        self._refresh_masters()
        try:
            if self.master == "bf16_split":
                self._step_split(kwargs)
                result = None
            else:
                result = self._step(self._session or self._begin_session(None), kwargs)
        finally:
            self._end_session()
        return loss if closure is not None else result

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"master_params"`` (FP32 copies of the
        half-precision parameters' masters, in model order)."""
        self._refresh_masters()
        state = self.optimizer.state_dict()
        state["master_params"] = self.fp32_masters()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict` (of either ``master`` kind), or a plain one
        of the wrapped optimizer type (then the masters are re-cast from the model's weights)."""
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_params", None)
        if masters is not None and len(masters) != len(self._half_models):
            raise ValueError(
                f"master_params has {len(masters)} tensors but this optimizer has "
                f"{len(self._half_models)} half-precision parameters: the checkpoint belongs to another model."
            )
        self._end_session()
        self.optimizer.load_state_dict(state_dict)
        if self.master == "bf16_split":
            self._restore_fp32_moments(state_dict)
        if masters is None:
            self.sync_masters()
            return
        with torch.no_grad():
            for model_p, record, saved in zip(self._half_models, self._records, masters):
                if record.master is not None:
                    record.master.copy_(saved)
                    model_p.copy_(record.master)
                else:
                    low_bits = cast(torch.Tensor, record.low_bits)  # a split master's
                    _split.split_into(saved.to(model_p.device, torch.float32), model_p, low_bits)
                record.version, record.ptr = model_p._version, model_p.data_ptr()

    def _restore_fp32_moments(self, state_dict: dict[str, Any]) -> None:
        """torch's ``load_state_dict`` casts floating state to each parameter's dtype: BF16 for
        split masters, whose moments are FP32. Take them again from ``state_dict``, exactly."""
        saved_state = state_dict.get("state", {})
        for group, saved_group in zip(self.optimizer.param_groups, state_dict.get("param_groups", [])):
            for p, index in zip(group["params"], saved_group["params"]):
                if p.dtype is not torch.bfloat16 or index not in saved_state:
                    continue
                state = self.optimizer.state[p]
                for key, value in saved_state[index].items():
                    if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                        state[key] = value.to(device=p.device, dtype=torch.float32, copy=True)

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    # ------------------------------------------------------------------ internals: setup
    def _adopt_group(self, group: dict[str, Any]) -> None:
        params = group["params"]
        split = self.master == "bf16_split"
        for i, p in enumerate(params):
            if p.dtype in HALF_DTYPES:
                record = MASTERS.get(p)
                if record is None:
                    master = None if split else MasterParameter.of(p)
                    low = (
                        torch.zeros_like(p, dtype=torch.int16, memory_format=torch.contiguous_format) if split else None
                    )
                    record = MASTERS[p] = Record(master, low, p._version, p.data_ptr())
                    if master is not None:
                        MASTER_TENSORS[master] = True
                else:  # another wrapper holds this parameter: share its master
                    if (record.master is None) != split:
                        raise ValueError(
                            f"master={self.master!r} is not possible for a parameter another MasterWeightOptimizer "
                            f"holds with master={'bf16_split' if record.master is None else 'fp32'!r}: one master "
                            "per parameter. Give every optimizer over it the same master kind."
                        )
                    refresh(p, record)
                master = p if split else record.master
                if not split and p in self.optimizer.state:  # move existing state over, upcast
                    self.optimizer.state[master] = self.optimizer.state.pop(p)
                if master in self.optimizer.state:
                    old = self.optimizer.state[master]
                    self.optimizer.state[master] = {k: upcast_state(v, p) for k, v in old.items()}
                params[i] = master
                self._half_models.append(p)
                self._half_masters.append(master)
                self._records.append(record)
                if split:
                    self._low_bits_of[id(p)] = record.low_bits
                else:
                    self._index_of[id(master)] = len(self._half_models) - 1
            else:
                master = p
                self._own.append(p)
            self._model_params.append(p)
            self._master_params.append(master)

    # ------------------------------------------------------------------ internals: gradients
    def _begin_session(self, inv_scale_on: InvScaleOn | None) -> GradSession:
        """Start a step's gradients: note the model's, make each master's pending."""
        self._end_session()
        grads = [p.grad for p in self._half_models]
        session = self._session = GradSession(self, inv_scale_on, grads, self._kernel_ops())
        for i, (master, grad) in enumerate(zip(self._half_masters, grads)):
            if master._amp_grad is not None:  # set outside a step: the model's gradient replaces it
                set_grad(master, None)
            master._amp_pending = None if grad is None else (session, i)
        return session

    def _end_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.end()

    def _warn_grads_changed(self) -> None:
        if not self._warned_grads:
            self._warned_grads = True
            warn_grads_changed(stacklevel=5)

    def _own_grads(self) -> list[torch.Tensor]:
        """The gradients of the FP32 parameters (their own master) to unscale in place: the
        values of a sparse one (as torch.amp.GradScaler unscales them)."""
        grads = []
        for p in self._own:
            g = p.grad
            if g is not None:
                grads.append(g._values() if g.is_sparse else g)
        return grads

    def _step_grads(self, session: GradSession) -> tuple[list[torch.Tensor | None], list[int]]:
        """What the step uses per half parameter (by index): an FP32 gradient (materialized,
        set, computed ahead) or, for the pending ones, the model's half gradient; ``None``:
        not stepped. And the indices of the pending ones."""
        grads: list[torch.Tensor | None] = []
        pending: list[int] = []
        touched, seen, versions, eager = session.touched, session.grads, session.versions, session.eager
        for i, (model, master) in enumerate(zip(self._half_models, self._half_masters)):
            slot = master._amp_grad
            if slot is not None or seen[i] is None or i in touched:
                grads.append(slot)
                continue
            grad = model.grad
            # seen[i] is not None here, so `grad is None` adds no case to `grad is not seen[i]`: it only
            # narrows grad for the type checker (cheaper than a cast() call per parameter)
            if grad is None or grad is not seen[i] or grad._version != versions[i]:
                self._warn_grads_changed()
                if grad is not None:
                    pending.append(i)
            elif i in eager:
                grad = eager[i]
            else:
                pending.append(i)
            grads.append(grad)
        return grads, pending

    def _to_fp32(
        self, session: GradSession, grads: list[torch.Tensor | None], pending: list[int], only_unreadable: bool = False
    ) -> None:
        """Replace the pending half gradients in ``grads`` by FP32 master gradients: one
        multi-tensor copy (and unscale) per device, sparse or strided ones one by one
        (``only_unreadable``: just those the CPU kernel cannot read)."""
        batch: list[int] = []
        present = cast("list[torch.Tensor]", grads)  # the same list: not None at the indices in pending
        for i in pending:
            grad = present[i]
            if (
                grad.is_sparse
                or not grad.is_contiguous()
                or grad.dtype not in HALF_DTYPES
                or (only_unreadable and not grad.is_cpu)
            ):
                grads[i] = unscaled_copy(grad, session.inv_on(grad.device), session.ops)
            elif not only_unreadable:
                batch.append(i)
        for device in {present[i].device for i in batch}:
            index = [i for i in batch if present[i].device == device]
            copies = eager_unscale([present[i] for i in index], session.inv_on(device), None, session.ops)
            for i, copy in zip(index, copies):
                grads[i] = copy

    # ------------------------------------------------------------------ internals: the step
    def _step(self, session: GradSession, kwargs: dict[str, Any]) -> Any:
        grads, pending = self._step_grads(session)
        path = self._path(kwargs)
        masters, models = self._half_masters, self._half_models
        if path == "kernels":
            self._to_fp32(session, grads, pending, only_unreadable=True)
            inv = session.inv_on(torch.device("cpu"))
            unwritten = _adam.adam_step(
                self._kernel_ops(), self.optimizer, grads, self._index_of, models, 1.0 if inv is None else float(inv)
            )
            if unwritten is not None:
                # what an LR scheduler's step tracking records (torch's private flag, not in the stubs)
                self.optimizer._opt_called = True  # type: ignore[attr-defined]
                self._copy_into_model(unwritten)
                self._record_versions(grads)
                return None
            pending = [i for i in pending if (g := grads[i]) is not None and g.dtype in HALF_DTYPES]
        self._to_fp32(session, grads, pending)
        result = None
        if path == "torch":
            torch_adam_step(self.optimizer, grads, self._index_of)
            self.optimizer._opt_called = True  # type: ignore[attr-defined]  # torch's private flag (see above)
        else:  # the wrapped optimizer's own step reads the masters' .grad
            touched = session.touched
            for i, (master, grad) in enumerate(zip(masters, grads)):
                if grad is not None and master._amp_grad is not grad:
                    set_grad(master, grad)
                    touched.add(i)
            result = self.optimizer.step(**kwargs)
        self._copy_into_model([(models[i], masters[i]) for i, grad in enumerate(grads) if grad is not None])
        self._record_versions(grads)
        return result

    def _step_split(self, kwargs: dict[str, Any]) -> None:
        if kwargs:
            raise TypeError(
                f"step() got keyword arguments {sorted(kwargs)}, but with master='bf16_split' the wrapped "
                "optimizer's step() is not called (the split masters are stepped by amp_plugin's Adam kernel), "
                "so there is nothing to pass them to."
            )
        if _adam.has_step_hooks(self.optimizer):
            raise RuntimeError(
                "The wrapped optimizer has step hooks, but with master='bf16_split' its step() is not called, "
                "so they would not run: register them on the MasterWeightOptimizer instead "
                "(opt.register_step_pre_hook / register_step_post_hook)."
            )
        ops = self._kernel_ops()
        done = ops is not None and _adam.split_adam_step(ops, self.optimizer, self._low_bits_of)
        if not done:
            _split.step_with_torch_ops(self.optimizer, self._low_bits_of)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]  # torch's private flag (see _step)
        for model_p, record in zip(self._half_models, self._records):
            if model_p.grad is not None:
                record.version, record.ptr = model_p._version, model_p.data_ptr()

    def _copy_into_model(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        if pairs:
            models, masters = zip(*pairs)
            with torch.no_grad():
                torch._foreach_copy_(list(models), list(masters))

    def _record_versions(self, grads: list[torch.Tensor | None]) -> None:
        for model_p, grad, record in zip(self._half_models, grads, self._records):
            if grad is not None:
                record.version = model_p._version

    def _kernel_ops(self) -> Any | None:
        """amp_plugin's CPU kernels, when this wrapper may use them."""
        return _fused.kernels() if self.fused is None or self.fused is True else None

    def _path(self, kwargs: dict[str, Any]) -> str:
        """The step: ``"kernels"`` (amp_plugin's one-pass Adam), ``"torch"`` (torch's
        multi-tensor kernels) or ``"stock"`` (the wrapped optimizer's own step)."""
        if kwargs or self.fused is False or _adam.has_step_hooks(self.optimizer):
            return "stock"
        if not (self.fused is True or self.fused == "torch" or all(g.get("fused") for g in self.param_groups)):
            return "stock"  # the user chose torch's for-loop/foreach Adam (or another optimizer)
        if self.fused != "torch" and self._reason("kernels") is None and self._kernel_ops() is not None:
            return "kernels"
        if (self.fused == "torch" or (self.fused is None and not self._all_cpu())) and self._reason("torch") is None:
            return "torch"
        return "stock"

    def _reason(self, kind: str) -> str | None:
        if kind not in self._reasons:  # the optimizer's type and parameters do not change
            self._reasons[kind] = _adam.adam_ineligible(
                self.optimizer, device_type="cpu" if kind == "kernels" else None
            )
        return self._reasons[kind]

    def _all_cpu(self) -> bool:
        if "all_cpu" not in self._reasons:
            self._reasons["all_cpu"] = None if all(p.device.type == "cpu" for p in self._model_params) else "no"
        return self._reasons["all_cpu"] is None

    def _refresh_masters(self) -> None:
        """Re-copy the master of every half-precision parameter written since the last sync."""
        for model_p, record in zip(self._half_models, self._records):
            if model_p._version != record.version or model_p.data_ptr() != record.ptr:
                resync(model_p, record)
