"""FP32 master weights for a model whose parameters are FP16 or BF16.

An update ``lr * g`` smaller than half an ulp of a half-precision weight is rounded away
(``1.0 - 1e-4 == 1.0`` in FP16 and BF16). :class:`MasterWeightOptimizer` keeps an FP32 master
of every half-precision parameter, lets the wrapped optimizer's update rule change the
masters, and re-casts the model's weights from them after each real step.

The wrapper's ``param_groups`` and ``state`` *are* the wrapped optimizer's, holding the FP32
masters (:class:`MasterParameter`), so LR schedulers, fused/foreach kernels and the optimizer
state all see FP32. Parameters that are already FP32 (normalisation layers kept in FP32, for
example) are their own master: no copy is made for them.

Memory: the masters' gradients are transient (materialized only when read, freed after the
step), so AdamW over an FP16/BF16 model holds 16 bytes per parameter (weight 2, gradient 2,
master 4, moments 8); with ``master="bf16_split"`` (BF16 models) 14.

The step, by device: on the CPU, amp_plugin's fused kernels (:mod:`amp_plugin.fused`): an
inf check that only reads the half gradients, then one Adam/AdamW pass per tensor that reads
the half gradient and the unscale factor, updates master and moments and writes the rounded
weight into the model. Elsewhere (CUDA), torch's multi-tensor kernels end to end
(:mod:`amp_plugin.master_weights._multi_tensor`). Every path gives the masters the bits of
torch's own fused Adam on FP32 parameters fed the same gradients.

Modules: ``_parameter`` (the master and its record), ``_adopt`` (a param group taken over),
``_grads`` (one step's gradients), ``_unscale`` (a loss scaler's ``unscale_``: the inf check and
the unscaled master gradients), ``_step`` (the step path: gradients used, kernel chosen, copy
back), ``_multi_tensor`` (the torch-kernel step), ``_split`` (BF16 masters in two halves),
``_checkpoint`` (state dicts across kinds), ``_stochastic`` (seeded stochastic rounding of weights and
BF16 moments, public here for :class:`~amp_plugin.fsdp_moments.Bf16MomentsAdam`), ``_optimizer`` (the
wrapper).
"""

from amp_plugin.master_weights._checkpoint import MasterRoundingWarning
from amp_plugin.master_weights._grads import MasterGradWarning
from amp_plugin.master_weights._low_state import lift_state, lower_state
from amp_plugin.master_weights._optimizer import MasterWeightOptimizer
from amp_plugin.master_weights._parameter import MasterParameter, is_wrapped
from amp_plugin.master_weights._refusals import FrozenMomentWarning, check_moments_rounding
from amp_plugin.master_weights._shown import ShownGrads, show_unscaled
from amp_plugin.master_weights._stochastic import (
    FREEZE_THRESHOLD,
    SRGenerator,
    moments_key,
    offset_key,
    round_stochastic,
    shared_seed,
    state_key,
    state_low_bits,
)

__all__ = [
    "FREEZE_THRESHOLD",
    "FrozenMomentWarning",
    "MasterGradWarning",
    "MasterParameter",
    "MasterRoundingWarning",
    "MasterWeightOptimizer",
    "SRGenerator",
    "ShownGrads",
    "check_moments_rounding",
    "is_wrapped",
    "lift_state",
    "lower_state",
    "moments_key",
    "offset_key",
    "round_stochastic",
    "shared_seed",
    "show_unscaled",
    "state_key",
    "state_low_bits",
]
