"""FP32 master weights for a model whose parameters are FP16 or BF16.

An update ``lr * g`` smaller than half an ulp of a half-precision weight is rounded away
(``1.0 - 1e-4 == 1.0`` in FP16 and BF16). :class:`MasterWeightOptimizer` keeps an FP32 copy
of every half-precision parameter, lets the wrapped optimizer update the copies, and re-casts
the model's weights from them after each real step.

The wrapper's ``param_groups`` and ``state`` *are* the wrapped optimizer's, holding the FP32
masters, so LR schedulers, fused/foreach kernels and the optimizer state all see FP32.
Parameters that are already FP32 (normalisation layers kept in FP32, for example) are their
own master: no copy is made for them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import Optimizer

from amp_plugin.scaler import unscale_grouped

__all__ = ["MasterWeightOptimizer"]

_HALF = (torch.float16, torch.bfloat16)


class MasterWeightOptimizer(Optimizer):
    """Wrap an optimizer built over half-precision parameters so it updates FP32 masters.

    Args:
        optimizer: an optimizer (SGD, Adam, AdamW, fused or foreach, ...) constructed over the
            model's parameters. Its half-precision parameters are replaced in its param groups
            by FP32 master copies; existing optimizer state is moved over and upcast.

    Use it like the optimizer it wraps; a loss scaler's ``unscale_`` on it reads the model's
    half-precision gradients and writes unscaled FP32 master gradients in one call::

        opt = MasterWeightOptimizer(torch.optim.AdamW(model.half().parameters(), fused=True))
        scaler.scale(loss).backward()
        scaler.step(opt)   # updates the masters, then copies them into the model
        scaler.update()
    """

    def __init__(self, optimizer: Optimizer) -> None:
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
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for grad in self._master_grads():
            groups.setdefault((grad.device, grad.dtype), []).append(grad)
        return unscale_grouped(groups, inv_scale_on)

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
                self._grad_buffers.append(None)
                self._grad_holders.append(master)
            else:
                master = p
            self._model_params.append(p)
            self._master_params.append(master)
            self._grad_holders.append(p)

    def _master_grads(self) -> list[torch.Tensor]:
        """Point each master's ``.grad`` at the model's gradient in FP32 (copy for half
        params, the same tensor for FP32 params); return the master grads.

        Runs every step on the host, so it is one plain loop over the half-precision pairs
        (FP32 parameters already hold their own gradient) and one ``_foreach_copy_``.
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
        if copy_dst:
            torch._foreach_copy_(copy_dst, copy_src)
        self._grads_ready = True
        return [m.grad for m in self._master_params if m.grad is not None]

    @torch.no_grad()
    def _copy_masters_to_model(self) -> None:
        if self._half_pairs:
            model, masters = zip(*self._half_pairs)
            torch._foreach_copy_(list(model), list(masters))
