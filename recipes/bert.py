"""A tiny BERT-style sequence classifier on a generated counting task, trained with AdamW's defaults.

Data (:func:`make_majority`, generated from ``seed``, nothing downloaded): sequences of
``seq_len`` tokens. The first ``num_classes`` token ids are markers, the others filler. Each
sequence has its own marker rate (0.15 to 0.5 of the positions) and its own preference among the
markers; the label is the marker that occurs most often, and on a tie the one of them that occurs
first. Counting is a job for attention across the whole sequence and the tie rule needs the
positions, so the loss keeps falling for hundreds of steps; about one sequence in eight is a
tie. ``n_train`` distinct training sequences (16384 by default: 256 batches per epoch).

Model: BERT in miniature. Token embeddings (``nn.Embedding``) plus learned position embeddings, a
CLS vector in front (``pool="cls"``) or mean pooling (``pool="mean"``), ``n_layer`` pre-LayerNorm
encoder blocks (bidirectional attention) and a linear head on the pooled vector
(``amp_plugin.recipes._encoder``). The defaults (32 tokens, 2 blocks 64 wide, 105k parameters) took
about 65 ms a step in BF16 on one thread of the 2-core EPYC of BENCHMARKS.md, with other jobs running;
``recipe=bert_grad_drop`` (16 tokens, 1 block 16 wide, 4180 parameters) 14 to 24 ms.

Optimizer: ``torch.optim.AdamW`` with torch's default betas ``(0.9, 0.999)`` and eps, as a BERT
fine-tuning script would use it; warmup, then a cosine to ``lr / 10``.

Precision: the batch holds int64 token ids only; a precision plugin casts the parameters, and the
loss is computed in FP32. From Hydra (``recipe=bert``)::

    _target_: amp_plugin.recipes.BertRecipe
    seq_len: 32
    num_classes: 4
"""

from __future__ import annotations

import torch
from torch import nn

from amp_plugin.checks import check_int
from amp_plugin.recipes._encoder import EncoderClassifier, EncoderRecipe, check_encoder_args

__all__ = ["BertRecipe", "make_majority"]


def make_majority(
    n: int, seq_len: int = 32, vocab_size: int = 32, num_classes: int = 4, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` token sequences and their labels: the most frequent marker (ids ``0 .. num_classes - 1``),
    on a tie the one that occurs first.

    Args:
        n: Sequences.
        seq_len: Tokens per sequence.
        vocab_size: Token ids ``0 .. vocab_size - 1``; the ids from ``num_classes`` on are filler.
        num_classes: Markers, and classes.
        seed: Seed of everything drawn (independent of the global RNG).

    Returns:
        int64 tokens ``(n, seq_len)`` and int64 labels ``(n,)``.
    """
    check_int("n", n, ge=1)
    check_int("seq_len", seq_len, ge=2)
    check_int("num_classes", num_classes, ge=2)
    if vocab_size <= num_classes:
        raise ValueError(
            f"vocab_size={vocab_size} is not allowed: vocab_size must exceed num_classes={num_classes} "
            "(the ids from num_classes on are filler)."
        )
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(num_classes, vocab_size, (n, seq_len), generator=g)
    rate = 0.15 + 0.35 * torch.rand(n, 1, generator=g)
    is_marker = torch.rand(n, seq_len, generator=g) < rate
    is_marker[torch.arange(n), torch.randint(seq_len, (n,), generator=g)] = True  # at least one marker
    preference = torch.softmax(torch.randn(n, num_classes, generator=g), dim=1)
    markers = torch.multinomial(preference, seq_len, replacement=True, generator=g)
    tokens = torch.where(is_marker, markers, tokens)
    one_hot = (tokens.unsqueeze(-1) == torch.arange(num_classes)) & is_marker.unsqueeze(-1)  # (n, T, K)
    counts = one_hot.sum(dim=1)
    position = torch.arange(seq_len).view(1, -1, 1).expand_as(one_hot)
    first = torch.where(one_hot, position, seq_len).amin(dim=1)  # seq_len where absent
    labels = (counts * (seq_len + 1) + (seq_len - first)).argmax(dim=1)  # count first, then earliest
    return tokens, labels


class BertRecipe(EncoderRecipe):
    """Classify generated token sequences by their majority marker with a tiny BERT (AdamW defaults).

    Args:
        seq_len: Tokens per sequence.
        vocab_size: Vocabulary (markers and filler).
        num_classes: Markers, and classes (>= 2, < ``vocab_size``).
        n_layer: Encoder blocks.
        n_head: Attention heads; must divide ``n_embd``.
        n_embd: Embedding width.
        pool: ``"cls"`` (a learned CLS vector in front) or ``"mean"`` (mean over the tokens).
        dropout: Dropout in attention, MLP and embeddings.
        batch_size: Sequences per training batch.
        lr: Peak learning rate.
        weight_decay: AdamW's decoupled weight decay on the weights of 2 or more dimensions
            (matrices, the embeddings, the CLS vector), not on biases or norm gains.
        adam_eps: AdamW's epsilon (torch's default 1e-8).
        warmup_steps: Linear warmup steps.
        schedule: ``"cosine"`` (to ``lr / 10`` at ``trainer.max_steps``) or ``"constant"``.
        loss_drop_step: From this step on the loss is multiplied by ``loss_drop_factor`` before
            backward (a gradient-scale change mid-run, see ``EncoderRecipe``); ``None``: never.
        loss_drop_factor: The factor.
        n_train: Training sequences.
        n_val: Validation sequences.
        seed: Seed of the data (model init and shuffling follow the global seed).
    """

    def __init__(
        self,
        seq_len: int = 32,
        vocab_size: int = 32,
        num_classes: int = 4,
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
        check_int("seq_len", seq_len, ge=2)
        check_int("num_classes", num_classes, ge=2)
        check_int("vocab_size", vocab_size, ge=3)
        if vocab_size <= num_classes:
            raise ValueError(
                f"vocab_size={vocab_size} is not allowed: vocab_size must exceed num_classes={num_classes}."
            )
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
        self.model = EncoderClassifier(
            nn.Embedding(vocab_size, n_embd), seq_len, num_classes, n_layer, n_head, n_embd, dropout, pool
        )

    def make_data(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        hp = self.hparams
        x, y = make_majority(hp.n_train + hp.n_val, hp.seq_len, hp.vocab_size, hp.num_classes, hp.seed)
        return x[: hp.n_train], y[: hp.n_train], x[hp.n_train :], y[hp.n_train :]
