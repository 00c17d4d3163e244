"""MasterWeightOptimizer under what user code does to models, optimizers and gradients:
weights written after the wrapper was built, shared and frozen parameters, wrapping twice,
sparse gradients, extra step arguments, clipping after unscale_.

Exactness: the data is FP16-representable and scales are powers of two, so the FP32 masters
must equal an FP32 reference run bit for bit.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer
from amp_plugin.master_weights import MasterGradWarning

FUSED_MODES = [None, False]  # None: the fused kernels (AdamW(fused=True) takes the fused step); False: stock ops


def half_values(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 0.1).half()


def twin_models(seed=0):
    """An FP32 reference and a half model with the same (FP16-representable) weights."""
    torch.manual_seed(seed)
    ref = torch.nn.Linear(6, 4).half().float()
    half = torch.nn.Linear(6, 4).half()
    with torch.no_grad():
        for h, r in zip(half.parameters(), ref.parameters()):
            h.copy_(r)
    return ref, half


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)


def set_grads(ref, half, seed, scale=1.0):
    for i, (r, h) in enumerate(zip(ref.parameters(), half.parameters())):
        g = half_values(*r.shape, seed=1000 * seed + i)
        r.grad = g.float()
        h.grad = g * scale


def assert_masters_equal(opt, ref):
    for m, r in zip(opt.master_params(), ref.parameters()):
        assert torch.equal(m, r.detach())


# ---------------------------------------------------------------- writes to the model after the wrapper exists
def write_zero(model):
    with torch.no_grad():
        model.weight.zero_()


def write_fill(model):
    with torch.no_grad():
        model.bias.fill_(0.25)


def write_init(model):
    torch.nn.init.constant_(model.weight, 0.125)


def write_load_state_dict(model):
    model.load_state_dict(
        {
            "weight": half_values(4, 6, seed=7).to(model.weight.dtype),
            "bias": half_values(4, seed=8).to(model.bias.dtype),
        }
    )


def write_ema_swap(model):  # an EMA/SWA swap copies the averaged weights in
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(half_values(*p.shape, seed=20 + i))


def write_replace_data(model):  # a new tensor under the same Parameter
    model.weight.data = half_values(4, 6, seed=9).to(model.weight.dtype)


WRITES = [write_zero, write_fill, write_init, write_load_state_dict, write_ema_swap, write_replace_data]


@pytest.mark.parametrize("fused", FUSED_MODES)
@pytest.mark.parametrize("write", WRITES, ids=lambda f: f.__name__[6:])
def test_a_write_to_the_model_is_where_the_next_step_starts(write, fused):
    ref, half = twin_models()
    ref_opt, opt = adamw(ref.parameters()), MasterWeightOptimizer(adamw(half.parameters()), fused=fused)
    for step in range(4):
        if step == 2:
            write(ref)
            write(half)
        set_grads(ref, half, step)
        ref_opt.step()
        opt.step()
    assert_masters_equal(opt, ref)
    for h, r in zip(half.parameters(), ref.parameters()):
        assert torch.equal(h.detach(), r.detach().half())


def swap_for_evaluation_and_back(model):
    """What an EMA or SWA evaluation does: other weights copied in, then the training weights copied back."""
    saved = [p.detach().clone() for p in model.parameters()]
    write_ema_swap(model)
    with torch.no_grad():
        for p, s in zip(model.parameters(), saved):
            p.copy_(s)


@pytest.mark.parametrize("fused", FUSED_MODES)
def test_the_training_weights_written_back_keep_their_fp32_masters(fused):
    """The weights written back as they were (the master rounded) are no new values: the FP32 masters keep
    their digits and the run goes on as the FP32 reference, bit for bit. Re-copied from the weights, every
    swap truncated the masters to FP16 (here the masters then differed from the reference's values)."""
    ref, half = twin_models()
    ref_opt, opt = adamw(ref.parameters()), MasterWeightOptimizer(adamw(half.parameters()), fused=fused)
    for step in range(4):
        if step >= 2:
            swap_for_evaluation_and_back(half)
        set_grads(ref, half, step)
        ref_opt.step()
        opt.step()
    assert_masters_equal(opt, ref)


@pytest.mark.parametrize("master", ["fp32", "bf16_split"])
@pytest.mark.parametrize("model_first", [True, False], ids=["model_first", "optimizer_first"])
def test_a_checkpoint_loads_in_either_order_as_the_kind_can(master, model_first):
    """Model and optimizer state loaded in either order: FP32 masters come back exactly either way. A
    ``bf16_split`` remainder is lost when the model's state comes second (the weight is its master's
    high half: a write of the same values cannot be told from a new one; documented, with the order
    to use): the masters are then the weights exactly."""
    torch.manual_seed(0)

    def build():
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 4).bfloat16()
        return model, MasterWeightOptimizer(adamw(model.parameters()), master=master)

    model, opt = build()
    for step in range(3):
        for i, p in enumerate(model.parameters()):
            p.grad = half_values(*p.shape, seed=10 * step + i).bfloat16()
        opt.step()
    saved_model, saved_opt = model.state_dict(), opt.state_dict()
    model2, opt2 = build()
    if model_first:
        model2.load_state_dict(saved_model)
        opt2.load_state_dict(saved_opt)
    else:
        opt2.load_state_dict(saved_opt)
        model2.load_state_dict(saved_model)
    masters = opt2.fp32_masters()
    if master == "bf16_split" and not model_first:
        assert all(torch.equal(m, p.detach().float()) for m, p in zip(masters, model2.parameters(), strict=True))
        assert not all(torch.equal(a, b) for a, b in zip(masters, opt.fp32_masters(), strict=True))
    else:
        assert all(torch.equal(a, b) for a, b in zip(masters, opt.fp32_masters(), strict=True))


