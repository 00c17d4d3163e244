"""A tiny Vision Transformer on generated images of shapes, trained with AdamW's default betas.

Data (:func:`make_shapes`, generated from ``seed``, nothing downloaded): grey
``image_size x image_size`` images, each holding one of ten shapes (:data:`SHAPES`: lines in four
directions, a square outline, a filled square, a plus, an X, a ring, a disk) of random half-size 2 to
4 pixels at a random position and a random brightness in [0.5, 1.5], under Gaussian pixel noise of
standard deviation ``noise``. The class is the shape. A shape spans several patches and the
noise hides it in any single one, so the model has to combine patches; the square and the disk,
the ring and the square outline differ in a few pixels, so the loss keeps falling for hundreds of
steps. ``n_train`` distinct training images (16384 by default: 256 batches per epoch).

Model: the ViT recipe in miniature. The image is cut into ``patch_size x patch_size`` patches, each
flattened and projected by one ``nn.Linear`` to ``n_embd``; learned position embeddings, a CLS
vector (``pool="cls"``) or mean pooling (``pool="mean"``), ``n_layer`` pre-LayerNorm encoder blocks
and a linear head (``amp_plugin.recipes._encoder``). The defaults (16 patches of 4x4, 2 blocks 64
wide, 103k parameters) took about 40 ms a step in BF16 on one thread of the 2-core EPYC of
BENCHMARKS.md, with other jobs running.

Optimizer: ``torch.optim.AdamW`` with torch's default betas ``(0.9, 0.999)`` and eps: the second
moment averages over about 1000 steps, so a stored ``exp_avg_sq`` that cannot shrink (a BF16 moment
rounded to nearest) shows in a few hundred steps. Warmup, then a cosine to ``lr / 10``.

Precision: the module never picks a dtype; a precision plugin casts the parameters and the float
images, and the loss is computed in FP32. From Hydra (``recipe=vit``)::

    _target_: amp_plugin.recipes.ViTRecipe
    n_layer: 2
    noise: 0.6
"""

from __future__ import annotations

import torch
from torch import nn

from amp_plugin.checks import check_int, check_number
from amp_plugin.recipes._encoder import EncoderClassifier, EncoderRecipe, check_encoder_args

__all__ = ["SHAPES", "ViTRecipe", "make_shapes"]

SHAPES = ("hline", "vline", "diagonal", "antidiagonal", "square", "box", "plus", "cross", "ring", "disk")
"""The classes of :func:`make_shapes`, in label order."""


