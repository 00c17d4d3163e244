"""FP32 master weights for a model whose parameters are FP16 or BF16.

An update ``lr * g`` smaller than half an ulp of a half-precision weight is rounded away
(``1.0 - 1e-4 == 1.0`` in FP16 and BF16). :class:`MasterWeightOptimizer` keeps an FP32 copy
of every half-precision parameter, lets the wrapped optimizer update the copies, and re-casts
the model's weights from them after each real step.

The wrapper's ``param_groups`` and ``state`` *are* the wrapped optimizer's, holding the FP32
masters, so LR schedulers, fused/foreach kernels and the optimizer state all see FP32.
Parameters that are already FP32 (normalisation layers kept in FP32, for example) are their
own master: no copy is made for them.

On the CPU the step can run as two fused passes (:mod:`amp_plugin.fused`) instead of stock
torch's four: the unscale reads the half gradients and writes the FP32 master gradients with
the inf check, and an Adam/AdamW step writes the rounded weights into the model as it
updates the masters.
"""

from __future__ import annotations

import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer
from torch.utils.weak import WeakIdKeyDictionary

from amp_plugin import fused as _fused
from amp_plugin.fused.adam import (
    adam_ineligible,
    adam_step,
    has_step_hooks,
    unscale_into,
)
from amp_plugin.scaler import unscale_grouped

__all__ = ["MasterGradWarning", "MasterWeightOptimizer"]

_HALF = (torch.float16, torch.bfloat16)


class MasterGradWarning(UserWarning):
    """The model's gradients changed after they were copied into the FP32 master gradients.

    The step uses the master gradients, so the change has no effect. The usual cause is
    ``clip_grad_norm_(model.parameters(), ...)`` after ``scaler.unscale_(optimizer)``: clip
    ``optimizer.master_params()`` instead.
    """


class _Master:
    """The FP32 master of one half-precision model parameter, shared by every
    :class:`MasterWeightOptimizer` over that parameter.

    ``version`` and ``ptr`` are the parameter's ``_version`` and ``data_ptr()`` as they were
    right after the last copy between the two (either way): any in-place write to the
    parameter since then (``zero_()``, ``copy_()``, ``load_state_dict``, an init function)
    changes ``_version``, and ``param.data = other`` changes ``data_ptr()``.
    """

    __slots__ = ("master", "version", "ptr")

    def __init__(self, master: torch.Tensor, version: int, ptr: int) -> None:
        self.master = master
        self.version = version
        self.ptr = ptr


# Model parameter -> its _Master, while the parameter lives: two wrappers over one parameter
# (two optimizers, a GAN's shared layer) share one master, so neither undoes the other's update.
_MASTERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Every master tensor made here, and every optimizer wrapped: what a second wrapper must refuse.
_MASTER_TENSORS: WeakIdKeyDictionary = WeakIdKeyDictionary()
_WRAPPED: weakref.WeakSet = weakref.WeakSet()


class _Bound:
    """What one look at the model's gradients found (see ``_bind_master_grads``)."""

    __slots__ = ("copy_dst", "copy_src", "grads", "index", "kernel_dst", "kernel_src", "sparse", "versions")

    def __init__(self) -> None:
        self.kernel_dst: list[torch.Tensor] = []  # FP32 grad buffers the fused unscale can fill...
        self.kernel_src: list[torch.Tensor] = []  # ...from these contiguous CPU half grads
        self.copy_dst: list[torch.Tensor] = []  # the others: stock copy, then stock unscale
        self.copy_src: list[torch.Tensor] = []
        self.sparse: list[torch.Tensor] = []  # values of sparse FP32 master grads (made fresh)
        self.index: list[int] = []  # the half pairs with a gradient: what the step writes back
        self.grads: list[torch.Tensor] = []  # each model gradient read, and its _version then
        self.versions: list[int] = []


