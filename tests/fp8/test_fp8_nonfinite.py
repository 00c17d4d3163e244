"""A NaN or inf batch under delayed scaling: its amaxes stay out of the history (issue #31, item 4).

A step whose amaxes are not finite (a NaN batch, an overflow) is dropped from the FP8 state: the
amax histories are not rolled, the scales and the fallback counters are kept. Before the fix the
NaN sat in the history for ``amax_history_len`` updates, the scale froze that long, and a layer
whose activations then moved saturated into the BF16 fallback for the rest of the run.
"""

from __future__ import annotations

import collections
import math

import pytest
import torch
from _models import TinyClassifier, as_lightning, quiet_trainer
from torch import nn

from amp_plugin import MixedPrecisionPlugin, StaticLossScaler
from amp_plugin.fp8 import E4M3, Fp8Recipe, convert_to_fp8, reference_scale, saturating_cast


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def _batches(n: int, amplitude=lambda t: 1.0 + t) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randn(8, 16, generator=g) * amplitude(t) for t in range(n)]


def _poisoned(x: torch.Tensor, bad: float) -> torch.Tensor:
    x = x.clone()
    x[3, 5] = bad
    return x


def _run(
    batches: list[torch.Tensor],
    recipe: Fp8Recipe,
    each_step=None,
    lr: float = 0.05,
    inf_target_at: int | None = None,
    tell_skips: bool = False,
):
    """A plain loop as torch.amp documents it, with a loss scaler that skips non-finite steps;
    the target of step ``inf_target_at`` holds an inf (an overflowing loss)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))
    fp8 = convert_to_fp8(model, recipe)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    scaler = StaticLossScaler(1.0)
    for step, x in enumerate(batches):
        target = torch.zeros(x.shape[0], 16)
        if step == inf_target_at:
            target[2, 4] = math.inf
        loss = (model(x) - target).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        fp8.update(skipped=scaler.last_step_skipped) if tell_skips else fp8.update()
        if each_step is not None:
            each_step(step, model, fp8)
    return model, fp8, scaler


class _FirstLayerByHand:
    """After each step, the first layer's input window, scale and history computed by hand: its
    input is the batch, so its window is the amaxes of the batches that count (all but ``bad_at``)."""

    def __init__(self, seen: list[torch.Tensor], bad_at: int, length: int) -> None:
        self.seen, self.bad_at = seen, bad_at
        self.window: collections.deque[float] = collections.deque(maxlen=length)
        self.scale = 1.0
        self.checked: list[int] = []

    def __call__(self, step: int, model: nn.Module, fp8) -> None:
        layer = model[0]
        assert torch.isfinite(layer.fp8_amax_history).all(), step
        assert torch.isfinite(layer.fp8_scale).all() and layer.fp8_active, step
        if step != self.bad_at:
            self.window.append(self.seen[step].abs().max().item())
            self.scale = _f32(reference_scale(max(self.window), self.scale, E4M3.max, 0, 1e-12))
        assert layer.fp8_scale[0].item() == self.scale, (step, list(self.window))
        rows = sorted(v for v in layer.fp8_amax_history[:, 0].tolist() if v)
        kept = list(self.window)[1 - self.window.maxlen :]  # the oldest left at the roll, row 0 cleared
        assert rows == sorted(kept), step
        self.checked.append(step)


def _assert_runs_in_fp8(layer: nn.Module, x: torch.Tensor) -> None:
    """``layer(x)`` is the FP8 GEMM of the operands cast with the layer's (finite) scales."""
    sx, sw = layer.fp8_scale[0], layer.fp8_scale[1]
    x8 = saturating_cast(x * sx, E4M3).float() * sx.reciprocal()
    w8 = saturating_cast(layer.weight.detach() * sw, E4M3).float() * sw.reciprocal()
    with torch.no_grad():
        assert layer.fp8_active and torch.equal(layer(x), x8 @ w8.T + layer.bias)