def make_shapes(n: int, image_size: int = 16, noise: float = 0.6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` noisy images of one shape each and their labels (indices into :data:`SHAPES`).

    Args:
        n: Images.
        image_size: Height and width in pixels (>= 10, room for a shape of half-size 4).
        noise: Standard deviation of the Gaussian pixel noise.
        seed: Seed of everything drawn (independent of the global RNG).

    Returns:
        float32 images ``(n, 1, image_size, image_size)`` and int64 labels ``(n,)``.
    """
    check_int("n", n, ge=1)
    check_int("image_size", image_size, ge=10)
    check_number("noise", noise, ge=0)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(len(SHAPES), (n,), generator=g)
    radius = torch.randint(2, 5, (n, 1, 1), generator=g).float()
    # centre anywhere the shape fits: radius <= c <= image_size - 1 - radius
    cx = radius + (torch.rand(n, 1, 1, generator=g) * (image_size - 2 * radius)).floor()
    cy = radius + (torch.rand(n, 1, 1, generator=g) * (image_size - 2 * radius)).floor()
    brightness = 0.5 + torch.rand(n, 1, 1, generator=g)
    grid = torch.arange(image_size, dtype=torch.float32)
    dx, dy = grid.view(1, 1, -1) - cx, grid.view(1, -1, 1) - cy  # (n, 1, W), (n, H, 1)
    adx, ady = dx.abs(), dy.abs()
    chebyshev = torch.maximum(adx, ady)
    distance = (dx**2 + dy**2).sqrt()
    inside = chebyshev <= radius
    diagonal = ((dx - dy).abs() < 0.5) & inside
    antidiagonal = ((dx + dy).abs() < 0.5) & inside
    masks = (
        (ady < 0.5) & (adx <= radius),  # hline
        (adx < 0.5) & (ady <= radius),  # vline
        diagonal,
        antidiagonal,
        (chebyshev - radius).abs() < 0.5,  # square outline
        inside,  # box: filled square
        ((ady < 0.5) & (adx <= radius)) | ((adx < 0.5) & (ady <= radius)),  # plus
        diagonal | antidiagonal,  # cross
        (distance - radius).abs() < 0.6,  # ring
        distance <= radius + 0.3,  # disk
    )
    shape = torch.zeros(n, image_size, image_size, dtype=torch.bool)
    for label, mask in enumerate(masks):
        shape = torch.where((labels == label).view(n, 1, 1), mask, shape)
    images = brightness * shape + noise * torch.randn(n, image_size, image_size, generator=g)
    return images.unsqueeze(1), labels


class _Patches(nn.Module):
    """``(B, 1, H, W)`` images -> ``(B, (H/p) * (W/p), n_embd)``: each patch flattened and projected."""

    def __init__(self, patch_size: int, n_embd: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Linear(patch_size * patch_size, n_embd)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        p = self.patch_size
        patches = images.unfold(2, p, p).unfold(3, p, p)  # (B, 1, H/p, W/p, p, p)
        return self.proj(patches.reshape(images.shape[0], -1, p * p))


class ViTRecipe(EncoderRecipe):
    """Classify generated images of ten shapes with a tiny ViT (AdamW, torch's default betas).

    Args:
        image_size: Image height and width in pixels (>= 10, a multiple of ``patch_size``).
        patch_size: Patch height and width.
        noise: Standard deviation of the pixel noise (the shapes have brightness 0.5 to 1.5).
        n_layer: Encoder blocks.
        n_head: Attention heads; must divide ``n_embd``.
        n_embd: Embedding width.
        pool: ``"cls"`` (a learned CLS vector in front) or ``"mean"`` (mean over the patches).
        dropout: Dropout in attention, MLP and embeddings.
        batch_size: Images per training batch.
        lr: Peak learning rate.
        weight_decay: AdamW's decoupled weight decay on the weights of 2 or more dimensions
            (matrices, the position embeddings, the CLS vector), not on biases or norm gains.
        adam_eps: AdamW's epsilon (torch's default 1e-8).
        warmup_steps: Linear warmup steps.
        schedule: ``"cosine"`` (to ``lr / 10`` at ``trainer.max_steps``) or ``"constant"``.
        loss_drop_step: From this step on the loss is multiplied by ``loss_drop_factor`` before
            backward (a gradient-scale change mid-run, see ``EncoderRecipe``); ``None``: never.
        loss_drop_factor: The factor.
        n_train: Training images.
        n_val: Validation images.
        seed: Seed of the data (model init and shuffling follow the global seed).
    """

    def __init__(
        self,
        image_size: int = 16,
        patch_size: int = 4,
        noise: float = 0.6,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 64,
        pool: str = "cls",
        dropout: float = 0.0,
        batch_size: int = 64,
        lr: float = 1e-3,
        weight_decay: float = 0.01,
        adam_eps: float = 1e-8,
        warmup_steps: int = 20,
        schedule: str = "cosine",
        loss_drop_step: int | None = None,
        loss_drop_factor: float = 0.1,
        n_train: int = 16384,
        n_val: int = 2048,
        seed: int = 0,
    ) -> None:
        super().__init__()
        check_int("image_size", image_size, ge=10)
        check_int("patch_size", patch_size, ge=1)
        if image_size % patch_size:
            raise ValueError(
                f"image_size={image_size} is not allowed: image_size must be a multiple of patch_size={patch_size}."
            )
        check_number("noise", noise, ge=0)
        check_encoder_args(
            n_layer=n_layer,
            n_head=n_head,
            n_embd=n_embd,
            batch_size=batch_size,
            n_train=n_train,
            n_val=n_val,
            lr=lr,
            weight_decay=weight_decay,
            adam_eps=adam_eps,
            warmup_steps=warmup_steps,
            schedule=schedule,
            dropout=dropout,
            pool=pool,
            loss_drop_step=loss_drop_step,
            loss_drop_factor=loss_drop_factor,
            seed=seed,
        )
        self.save_hyperparameters()
        n_patches = (image_size // patch_size) ** 2
        self.model = EncoderClassifier(
            _Patches(patch_size, n_embd), n_patches, len(SHAPES), n_layer, n_head, n_embd, dropout, pool
        )

    def make_data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        hp = self.hparams
        x, y = make_shapes(hp.n_train + hp.n_val, hp.image_size, hp.noise, hp.seed)
        return x[: hp.n_train], y[: hp.n_train], x[hp.n_train :], y[hp.n_train :]
