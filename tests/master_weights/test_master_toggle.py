"""Lightning's ``toggle_optimizer`` (the GAN pattern) with master weights: freezing an
optimizer's parameters (its FP32 masters) freezes the model's parameters, so the
discriminator collects no gradient from the generator's loss and the other way round."""

from __future__ import annotations

import pytest
import torch

from amp_plugin import DynamicLossScaler, MasterWeightOptimizer


# LightningModule.toggle_optimizer / untoggle_optimizer as Lightning 2.6 implements them
# (lightning/pytorch/core/module.py), with the trainer's optimizer list passed in.
def toggle_optimizer(optimizers, optimizer):
    param_requires_grad_state = {}
    for opt in optimizers:
        for group in opt.param_groups:
            for param in group["params"]:
                if param in param_requires_grad_state:
                    continue
                param_requires_grad_state[param] = param.requires_grad
                param.requires_grad = False
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.requires_grad = param_requires_grad_state[param]
    return param_requires_grad_state


def untoggle_optimizer(optimizers, optimizer, param_requires_grad_state):
    for opt in optimizers:
        if opt is not optimizer:
            for group in opt.param_groups:
                for param in group["params"]:
                    if param in param_requires_grad_state:
                        param.requires_grad = param_requires_grad_state[param]


def gan(dtype=torch.float16, seed=0):
    torch.manual_seed(seed)
    generator = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 6)).to(dtype)
    discriminator = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(dtype)
    return generator, discriminator


def test_setting_a_masters_requires_grad_sets_the_model_parameters():
    model = torch.nn.Linear(3, 2).half()
    opt = MasterWeightOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    weight, bias = opt.master_params()
    weight.requires_grad = False
    assert not model.weight.requires_grad and model.bias.requires_grad
    bias.requires_grad_(False)
    assert not model.bias.requires_grad
    weight.requires_grad_()
    assert model.weight.requires_grad and weight.requires_grad
    model.bias.requires_grad_(True)  # the model's flag is what the master reports
    assert bias.requires_grad


@pytest.mark.parametrize("fused", [None, False])
def test_toggle_optimizer_freezes_the_other_models_parameters(fused):
    g_model, d_model = gan()
    g_opt = MasterWeightOptimizer(torch.optim.AdamW(g_model.parameters(), lr=1e-2, fused=True), fused=fused)
    d_opt = MasterWeightOptimizer(torch.optim.AdamW(d_model.parameters(), lr=1e-2, fused=True), fused=fused)
    optimizers = [g_opt, d_opt]
    scaler = DynamicLossScaler(init_scale=2.0**8)
    d_model[2].bias.requires_grad_(False)  # frozen by the user: stays frozen through the toggles
    for step in range(3):
        z = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).half()
        real = torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + step)).half()

        state = toggle_optimizer(optimizers, g_opt)
        assert not any(p.requires_grad for p in d_model.parameters())
        g_loss = -d_model(g_model(z)).float().mean()
        scaler.scale(g_loss).backward()
        assert all(p.grad is None for p in d_model.parameters())  # no gradient into the discriminator
        assert all(p.grad is not None for p in g_model.parameters())
        scaler.step(g_opt)
        g_opt.zero_grad()
        untoggle_optimizer(optimizers, g_opt, state)

        state = toggle_optimizer(optimizers, d_opt)
        assert not any(p.requires_grad for p in g_model.parameters())
        d_loss = (d_model(g_model(z)).float() - d_model(real).float()).mean()
        scaler.scale(d_loss).backward()
        assert all(p.grad is None for p in g_model.parameters())  # no gradient into the generator
        assert [p.grad is not None for p in d_model.parameters()] == [True, True, True, False]
        scaler.step(d_opt)
        d_opt.zero_grad()
        untoggle_optimizer(optimizers, d_opt, state)
        scaler.update()
        assert all(p.requires_grad for p in g_model.parameters())
        assert [p.requires_grad for p in d_model.parameters()] == [True, True, True, False]


def gan_module(pl, records, init_dtype):
    class GAN(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.generator, self.discriminator = gan(torch.float32)
            with torch.no_grad():  # the same start for the FP32 and the half-precision run
                for p in self.parameters():
                    p.copy_(p.to(init_dtype).float())

        def training_step(self, batch, batch_idx):
            (real,) = batch
            dtype = next(self.generator.parameters()).dtype
            z = torch.randn(real.shape[0], 4, generator=torch.Generator().manual_seed(batch_idx)).to(dtype)
            g_opt, d_opt = self.optimizers()

            self.toggle_optimizer(g_opt)
            g_loss = -self.discriminator(self.generator(z)).float().mean()
            self.manual_backward(g_loss)
            records.append(
                (
                    "g",
                    [p.grad is None for p in self.discriminator.parameters()],
                    [p.grad is None for p in self.generator.parameters()],
                )
            )
            g_opt.step()
            g_opt.zero_grad()
            self.untoggle_optimizer(g_opt)

            self.toggle_optimizer(d_opt)
            fake = self.generator(z)
            d_loss = (self.discriminator(fake).float() - self.discriminator(real.to(dtype)).float()).mean()
            self.manual_backward(d_loss)
            records.append(
                (
                    "d",
                    [p.grad is None for p in self.generator.parameters()],
                    [p.grad is None for p in self.discriminator.parameters()],
                )
            )
            d_opt.step()
            d_opt.zero_grad()
            self.untoggle_optimizer(d_opt)

        def configure_optimizers(self):
            return (
                torch.optim.AdamW(self.generator.parameters(), lr=1e-3, fused=True),
                torch.optim.AdamW(self.discriminator.parameters(), lr=1e-3, fused=True),
            )

        def train_dataloader(self):
            real = torch.randn(64, 6, generator=torch.Generator().manual_seed(7))
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(real), batch_size=8)

    return GAN


@pytest.mark.parametrize("precision", ["fp16", "bf16", "bf16_lean", "bf16_sr"])
def test_a_lightning_gan_with_toggle_optimizer_trains_like_fp32(pl, precision):
    from _models import quiet_trainer

    from amp_plugin import MixedPrecisionPlugin

    results = {}
    dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    for name in ("fp32", precision):
        records = []
        torch.manual_seed(0)
        module = gan_module(pl, records, dtype)()
        start = torch.cat([p.detach().flatten().clone() for p in module.parameters()])
        # a scale the first steps do not overflow: no step of the FP16 run is skipped
        plugin = MixedPrecisionPlugin(
            name, **({"scaler": DynamicLossScaler(init_scale=2.0**8)} if name == "fp16" else {})
        )
        trainer = quiet_trainer(pl, plugins=[plugin], max_steps=16, max_epochs=1)
        trainer.fit(module)
        if name != "fp32":
            assert all(isinstance(o, MasterWeightOptimizer) for o in trainer.optimizers)
            assert plugin.scaler.skipped_steps == 0
        assert len(records) == 16 and all(all(frozen) and not any(trained) for _, frozen, trained in records), records[
            :2
        ]
        results[name] = torch.cat([p.detach().float().flatten() for p in module.parameters()]) - start
    fp32, half = results["fp32"], results[precision]  # what training changed, in each run
    # BF16 computes with 3 digits: Adam amplifies the noise. bf16_sr keeps no master: each of the 16 updates
    # lands on a BF16 neighbour of the exact one (right on average), noise of the order of the weights' ulp,
    # about as large as what 16 steps change here; toggle_optimizer's freezing is what it checks (above)
    tolerance = {"fp16": 0.03, "bf16_sr": 0.4}.get(precision, 0.15)
    assert fp32.norm() > 0 and (half - fp32).norm() / fp32.norm() < tolerance