@pytest.mark.parametrize("bad_at", [0, 2], ids=["first_step", "step_2"])
@pytest.mark.parametrize("bad", ["nan_input", "inf_loss"])
def test_a_skipped_nonfinite_batch_leaves_the_fp8_state_as_if_never_seen(bad: str, bad_at: int) -> None:
    # nan_input: NaN through every layer and the step skipped, found on the device alone.
    # inf_loss: only the last layer's gradient is inf (the saturating casts make the rest
    #   finite); the loop says the step was skipped (update(skipped=...)), so the first layer
    #   drops its finite amaxes of that step too.
    recipe = Fp8Recipe(amax_history_len=4, keep_first_last=False, fallback_steps=0)
    clean = _batches(9)
    bad_x = _poisoned(clean[bad_at], math.nan) if bad == "nan_input" else clean[bad_at]
    seen = [*clean[:bad_at], bad_x, *clean[bad_at:]]
    options = {"inf_target_at": bad_at, "tell_skips": True} if bad == "inf_loss" else {}
    by_hand = _FirstLayerByHand(seen, bad_at, 4)
    model, fp8, scaler = _run(seen, recipe, by_hand, **options)
    assert by_hand.checked == list(range(10)) and scaler.skipped_steps == 1

    # Bit for bit the run that never saw the bad batch (its step was skipped: same weights).
    twin, twin_fp8, _ = _run(clean, recipe)
    for name, layer in fp8.layers.items():
        other = twin_fp8.layers[name]
        assert torch.equal(layer.fp8_amax_history, other.fp8_amax_history), name
        assert torch.equal(layer.fp8_scale, other.fp8_scale), name
        assert torch.equal(layer.fp8_over_steps, other.fp8_over_steps), name
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    # ... and the next batch is computed in FP8 with the finite scales, as the twin computes it.
    assert torch.equal(model(clean[-1]), twin(clean[-1]))
    _assert_runs_in_fp8(model[0], clean[-1])


@pytest.mark.parametrize("bad_at", [0, 2], ids=["first_step", "step_2"])
def test_an_inf_input_is_saturated_and_its_amax_dropped(bad_at: int) -> None:
    # The cast clamps the inf to E4M3's max, so the step trains (not skipped); its inf amax is
    # still kept out of the history, and the first layer's scale follows the finite batches.
    recipe = Fp8Recipe(amax_history_len=4, keep_first_last=False, fallback_steps=0)
    clean = _batches(9)
    seen = [*clean[:bad_at], _poisoned(clean[bad_at], math.inf), *clean[bad_at:]]
    by_hand = _FirstLayerByHand(seen, bad_at, 4)
    model, fp8, scaler = _run(seen, recipe, by_hand)
    assert by_hand.checked == list(range(10)) and scaler.skipped_steps == 0
    assert all(torch.isfinite(m.fp8_amax_history).all() for m in fp8.layers.values())
    _assert_runs_in_fp8(model[0], clean[-1])


def test_one_nan_batch_does_not_freeze_the_scale_into_a_bf16_fallback() -> None:
    # Default recipe (history 1024, fallback after 16 steps above 1% saturated). The activations
    # grow 64x after the NaN batch: a scale frozen by a NaN in the history saturates them all.
    recipe = Fp8Recipe(keep_first_last=False)
    clean = _batches(44, amplitude=lambda t: 1.0 if t < 4 else 64.0)
    seen = [*clean[:4], _poisoned(clean[4], math.nan), *clean[4:]]

    def read_at_step_8(step: int, model: nn.Module, fp8) -> None:
        if step == 8:
            fp8.read_stats(reset=True)  # past the one step the growth saturated (delayed by one)

    model, fp8, scaler = _run(seen, recipe, read_at_step_8, lr=1e-5)
    assert scaler.skipped_steps == 1
    assert fp8.fallbacks == [] and all(m.fp8_active for m in fp8.layers.values())
    first = model[0]
    finite_amax = max(x.abs().max().item() for x in clean)
    assert first.fp8_scale[0].item() == _f32(reference_scale(finite_amax, 1.0, E4M3.max, 0, 1e-12))
    stats = {s.operand: s for s in fp8.read_stats() if s.layer == "0"}
    assert stats["input"].numel == 36 * 128 and stats["input"].saturated_frac < 0.01  # frozen: all of them


def test_a_nan_batch_in_lightning_stays_out_of_the_history(pl) -> None:
    class NanAtStep2(as_lightning(pl, TinyClassifier)):  # type: ignore[misc]
        def forward(self, x):
            if self.training and self.global_step == 2:
                x = x.clone()
                x[0, 0] = math.nan
            return self.net(x)

    pl.seed_everything(0)
    model = NanAtStep2(n=24, step_keyed=True)
    recipe = {"keep_first_last": False, "min_features": 1, "multiple_of": 1, "amax_history_len": 16}
    plugin = MixedPrecisionPlugin("fp8", fp8=recipe, scaler=StaticLossScaler(1.0))
    quiet_trainer(pl, plugins=[plugin], max_steps=8).fit(model)
    assert plugin.scaler.skipped_steps == 1
    layers = plugin.fp8_layers
    assert layers is not None and set(layers.layers) == {"net.0", "net.3"}
    for name, layer in layers.layers.items():
        history = layer.fp8_amax_history
        assert torch.isfinite(history).all(), name
        assert int((history[:, 0] > 0).sum()) == 7, name  # 8 steps, the skipped one not recorded
        for operand, fmt_max in enumerate(f.max for f in layer.formats):  # 16 rows: none rolled out
            expected = _f32(reference_scale(history[:, operand].max().item(), 1.0, fmt_max, 0, 1e-12))
            assert layer.fp8_scale[operand].item() == expected, (name, operand)
        assert layer.fp8_active