@pytest.mark.parametrize("fused", FUSED_MODES)
def test_a_write_between_unscale_and_step_is_kept(fused):
    """A callback that sets the weights after the gradients were unscaled (Lightning's
    on_before_optimizer_step, for example): the step starts from the new weights."""
    ref, half = twin_models()
    ref_opt, opt = adamw(ref.parameters()), MasterWeightOptimizer(adamw(half.parameters()), fused=fused)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    for step in range(3):
        set_grads(ref, half, step, scale=scaler.get_scale())
        scaler.unscale_(opt)
        if step == 1:
            write_load_state_dict(ref)
            write_load_state_dict(half)
        ref_opt.step()
        scaler.step(opt)
        scaler.update()
    assert_masters_equal(opt, ref)


def test_writes_through_data_need_sync_masters():
    """``param.data.<op>_()`` leaves no trace on the parameter: the documented way is
    ``sync_masters()``."""
    ref, half = twin_models()
    ref_opt, opt = adamw(ref.parameters()), MasterWeightOptimizer(adamw(half.parameters()))
    set_grads(ref, half, 0)
    ref_opt.step()
    opt.step()
    ref.weight.data.fill_(0.5)
    half.weight.data.fill_(0.5)
    opt.sync_masters([half.weight])
    set_grads(ref, half, 1)
    ref_opt.step()
    opt.step()
    assert_masters_equal(opt, ref)


def test_masters_and_checkpoints_follow_the_model():
    _, half = twin_models()
    opt = MasterWeightOptimizer(adamw(half.parameters()))
    write_load_state_dict(half)
    assert torch.equal(opt.master_params()[0], half.weight.detach().float())
    assert torch.equal(opt.state_dict()["master_params"][1], half.bias.detach().float())


def test_a_parameter_changed_in_dtype_or_shape_is_a_clear_error():
    _, half = twin_models()
    opt = MasterWeightOptimizer(adamw(half.parameters()))
    half.float()  # param.data = param.data.float()
    set_grads(*twin_models(), 0)
    with pytest.raises(RuntimeError, match="Convert or resize the model first"):
        opt.step()


@pytest.mark.parametrize("fused", FUSED_MODES)
@pytest.mark.parametrize("how", ["no_grad", "data"])
def test_a_frozen_parameter_keeps_what_was_written_into_it(fused, how):
    """A frozen parameter (no gradient) is never written by the step, so it keeps any edit,
    even one the version counter cannot see (``.data``), on both paths."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 2)).half()
    model[0].requires_grad_(False)
    opt = MasterWeightOptimizer(adamw(model.parameters()), fused=fused)
    for step in range(3):
        model(half_values(5, 6, seed=step)).float().sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 0:
            if how == "data":
                model[0].weight.data.fill_(0.5)
            else:
                with torch.no_grad():
                    model[0].weight.fill_(0.5)
    assert (model[0].weight == 0.5).all()


# ---------------------------------------------------------------- shared and tied parameters
def test_one_parameter_in_two_optimizers_has_one_master():
    """Two optimizers over one half parameter (a GAN's shared layer): both updates land, as
    with two FP32 optimizers over one FP32 parameter."""
    ref_p = torch.nn.Parameter(half_values(8, seed=1).float())
    half_p = torch.nn.Parameter(half_values(8, seed=1))
    ref_opts = [torch.optim.SGD([ref_p], lr=0.1), torch.optim.SGD([ref_p], lr=0.01, momentum=0.9)]
    opts = [
        MasterWeightOptimizer(torch.optim.SGD([half_p], lr=0.1)),
        MasterWeightOptimizer(torch.optim.SGD([half_p], lr=0.01, momentum=0.9)),
    ]
    assert opts[0].master_params()[0] is opts[1].master_params()[0]
    for step in range(4):
        for k, (ref_opt, opt) in enumerate(zip(ref_opts, opts)):
            g = half_values(8, seed=10 * step + k)
            ref_p.grad, half_p.grad = g.float(), g
            ref_opt.step()
            opt.step()
    assert torch.equal(opts[0].master_params()[0], ref_p.detach())
    assert torch.equal(half_p.detach(), ref_p.detach().half())


def test_a_parameter_listed_twice_steps_like_torch():
    """torch warns about a duplicate parameter in one group and updates it once per listing;
    the wrapper keeps one master, listed twice, so the update is the same."""
    ref_p = torch.nn.Parameter(half_values(8, seed=1).float())
    half_p = torch.nn.Parameter(half_values(8, seed=1))
    with pytest.warns(UserWarning, match="duplicate parameters"):
        ref_opt = torch.optim.SGD([ref_p, ref_p], lr=0.1, momentum=0.9)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = MasterWeightOptimizer(torch.optim.SGD([half_p, half_p], lr=0.1, momentum=0.9))
    for step in range(3):
        g = half_values(8, seed=step)
        ref_p.grad, half_p.grad = g.float(), g
        ref_opt.step()
        opt.step()
    assert torch.equal(opt.master_params()[0], ref_p.detach())


# ---------------------------------------------------------------- wrapping twice, duplicate groups
def test_wrapping_an_already_wrapped_optimizer_is_refused():
    model = torch.nn.Linear(3, 3).half()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapper = MasterWeightOptimizer(inner)
    for again in (inner, wrapper.optimizer, torch.optim.SGD(wrapper.master_params(), lr=0.1)):
        with pytest.raises(ValueError, match="already wrapped.*instead of its .optimizer"):
            MasterWeightOptimizer(again)
    fp32_only = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    MasterWeightOptimizer(fp32_only)
    with pytest.raises(ValueError, match="already wrapped"):
        MasterWeightOptimizer(fp32_only)


def test_a_duplicate_param_group_raises_like_torch():
    model = torch.nn.Linear(3, 3).half()
    plain = torch.optim.SGD([model.weight], lr=0.1)
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        plain.add_param_group({"params": [model.weight]})
    opt = MasterWeightOptimizer(torch.optim.SGD([model.weight], lr=0.1))
    for again in (model.weight, opt.master_params()[0]):
        with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
            opt.add_param_group({"params": [again]})
    assert len(opt.param_groups) == 1
    opt.add_param_group({"params": [model.bias], "lr": 0.5})  # a new parameter is fine
    assert len(opt.master_params()) == 2 and opt.master_params()[1].dtype == torch.float32


# ---------------------------------------------------------------- sparse gradients
@pytest.mark.parametrize(
    "optimizer",
    [
        lambda ps: torch.optim.SGD(ps, lr=0.5),
        lambda ps: torch.optim.SparseAdam(ps, lr=0.01),
    ],
    ids=["sgd", "sparse_adam"],
)
@pytest.mark.parametrize("scaled", [False, True])
def test_sparse_embedding_gradients_train_like_fp32(optimizer, scaled):
    weights = half_values(10, 4, seed=0)
    ref = torch.nn.Embedding(10, 4, sparse=True)
    half = torch.nn.Embedding(10, 4, sparse=True).half()
    with torch.no_grad():
        ref.weight.copy_(weights)
        half.weight.copy_(weights)
    ref_opt, opt = optimizer(ref.parameters()), MasterWeightOptimizer(optimizer(half.parameters()))
    scaler = DynamicLossScaler(init_scale=2.0**10)
    for step in range(4):
        idx = torch.tensor([1, 3, 3, 7, 1, step])  # repeated rows: the gradient is uncoalesced
        w = half_values(6, 4, seed=step)
        (ref(idx) * w.float()).sum().backward()
        loss = (half(idx).float() * w.float()).sum()
        ref_opt.step()
        if scaled:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            assert opt.master_params()[0].grad.is_sparse
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            opt.sync_grads()
            assert opt.master_params()[0].grad.is_sparse
            opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
    assert torch.equal(opt.master_params()[0], ref.weight.detach())
    assert torch.equal(half.weight.detach(), ref.weight.detach().half())


def test_an_inf_in_a_sparse_gradient_skips_the_step():
    half = torch.nn.Embedding(10, 4, sparse=True).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(half.parameters(), lr=0.5))
    before = half.weight.detach().clone()
    scaler = DynamicLossScaler(init_scale=2.0**10)
    scaler.scale(half(torch.tensor([1, 2])).float().sum()).backward()
    half.weight.grad._values()[0, 0] = float("inf")
    assert scaler.step(opt) is None
    scaler.update()
    assert torch.equal(half.weight.detach(), before) and scaler.get_scale() == 2.0**9


# ---------------------------------------------------------------- step arguments, LBFGS
def test_step_passes_keyword_arguments_to_the_wrapped_optimizer():
    class Recording(torch.optim.SGD):
        def step(self, closure=None, *, tag=None):
            seen.append(tag)
            return super().step(closure)

    seen = []
    model = torch.nn.Linear(3, 1).half()
    opt = MasterWeightOptimizer(Recording(model.parameters(), lr=0.1))
    model(torch.ones(2, 3, dtype=torch.float16)).float().sum().backward()
    opt.step(tag="direct")
    scaler = DynamicLossScaler(init_scale=4.0)
    scaler.scale(model(torch.ones(2, 3, dtype=torch.float16)).float().sum()).backward()
    scaler.step(opt, tag="through the scaler")
    assert seen == ["direct", "through the scaler"]


def test_lbfgs_is_refused_at_construction():
    with pytest.raises(TypeError, match="LBFGS.*first-order optimizer"):
        MasterWeightOptimizer(torch.optim.LBFGS(torch.nn.Linear(2, 2).half().parameters()))


# ---------------------------------------------------------------- gradients changed after unscale_
def clip_setup():
    ref, half = twin_models()
    return (
        ref,
        half,
        torch.optim.SGD(ref.parameters(), lr=0.5),
        MasterWeightOptimizer(torch.optim.SGD(half.parameters(), lr=0.5)),
    )


@pytest.mark.parametrize("optimizer", ["sgd", "adamw_fused"])
@pytest.mark.parametrize("fused", [None, False])
def test_torch_amp_recipe_clipping_the_model_grads_after_unscale_trains_as_fp32(fused, optimizer):
    """torch's AMP recipe verbatim, ``scaler.unscale_(opt); clip_grad_norm_(model.parameters(), c);
    scaler.step(opt)``: after ``unscale_`` the model's gradients show the unscaled values, the clip
    acts on them, and the step follows the FP32 run (unscaled FP32 gradients clipped, what
    torch.amp.GradScaler leaves an FP32 model) within FP16 rounding of the clipped gradient; no
    warning. It used to clip by the norm of the still scaled gradients: updates 256x too small."""

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.5)
        return torch.optim.AdamW(params, lr=1e-3, fused=True)

    ref, half = twin_models()
    ref_opt = make(ref.parameters())
    opt = MasterWeightOptimizer(make(half.parameters()), fused=fused)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    for step in range(3):
        before = [m.detach().clone() for m in opt.master_params()]
        set_grads(ref, half, step, scale=scaler.get_scale())
        scaler.unscale_(opt)
        for p in half.parameters():  # what the model shows is unscaled, as GradScaler leaves an FP32 model
            assert p.grad.abs().max() < 1
        for model in (half, ref):
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3) > 1e-3  # it clipped, by the true norm
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scaler.step(opt)
        scaler.update()
        ref_opt.step()
        for m, r, b in zip(opt.master_params(), ref.parameters(), before):
            update, ref_update = m.detach() - b, r.detach() - b
            if optimizer == "sgd":  # the step's gradient is the clipped one rounded to FP16 once (the edit's value)
                torch.testing.assert_close(update, ref_update, rtol=2e-3, atol=1e-8)
            else:  # Adam normalizes: FP16's subnormal rounding of the tiniest clipped elements shows, not the scale
                assert abs(float(update.norm() / ref_update.norm()) - 1) < 0.01
            r.data.copy_(m.detach())  # both go on from the same values
        opt.zero_grad()
        ref_opt.zero_grad()


def test_an_edit_after_unscale_without_shown_grads_warns_once_with_the_fix():
    """``unscaled_model_grads=False``: the model's gradients stay scaled, and changing them after
    ``unscale_`` is the mistake the warning names."""
    ref, half = twin_models()
    opt = MasterWeightOptimizer(torch.optim.SGD(half.parameters(), lr=0.5), unscaled_model_grads=False)
    scaler = DynamicLossScaler(init_scale=2.0**8)
    for step in range(2):
        set_grads(ref, half, step, scale=scaler.get_scale())
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(half.parameters(), 1e-3)
        if step == 0:
            with pytest.warns(MasterGradWarning, match=r"clip_grad_norm_\(optimizer.master_params\(\), max_norm\)"):
                scaler.step(opt)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                scaler.step(opt)  # once per optimizer
        scaler.update()


def test_replacing_a_model_grad_after_sync_grads_warns():
    ref, half, _, opt = clip_setup()
    set_grads(ref, half, 0)
    opt.sync_grads()
    half.bias.grad = torch.zeros_like(half.bias)
    with pytest.warns(MasterGradWarning):
        opt.step()


@pytest.mark.parametrize("enabled", [True, False])
def test_clipping_the_master_grads_clips_what_the_step_uses(enabled):
    ref, half, ref_opt, opt = clip_setup()
    scaler = DynamicLossScaler(init_scale=2.0**8, enabled=enabled)
    for step in range(3):
        set_grads(ref, half, step, scale=scaler.get_scale())
        scaler.unscale_(opt)  # a disabled scaler still fills the master grads
        norm = torch.nn.utils.clip_grad_norm_(opt.master_params(), 0.05)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        assert torch.equal(norm, ref_norm) and norm > 0.05  # it really clipped
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            scaler.step(opt)
        scaler.update()
        ref_opt.step()
    assert_masters_equal(opt, ref)


def test_configure_optimizers_returning_a_wrappers_inner_optimizer_is_refused(pl):
    """In Lightning: the module wraps its optimizer itself but returns the inner one, which
    the plugin would wrap a second time. The error says what to return instead."""
    from _models import TinyClassifier, as_lightning, quiet_trainer

    from amp_plugin import MixedPrecisionPlugin

    class ReturnsInner(TinyClassifier):
        def configure_optimizers(self):
            return MasterWeightOptimizer(torch.optim.AdamW(self.parameters(), lr=1e-2)).optimizer

    trainer = quiet_trainer(pl, plugins=[MixedPrecisionPlugin("fp16")], max_steps=1)
    with pytest.raises(ValueError, match="already wrapped.*return it from configure_optimizers"):
        trainer.fit(as_lightning(pl, ReturnsInner)())


# ---------------------------------------------------------------- FSDP2 (DTensor parameters)
def test_dtensor_parameters_are_refused_with_the_reason(tmp_path):
    """Under FSDP2 the sharded FP32 parameters are the masters: wrapping is a TypeError that says so."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        sharded = torch.nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
        plain = torch.nn.Parameter(torch.randn(4).half())
        inner = torch.optim.AdamW([plain, sharded])
        with pytest.raises(TypeError, match="DTensor parameters.*sharded FP32 parameters are the masters"):
            MasterWeightOptimizer(inner)
        assert inner.param_groups[0]["params"][0] is plain  # left as it was
        opt = MasterWeightOptimizer(torch.optim.AdamW([torch.nn.Parameter(torch.randn(4).half())]))
        with pytest.raises(TypeError, match="DTensor parameters"):
            opt.add_param_group({"params": [torch.nn.Parameter(distribute_tensor(torch.randn(2), mesh, [Shard(0)]))]})
        assert len(opt.param_groups) == 1
    finally:
        dist.destroy_process_group()