class MasterWeightOptimizer(Optimizer):
    """Wrap an optimizer built over half-precision parameters so it updates FP32 masters.

    Args:
        optimizer: an optimizer (SGD, Adam, AdamW, SparseAdam, fused or foreach, ...)
            constructed over the model's parameters. Its half-precision parameters are
            replaced in its param groups by FP32 master copies; existing optimizer state is
            moved over and upcast. Not ``LBFGS`` (its ``step`` re-evaluates the closure), not
            an optimizer that is already wrapped (``ValueError``).
        fused: the fused CPU kernels of :mod:`amp_plugin.fused`. ``None`` (default): the
            one-pass unscale whenever the kernels are available, and the one-pass Adam step
            when the wrapped optimizer is ``Adam``/``AdamW`` built with ``fused=True`` (the
            same update as torch's fused kernel, bit for bit). ``True``: require both (a
            ``ValueError`` says why not). ``False``: stock torch ops. A parameter or gradient
            the kernels cannot take (not contiguous, sparse) goes the stock way on its own.

    Use it like the optimizer it wraps; a loss scaler's ``unscale_`` on it reads the model's
    half-precision gradients and writes unscaled FP32 master gradients in one call::

        opt = MasterWeightOptimizer(torch.optim.AdamW(model.half().parameters(), fused=True))
        scaler.scale(loss).backward()
        scaler.unscale_(opt)                                          # optional, for clipping
        torch.nn.utils.clip_grad_norm_(opt.master_params(), max_norm)  # the grads the step uses
        scaler.step(opt)   # updates the masters, then copies them into the model
        scaler.update()

    The masters follow the model. Every ``step()`` (and :meth:`master_params`,
    :meth:`state_dict`) first re-copies the master of any half-precision parameter written
    since the wrapper last synchronised it: in-place writes (``weight.zero_()``, ``fill_``,
    ``nn.init``, ``model.load_state_dict``, an EMA/SWA swap with ``copy_``), seen through the
    parameter's ``_version``, and ``param.data = tensor``, seen through its ``data_ptr()``
    (two int reads per parameter per step). Writes through ``param.data.<op>_()`` leave no
    trace: call :meth:`sync_masters` with the parameters written. A step writes back only the parameters that
    had a gradient (torch's optimizers leave the others alone), so a frozen parameter keeps
    whatever was written into it, on the fused and the stock path alike.

    Gradients: the step uses the FP32 master gradients, which ``scaler.unscale_(opt)`` (or
    :meth:`sync_grads`) fills from the model's gradients. Changing the model's gradients
    after that has no effect, so this wrapper does not pretend it does: when the step finds
    a model gradient changed since it was read (its ``_version``, or a new ``.grad``), it
    warns once (:class:`MasterGradWarning`) with the fix, clipping ``opt.master_params()``.
    Writing the unscaled values back into the half gradients instead would cost a pass and
    lose exactly what loss scaling protects (small values flush to zero in FP16). A sparse
    half gradient (``nn.Embedding(sparse=True)``) becomes a coalesced sparse FP32 master
    gradient (duplicates summed in FP32), for optimizers that take sparse gradients (SGD,
    SparseAdam).

    One model parameter in several wrappers (two optimizers over a shared layer) has one
    master, so every optimizer's update lands. ``step(closure, **kwargs)`` passes ``kwargs``
    to the wrapped optimizer's ``step``.
    """

    def __init__(self, optimizer: Optimizer, fused: bool | None = None) -> None:
        if fused not in (None, True, False):
            raise TypeError(f"fused={fused!r} is not allowed: fused must be None (automatic), True or False.")
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
        if optimizer in _WRAPPED or any(p in _MASTER_TENSORS for g in optimizer.param_groups for p in g["params"]):
            raise ValueError(_already_wrapped(type(optimizer).__name__))
        if fused:  # checked before the optimizer's parameters are swapped for masters
            reason = adam_ineligible(optimizer, masters_to_come=True)
            if reason is None and has_step_hooks(optimizer):
                reason = "the wrapped optimizer has step hooks, which the fused step would bypass"
            if reason is None and _fused.kernels() is None:
                reason = f"the kernels are unavailable ({_fused.unavailable_reason()})"
            if reason is not None:
                raise ValueError(f"fused=True is not possible here: {reason}. Use fused=None or False.")
        # torch.optim.Optimizer.__init__ would rebuild param_groups; share the inner ones instead.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._model_params: list[torch.Tensor] = []
        self._master_params: list[torch.Tensor] = []
        self._half_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._half_models: list[torch.Tensor] = []  # the two sides of _half_pairs, for the per-step loops
        self._half_masters: list[torch.Tensor] = []
        self._on_cpu: list[bool] = []  # aligned with _half_pairs: the fused unscale can take its grads
        self._records: list[_Master] = []  # aligned with _half_pairs
        self._own: list[torch.Tensor] = []  # FP32 parameters: their own master
        self._grad_holders: list[torch.Tensor] = []  # every tensor whose .grad zero_grad clears
        self._grads_ready = False
        self._bound = _Bound()
        self._warned_grads = False
        # One FP32 grad buffer per half-precision master (aligned with _half_pairs), made on first
        # use and reused: zero_grad(set_to_none=True) drops the .grad reference, not the memory.
        self._grad_buffers: list[torch.Tensor | None] = []
        self._model_of: dict[int, torch.Tensor] = {}  # id(master) -> its half-precision model param
        self.fused = fused
        # adam_ineligible's verdict, worked out at the first step (and after add_param_group)
        self._fused_params_reason: str | None | _Unchecked = _UNCHECKED
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
        _WRAPPED.add(optimizer)

    # ------------------------------------------------------------------ shared state
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def master_params(self) -> list[torch.Tensor]:
        """The FP32 masters, in the order the model parameters were given to the optimizer
        (up to date with the model: see the class docstring)."""
        self._refresh_masters()
        return list(self._master_params)

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters, in the same order as :meth:`master_params`."""
        return list(self._model_params)

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
        if any(p in _MASTER_TENSORS for p in group["params"]):
            self.optimizer.param_groups.pop()
            raise ValueError(_already_wrapped("the new group"))
        self._adopt_group(group)
        self._fused_params_reason = _UNCHECKED

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the masters' gradients."""
        if set_to_none:
            for p in self._grad_holders:
                p.grad = None
        else:
            dense = []
            for p in self._grad_holders:
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
        self._grads_ready = False

    @torch.no_grad()
    def unscale_grads_(self, inv_scale_on: Callable[[torch.device], torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        """Write ``model_grad * inv_scale`` into FP32 master grads and flag non-finite values.

        Called by a loss scaler's ``unscale_``. Returns one found-inf tensor per device.
        Contiguous CPU half gradients take the fused kernel (when available and allowed), the
        others a stock copy and unscale; sparse ones are upcast and coalesced first.
        """
        bound = self._bind_master_grads()
        found = unscale_grouped(_by_device_dtype(self._own_grads()), inv_scale_on)
        if bound.kernel_dst:
            ops = self._fused_ops()
            if ops is not None:
                cpu = torch.device("cpu")
                found_cpu = found.get(cpu)
                if found_cpu is None:
                    found_cpu = found[cpu] = torch.zeros((), dtype=torch.float32)
                unscale_into(ops, bound.kernel_src, bound.kernel_dst, found_cpu, inv_scale_on(cpu))
            else:
                torch._foreach_copy_(bound.kernel_dst, bound.kernel_src)
                unscale_grouped(_by_device_dtype(bound.kernel_dst), inv_scale_on, found)
        if bound.copy_dst:
            torch._foreach_copy_(bound.copy_dst, bound.copy_src)
            unscale_grouped(_by_device_dtype(bound.copy_dst), inv_scale_on, found)
        if bound.sparse:
            unscale_grouped(_by_device_dtype(bound.sparse), inv_scale_on, found)
        self._grads_ready = True
        return found

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Copy the model's gradients into the FP32 master grads (no scaling, no inf check).

        ``step()`` does this itself when needed; call it to inspect or clip the master
        grads before stepping without a loss scaler (a disabled scaler's ``unscale_`` calls it).
        """
        self._master_grads()

    @torch.no_grad()
    def sync_masters(self, params: Iterable[torch.Tensor] | None = None) -> None:
        """Copy half-precision model parameters into their FP32 masters.

        ``step()`` notices in-place writes and ``param.data = ...`` itself; call this after
        writes it cannot see (``param.data.copy_(...)``, ``param.data.zero_()``). A re-copied
        master loses its FP32 digits below the parameter's precision, so name the parameters
        you wrote.

        Args:
            params: the model parameters to re-copy; ``None`` (default): all of them.
        """
        wanted = None if params is None else {id(p) for p in params}
        for (model_p, _), record in zip(self._half_pairs, self._records):
            if wanted is None or id(model_p) in wanted:
                _resync(model_p, record)

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        """Update the FP32 masters with the wrapped optimizer, then copy them into the model.

        Without a loss scaler in between, the model's gradients are first copied to the
        masters (so a plain loop ``loss.backward(); opt.step()`` works). ``kwargs`` go to the
        wrapped optimizer's ``step`` (they send the step the stock way). Returns the
        closure's loss when a closure is given, else what the wrapped ``step`` returned.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            self._grads_ready = False  # the closure's backward wrote new gradients
        self._refresh_masters()
        if self._grads_ready:
            self._check_grads_unchanged()
        else:
            self._master_grads()
        bound = self._bound
        ops = None if kwargs else self._fused_ops()
        unwritten = None
        if ops is not None and self._fused_step_allowed():
            unwritten = adam_step(ops, self.optimizer, self._model_of)
        if unwritten is not None:
            self.optimizer._opt_called = True  # what an LR scheduler's step tracking records
            result = None
            if unwritten:
                models, masters = zip(*unwritten)
                with torch.no_grad():
                    torch._foreach_copy_(list(models), list(masters))
        else:
            result = self.optimizer.step(**kwargs)
            if bound.index:
                models, masters = self._written(bound.index)
                with torch.no_grad():
                    torch._foreach_copy_(models, masters)
        models, records = self._written(bound.index, self._records)
        for model_p, record in zip(models, records):
            record.version = model_p._version
        self._grads_ready = False
        return loss if closure is not None else result

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"master_params"`` (FP32 copies of the
        half-precision parameters' masters, in model order)."""
        self._refresh_masters()
        state = self.optimizer.state_dict()
        state["master_params"] = [m.detach().clone() for _, m in self._half_pairs]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, or a plain one of the wrapped optimizer
        type (then the masters are re-cast from the model's current weights)."""
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_params", None)
        if masters is not None and len(masters) != len(self._half_pairs):
            raise ValueError(
                f"master_params has {len(masters)} tensors but this optimizer has "
                f"{len(self._half_pairs)} half-precision parameters: the checkpoint belongs to another model."
            )
        self.optimizer.load_state_dict(state_dict)
        if masters is None:
            self.sync_masters()
            return
        with torch.no_grad():
            for (model_p, master), record, saved in zip(self._half_pairs, self._records, masters):
                master.copy_(saved)
                model_p.copy_(master)
                record.version, record.ptr = model_p._version, model_p.data_ptr()

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    # ------------------------------------------------------------------ internals
    def _adopt_group(self, group: dict[str, Any]) -> None:
        params = group["params"]
        for i, p in enumerate(params):
            if p.dtype in _HALF:
                record = _MASTERS.get(p)
                if record is None:
                    master = torch.empty(p.shape, dtype=torch.float32, device=p.device)  # contiguous
                    with torch.no_grad():
                        master.copy_(p)
                    master.requires_grad_(p.requires_grad)
                    record = _MASTERS[p] = _Master(master, p._version, p.data_ptr())
                    _MASTER_TENSORS[master] = True
                else:  # another wrapper holds this parameter: share its master
                    master = record.master
                    _refresh(p, record)
                if p in self.optimizer.state:  # move existing state over, upcast, laid out like the master
                    old = self.optimizer.state.pop(p)
                    self.optimizer.state[master] = {k: _upcast_state(v, p) for k, v in old.items()}
                params[i] = master
                self._half_pairs.append((p, master))
                self._half_models.append(p)
                self._half_masters.append(master)
                self._on_cpu.append(p.device.type == "cpu")  # a parameter's device is fixed (see _resync)
                self._records.append(record)
                self._model_of[id(master)] = p
                self._grad_buffers.append(None)
                self._grad_holders.append(master)
            else:
                master = p
                self._own.append(p)
            self._model_params.append(p)
            self._master_params.append(master)
            self._grad_holders.append(p)

    def _written(self, index: list[int], other: list[Any] | None = None) -> tuple[list[Any], list[Any]]:
        """The model params at ``index`` and the masters (or ``other``) there: the whole lists
        when every half param had a gradient, as in most steps."""
        other = self._half_masters if other is None else other
        if len(index) == len(self._half_models):
            return self._half_models, other
        return [self._half_models[i] for i in index], [other[i] for i in index]

    def _refresh_masters(self) -> None:
        """Re-copy the master of every half-precision parameter written since the last sync."""
        for model_p, record in zip(self._half_models, self._records):
            if model_p._version != record.version or model_p.data_ptr() != record.ptr:
                _resync(model_p, record)

    def _check_grads_unchanged(self) -> None:
        """Warn (once) when a model gradient changed after it was copied into the masters."""
        if self._warned_grads:
            return
        bound, models = self._bound, self._half_models
        for i, grad, version in zip(bound.index, bound.grads, bound.versions):
            if models[i].grad is not grad or grad._version != version:
                self._warned_grads = True
                warnings.warn(
                    "The model's gradients were changed after scaler.unscale_(optimizer) (or "
                    "optimizer.sync_grads()) copied them into the FP32 master gradients, which are what "
                    "the step uses: the change has no effect. To clip, clip the master gradients between "
                    "unscale_ and step: torch.nn.utils.clip_grad_norm_(optimizer.master_params(), max_norm). "
                    "(Warned once per optimizer.)",
                    MasterGradWarning,
                    stacklevel=4,
                )
                return

    def _fused_ops(self) -> Any | None:
        return None if self.fused is False else _fused.kernels()

    def _fused_step_allowed(self) -> bool:
        """The fused Adam step applies: asked for, or every group was built with fused=True."""
        if not (self.fused or all(group.get("fused") for group in self.optimizer.param_groups)):
            return False
        if self._fused_params_reason is _UNCHECKED:  # the optimizer's type and parameters do not change
            self._fused_params_reason = adam_ineligible(self.optimizer)
        return self._fused_params_reason is None and not has_step_hooks(self.optimizer)

    def _own_grads(self) -> list[torch.Tensor]:
        """The gradients of the FP32 parameters (their own master) to unscale in place: the
        values of a sparse one (as torch.amp.GradScaler unscales them)."""
        grads = []
        for p in self._own:
            g = p.grad
            if g is not None:
                grads.append(g._values() if g.is_sparse else g)
        return grads

    def _master_grads(self) -> None:
        """Fill the FP32 master grads from the model's grads (a copy for half params; FP32
        params hold their own), unscaled."""
        bound = self._bind_master_grads()
        if bound.kernel_dst or bound.copy_dst:
            with torch.no_grad():
                torch._foreach_copy_(bound.kernel_dst + bound.copy_dst, bound.kernel_src + bound.copy_src)
        self._grads_ready = True

    def _bind_master_grads(self) -> _Bound:
        """Point each half-precision param's master ``.grad`` at its reused FP32 buffer (a new
        sparse FP32 tensor for a sparse gradient); return what to fill from where.

        Runs every step on the host, so it is one plain loop over the half-precision pairs
        (FP32 parameters already hold their own gradient).
        """
        bound = self._bound = _Bound()
        buffers, on_cpu = self._grad_buffers, self._on_cpu
        index, grads, versions = bound.index, bound.grads, bound.versions
        kernel_dst, kernel_src = bound.kernel_dst, bound.kernel_src
        kernels = self._fused_ops() is not None
        for i, (model_p, master) in enumerate(self._half_pairs):
            g = model_p.grad
            if g is None:
                if master.grad is not None:
                    master.grad = None
                continue
            index.append(i)
            grads.append(g)
            versions.append(g._version)
            if g.is_sparse:
                with torch.no_grad():
                    master.grad = sparse = g.to(torch.float32).coalesce()  # duplicates summed in FP32
                bound.sparse.append(sparse._values())
                continue
            buffer = buffers[i]
            if buffer is None:  # laid out like the master (contiguous), which never changes shape
                buffer = buffers[i] = torch.empty_like(master)
            if master.grad is not buffer:
                master.grad = buffer
            if kernels and on_cpu[i] and g.is_contiguous():
                kernel_dst.append(buffer)
                kernel_src.append(g)
            else:
                bound.copy_dst.append(buffer)
                bound.copy_src.append(g)
        return bound


class _Unchecked:
    pass


_UNCHECKED = _Unchecked()


def _already_wrapped(what: str) -> str:
    return (
        f"{what} is already wrapped: its parameters are the FP32 masters of a MasterWeightOptimizer (or "
        "it was wrapped before), so a second wrapper would update masters that never reach the model. Use "
        "the MasterWeightOptimizer you already built (it is a torch.optim.Optimizer: give it to the LR "
        "scheduler, return it from configure_optimizers) instead of its .optimizer, or build a new "
        "optimizer over the model's parameters and wrap it once."
    )


def _upcast_state(value: Any, param: torch.Tensor) -> Any:
    if not torch.is_tensor(value):
        return value
    if value.shape == param.shape and value.dim() > 0:  # per-element state: laid out like the master
        return value.to(torch.float32 if value.dtype in _HALF else value.dtype, memory_format=torch.contiguous_format)
    return value.float() if value.dtype in _HALF else value


def _refresh(model_p: torch.Tensor, record: _Master) -> None:
    if model_p._version != record.version or model_p.data_ptr() != record.ptr:
        _resync(model_p, record)


@torch.no_grad()
def _resync(model_p: torch.Tensor, record: _Master) -> None:
    """Copy the model parameter into its master (after a write the wrapper did not make)."""
    master = record.master
    if model_p.dtype not in _HALF or model_p.shape != master.shape or model_p.device != master.device:
        raise RuntimeError(
            f"A model parameter wrapped by MasterWeightOptimizer changed from {tuple(master.shape)} "
            f"half precision on {master.device} to {model_p.dtype} {tuple(model_p.shape)} on {model_p.device} "
            "(param.data = ..., or model.float()/.to() after the optimizer was built): its FP32 master "
            "and optimizer state no longer fit. Convert or resize the model first, then build the "
            "optimizer and the MasterWeightOptimizer."
        )
    master.copy_(model_p)
    record.version, record.ptr = model_p._version, model_p.data_ptr()


def _by_device_dtype(grads: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups
