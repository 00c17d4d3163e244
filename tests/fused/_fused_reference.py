"""Oracles of the fused kernel tests: torch's own fused Adam/AdamW on FP32 tensors."""

from __future__ import annotations

import torch

ADAM_CONFIGS = [  # adamw, betas, weight_decay, maximize
    (True, (0.9, 0.999), 0.01, False),
    (False, (0.9, 0.999), 0.0, False),
    (False, (0.9, 0.95), 0.1, True),
    (True, (0.3, 0.99), 0.0, False),
]


def reference_adam(master, grads, adamw, steps=12, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.01, maximize=False):
    p = master.clone().requires_grad_()
    opt = (torch.optim.AdamW if adamw else torch.optim.Adam)(
        [p], lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize, fused=True
    )
    for g in grads[:steps]:
        p.grad = g.clone()
        opt.step()
    return p.detach(), opt.state[p]
