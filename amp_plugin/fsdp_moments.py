"""BF16 Adam moments for FP32 parameters, FSDP2 shards included: :class:`Bf16MomentsAdam`.

Under FSDP2 the sharded FP32 parameters are the master weights, so no
:class:`~amp_plugin.MasterWeightOptimizer` is built; with the ``bf16_lean``/``bf16_sr`` presets
(``moments="bf16"``) the plugin wraps the user's Adam/AdamW in this class instead. The rule is
``MasterWeightOptimizer(moments_dtype=torch.bfloat16)``'s (``_multi_tensor.py``): per step the
BF16 ``exp_avg``/``exp_avg_sq`` of each local shard are upcast to FP32 temporaries, torch's
fused kernel (``torch._fused_adam_``/``_fused_adamw_``, what ``Adam(fused=True)`` runs) updates
the FP32 shard and those temporaries, and the moments are rounded once when stored:
stochastically by default (a moment rounded to nearest cannot shrink at beta2 0.999; see
:mod:`amp_plugin.master_weights._stochastic`), with the bits of each element's index in the whole
parameter, so a dim-0 shard (FSDP2's) rounds as the unsharded tensor would. The seed is rank 0's
(every rank of the group agrees), kept with its step counter in the first param group
(``"sr_seed"``, ``"sr_counter"``), which every state dict carries.

The moments are DTensors shaped and placed like their parameters (BF16 local shards), so
``torch.distributed.checkpoint`` saves and loads them sharded or full as it does torch's own
state. Parameters outside ``bf16_params`` (the norm layers FSDP2 gathers in FP32, as the
single-process presets keep their FP32 parameters' moments in FP32) get FP32 moments.

No Lightning import.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch.optim import Optimizer
from typing_extensions import override

from amp_plugin._delegating import DelegatingOptimizer
from amp_plugin._dtensor import is_dtensor
from amp_plugin.adam_rule import foreach_refusal, fused_adam_update
from amp_plugin.master_weights import (
    SRGenerator,
    check_moments_rounding,
    lift_state,
    lower_state,
    moments_key,
    offset_key,
    round_stochastic,
    shared_seed,
)

__all__ = ["Bf16MomentsAdam"]

BF16 = torch.bfloat16


def _local(t: torch.Tensor) -> torch.Tensor:
    return cast("Any", t).to_local() if is_dtensor(t) else t


class Bf16MomentsAdam(DelegatingOptimizer, Optimizer):
    """Adam/AdamW whose moments are stored in BF16, computed in FP32 and rounded once per step.

    The wrapper shares ``param_groups``, ``state`` (:class:`~amp_plugin._delegating.DelegatingOptimizer`)
    and ``defaults`` with ``optimizer`` (LR schedulers and ``torch.distributed.checkpoint`` see the same objects).

    Args:
        optimizer: an optimizer over FP32 parameters (plain tensors or FSDP2's DTensors). A
            ``torch.optim.Adam`` or ``AdamW`` without ``amsgrad``, ``capturable``, ``differentiable``
            or ``foreach=True`` takes torch's fused update rule on FP32 temporaries of the moments;
            any other (SGD with momentum, RMSprop, Adam with ``foreach``, a subclass) runs its own
            ``step()`` with its per-element state (momentum buffers, ...) upcast for the step and
            stored in BF16 after it, rounded the same way.
        bf16_params: the parameters whose moments are BF16; ``None``: all of them.
        moments_rounding: ``"stochastic"`` (default) or ``"nearest"`` (see
            :class:`~amp_plugin.MasterWeightOptimizer`; ``"nearest"`` warns where a beta freezes a moment).
        sr_seed: the seed of the stochastic rounding (default: drawn from torch's generator; rank 0's
            under ``torch.distributed``).

    Raises:
        ValueError: a parameter that is not FP32.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        bf16_params: Iterable[torch.Tensor] | None = None,
        moments_rounding: str = "stochastic",
        sr_seed: int | None = None,
    ) -> None:
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.dtype != torch.float32:
                    raise ValueError(
                        f"optimizer={type(optimizer).__name__} cannot keep BF16 moments (moments='bf16'): a "
                        f"parameter of shape {tuple(p.shape)} is {p.dtype}, not FP32 (the FP32 parameters are "
                        "the master weights). Build the optimizer over the FP32 (sharded) parameters."
                    )
        self.optimizer = optimizer
        # why torch's fused Adam rule cannot run this optimizer (then its own step does), or None
        self._own_rule = _fused_refusal(optimizer)
        self.defaults = optimizer.defaults
        everything = [p for g in optimizer.param_groups for p in g["params"]]
        chosen = everything if bf16_params is None else list(bf16_params)
        self._bf16 = {id(p) for p in chosen}
        check_moments_rounding(optimizer, moments_rounding, BF16)
        self.moments_rounding = moments_rounding
        if moments_rounding == "stochastic":
            first = optimizer.param_groups[0]
            first.setdefault("sr_seed", shared_seed(sr_seed))
            first.setdefault("sr_counter", 0)
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, getattr(optimizer, name))  # the wrapped optimizer's hooks run around this step
        self._patch_step_function()

    def moments_dtype(self, p: torch.Tensor) -> torch.dtype:
        """The dtype of ``p``'s moments."""
        return BF16 if id(p) in self._bf16 else torch.float32

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:  # as torch.optim.Adam(fused=True); DTensor moments for DTensor parameters
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            dtype = self.moments_dtype(p)
            state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        return state

    @override
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if self._own_rule is not None:
            return self._own_step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        keys = self._step_keys()
        position = 0
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            low: list[tuple[torch.Tensor, torch.Tensor, int, int, torch.Tensor]] = []
            for p in group["params"]:
                position += id(p) in self._bf16  # the index among the BF16-moment parameters, as the wrapper's
                if p.grad is None:
                    continue
                local = _local(p)
                if local.dtype != torch.float32:
                    raise ValueError(
                        f"Bf16MomentsAdam needs FP32 parameters; one of shape {tuple(p.shape)} is {local.dtype}"
                    )
                state = self._state(p)
                m, v = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                if m.dtype is not torch.float32:  # BF16 moments: computed in FP32, rounded once when stored
                    low.append((m, v, len(params), position - 1, p))
                    m, v = m.float(), v.float()
                params.append(local)
                grads.append(_local(p.grad))
                exp_avgs.append(m)
                exp_avg_sqs.append(v)
                steps.append(state["step"])
            if not params:
                continue
            fused_adam_update(group, self.optimizer, [params, grads, exp_avgs, exp_avg_sqs, steps], increment=True)
            for m, v, j, at, p in low:
                if keys is None:
                    m.copy_(exp_avgs[j])
                    v.copy_(exp_avg_sqs[j])
                    continue
                offset = _flat_offset(p)
                key = offset_key(moments_key(keys[at]), offset)
                round_stochastic(exp_avgs[j], m, key)
                round_stochastic(exp_avg_sqs[j], v, key, low=True)
        # what an LR scheduler built on the wrapped optimizer checks (torch's private flag, not in the stubs)
        self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return loss

    def _own_step(self, closure: Callable[[], float] | None) -> float | None:
        """The wrapped optimizer's own step (SGD, RMSprop, Adam with foreach, ...), its BF16
        per-element state upcast for it and stored in BF16 again after it. Its step hooks are this
        wrapper's (shared), so they ran already: they are held back for the inner call."""
        keys = self._step_keys()
        lifted = []
        position = 0
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in self._bf16:
                    continue
                position += 1
                if p.grad is not None:
                    lifted.append((p, position - 1, lift_state(self.state[p], p, BF16)))
        inner = self.optimizer
        hooks = inner._optimizer_step_pre_hooks, inner._optimizer_step_post_hooks
        inner._optimizer_step_pre_hooks, inner._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        try:
            loss = inner.step(closure)
        finally:
            inner._optimizer_step_pre_hooks, inner._optimizer_step_post_hooks = hooks
            for p, at, kept in lifted:
                lower_state(self.state[p], p, BF16, kept, None if keys is None else keys[at], _flat_offset(p))
        return loss

    def _step_keys(self) -> list[int] | None:
        """This step's rounding key of each BF16-moment parameter by its index among them (in
        param-group order, as :class:`~amp_plugin.MasterWeightOptimizer` keys its half-precision
        parameters, so both round alike); ``None``: rounding to nearest."""
        if self.moments_rounding != "stochastic":
            return None
        first = self.param_groups[0]
        generator = SRGenerator(int(first["sr_seed"]))
        generator.counter = int(first["sr_counter"])
        keys = generator.keys(list(range(len(self._bf16))))
        first["sr_counter"] = generator.counter
        return keys

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @override
    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load as the wrapped optimizer does (which casts the moments to the parameters' FP32),
        then store the moments in their dtype again: BF16 moments saved by this class come back
        exactly; FP32 ones are rounded to nearest. A state dict without a rounding seed (a plain
        Adam's) keeps this optimizer's seed and counter."""
        first = self.param_groups[0]
        rounding = {k: first[k] for k in ("sr_seed", "sr_counter") if k in first}
        self.optimizer.load_state_dict(state_dict)
        for name, value in rounding.items():
            self.param_groups[0].setdefault(name, value)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state.get(p)
                if not state or self.moments_dtype(p) is torch.float32:
                    continue
                for key in ("exp_avg", "exp_avg_sq"):
                    if state[key].dtype is not BF16:
                        state[key] = state[key].to(BF16)

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)
        self._bf16.update(id(p) for p in self.param_groups[-1]["params"])


def _flat_offset(p: torch.Tensor) -> int:
    """Where ``p``'s local shard starts in the whole tensor, as a flat row-major index (0 for a
    plain tensor). For a shard along dim 0 (FSDP2's) the local elements are the whole tensor's
    from there on, so they round with the whole tensor's bits."""
    if not is_dtensor(p):
        return 0
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    stride, flat = 1, 0
    for size, offset in zip(reversed(p.shape), reversed(offsets)):
        flat += offset * stride
        stride *= size
    return flat


def _fused_refusal(optimizer: Optimizer) -> str | None:
    """Why torch's fused Adam rule cannot step ``optimizer`` (then its own step runs), or ``None``."""
    if type(optimizer) not in (torch.optim.Adam, torch.optim.AdamW):
        return f"{type(optimizer).__name__} is not Adam or AdamW"
    for group in optimizer.param_groups:
        for key in ("amsgrad", "capturable", "differentiable"):
            if group.get(key):
                return f"{key}=True"
    return foreach_refusal(optimizer)
