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

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from amp_plugin import fused as _fused
from amp_plugin.fused.adam import adam_ineligible, adam_step, has_step_hooks, unscale_fits, unscale_into
from amp_plugin.scaler import unscale_grouped

__all__ = ["MasterWeightOptimizer"]

_HALF = (torch.float16, torch.bfloat16)


class _Unchecked:
    pass


_UNCHECKED = _Unchecked()


class MasterWeightOptimizer(Optimizer):
    """Wrap an optimizer built over half-precision parameters so it updates FP32 masters.

    Args:
        optimizer: an optimizer (SGD, Adam, AdamW, fused or foreach, ...) constructed over the
            model's parameters. Its half-precision parameters are replaced in its param groups
            by FP32 master copies; existing optimizer state is moved over and upcast.
        fused: the fused CPU kernels of :mod:`amp_plugin.fused`. ``None`` (default): the
            one-pass unscale whenever the kernels are available, and the one-pass Adam step
            when the wrapped optimizer is ``Adam``/``AdamW`` built with ``fused=True`` (same
            update as torch's fused kernel, to the last bit on all but a few elements in 10^5).
            ``True``: require both (a ``ValueError`` says why not). ``False``: stock torch ops.

    Use it like the optimizer it wraps; a loss scaler's ``unscale_`` on it reads the model's
    half-precision gradients and writes unscaled FP32 master gradients in one call::

        opt = MasterWeightOptimizer(torch.optim.AdamW(model.half().parameters(), fused=True))
        scaler.scale(loss).backward()
        scaler.step(opt)   # updates the masters, then copies them into the model
        scaler.update()
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
        # torch.optim.Optimizer.__init__ would rebuild param_groups; share the inner ones instead.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self._model_params: list[torch.Tensor] = []
        self._master_params: list[torch.Tensor] = []
        self._half_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._grad_holders: list[torch.Tensor] = []  # every tensor whose .grad zero_grad clears
        self._grads_ready = False
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
        if fused:
            reason = adam_ineligible(optimizer)
            if reason is None and has_step_hooks(optimizer):
                reason = "the wrapped optimizer has step hooks, which the fused step would bypass"
            if reason is None and _fused.kernels() is None:
                reason = f"the kernels are unavailable ({_fused.unavailable_reason()})"
            if reason is not None:
                raise ValueError(f"fused=True is not possible here: {reason}. Use fused=None or False.")

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
        """The FP32 masters, in the order the model parameters were given to the optimizer."""
        return list(self._master_params)

    def model_params(self) -> list[torch.Tensor]:
        """The model's parameters, in the same order as :meth:`master_params`."""
        return list(self._model_params)

    # ------------------------------------------------------------------ optimizer API
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._adopt_group(self.optimizer.param_groups[-1])
        self._fused_params_reason = _UNCHECKED

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients and the masters' gradients."""
        if set_to_none:
            for p in self._grad_holders:
                p.grad = None
        else:
            grads = [p.grad for p in self._grad_holders if p.grad is not None]
            for g in grads:
                g.detach_()
            if grads:
                torch._foreach_zero_(grads)
        self._grads_ready = False

    @torch.no_grad()
    def unscale_grads_(self, inv_scale_on: Callable[[torch.device], torch.Tensor]) -> dict[torch.device, torch.Tensor]:
        """Write ``model_grad * inv_scale`` into FP32 master grads and flag non-finite values.

        Called by a loss scaler's ``unscale_``. Returns one found-inf tensor per device.
        """
        ops = self._fused_ops()
        buffers, half_grads = bound = self._bind_master_grads()
        if ops is not None and unscale_fits(half_grads, buffers):
            # FP32 parameters (their own master) in place, the half ones in one fused pass each
            own = [p.grad for p, m in zip(self._model_params, self._master_params) if p is m and p.grad is not None]
            found = unscale_grouped(_by_device_dtype(own), inv_scale_on)
            if buffers:
                cpu = torch.device("cpu")
                found_cpu = found.get(cpu)
                if found_cpu is None:
                    found_cpu = found[cpu] = torch.zeros((), dtype=torch.float32)
                unscale_into(ops, half_grads, buffers, found_cpu, inv_scale_on(cpu))
            self._grads_ready = True
            return found
        return unscale_grouped(_by_device_dtype(self._master_grads(bound)), inv_scale_on)

    @torch.no_grad()
    def sync_grads(self) -> None:
        """Copy the model's gradients into the FP32 master grads (no scaling, no inf check).

        ``step()`` does this itself when needed; call it to inspect or clip the master
        grads before stepping without a loss scaler.
        """
        self._master_grads()

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Update the FP32 masters with the wrapped optimizer, then copy them into the model.

        Without a loss scaler in between, the model's gradients are first copied to the
        masters (so a plain loop ``loss.backward(); opt.step()`` works).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._grads_ready:
            self._master_grads()
        ops = self._fused_ops()
        if ops is not None and self._fused_step_allowed() and adam_step(ops, self.optimizer, self._model_of):
            self.optimizer._opt_called = True  # what an LR scheduler's step tracking records
            result = None
        else:
            result = self.optimizer.step()
            self._copy_masters_to_model()
        self._grads_ready = False
        return loss if closure is not None else result

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict plus ``"master_params"`` (FP32 copies of the
        half-precision parameters' masters, in model order)."""
        state = self.optimizer.state_dict()
        state["master_params"] = [m.detach().clone() for _, m in self._half_pairs]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict from :meth:`state_dict`, or a plain one of the wrapped optimizer
        type (then the masters are re-cast from the model's current weights)."""
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_params", None)
        self.optimizer.load_state_dict(state_dict)
        with torch.no_grad():
            if masters is None:
                for model_p, master in self._half_pairs:
                    master.copy_(model_p)
                return
            if len(masters) != len(self._half_pairs):
                raise ValueError(
                    f"master_params has {len(masters)} tensors but this optimizer has "
                    f"{len(self._half_pairs)} half-precision parameters: the checkpoint belongs to another model."
                )
            for (_, master), saved in zip(self._half_pairs, masters):
                master.copy_(saved)
            self._copy_masters_to_model()

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer({self.optimizer!r})"

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    # ------------------------------------------------------------------ internals
    def _adopt_group(self, group: dict[str, Any]) -> None:
        params = group["params"]
        for i, p in enumerate(params):
            if p.dtype in _HALF:
                master = p.detach().clone().float()
                master.requires_grad_(p.requires_grad)
                if p in self.optimizer.state:  # move existing state over, upcast
                    old = self.optimizer.state.pop(p)
                    self.optimizer.state[master] = {
                        k: v.float() if torch.is_tensor(v) and v.dtype in _HALF else v for k, v in old.items()
                    }
                params[i] = master
                self._half_pairs.append((p, master))
                self._model_of[id(master)] = p
                self._grad_buffers.append(None)
                self._grad_holders.append(master)
            else:
                master = p
            self._model_params.append(p)
            self._master_params.append(master)
            self._grad_holders.append(p)

    def _fused_ops(self) -> Any | None:
        return None if self.fused is False else _fused.kernels()

    def _fused_step_allowed(self) -> bool:
        """The fused Adam step applies: asked for, or every group was built with fused=True."""
        if not (self.fused or all(group.get("fused") for group in self.optimizer.param_groups)):
            return False
        if self._fused_params_reason is _UNCHECKED:  # the optimizer's type and parameters do not change
            self._fused_params_reason = adam_ineligible(self.optimizer)
        return self._fused_params_reason is None and not has_step_hooks(self.optimizer)

    def _master_grads(self, bound: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None) -> list[torch.Tensor]:
        """Point each master's ``.grad`` at the model's gradient in FP32 (copy for half
        params, the same tensor for FP32 params); return the master grads. ``bound``: what
        :meth:`_bind_master_grads` returned, when the caller has already called it."""
        copy_dst, copy_src = bound if bound is not None else self._bind_master_grads()
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        self._grads_ready = True
        return [m.grad for m in self._master_params if m.grad is not None]

    def _bind_master_grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Point each half-precision param's master ``.grad`` at its reused FP32 buffer;
        return the buffers and the model grads that fill them.

        Runs every step on the host, so it is one plain loop over the half-precision pairs
        (FP32 parameters already hold their own gradient).
        """
        copy_dst, copy_src = [], []
        buffers = self._grad_buffers
        for i, (model_p, master) in enumerate(self._half_pairs):
            g = model_p.grad
            if g is None:
                master.grad = None
                continue
            buffer = master.grad
            if buffer is None:
                buffer = buffers[i]
                if buffer is None:
                    buffer = buffers[i] = torch.empty_like(master)
                master.grad = buffer
            copy_dst.append(buffer)
            copy_src.append(g)
        return copy_dst, copy_src

    @torch.no_grad()
    def _copy_masters_to_model(self) -> None:
        if self._half_pairs:
            model, masters = zip(*self._half_pairs)
            torch._foreach_copy_(list(model), list(masters))


def _by_device_dtype(grads: list[torch.Tensor]) -> dict[tuple[torch.device, torch.dtype], list[torch.Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault((grad.device, grad.dtype), []).append(grad)
    return groups
