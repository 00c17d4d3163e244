"""``train(cfg)`` as in lightning-hydra-template: instantiate data, model, callbacks, loggers and
trainer from the config, fit, return the metrics. Nothing here knows about amp_plugin: it comes
in through ``configs/trainer`` (the plugin) and ``configs/callbacks`` (its callbacks)."""

from __future__ import annotations

from typing import Any

import hydra
import lightning as L
from omegaconf import DictConfig


def instantiate_group(node: DictConfig | None) -> list[Any]:
    return [hydra.utils.instantiate(entry) for entry in (node or {}).values() if entry is not None]


def train(cfg: DictConfig) -> tuple[dict[str, Any], L.Trainer]:
    if cfg.get("seed") is not None:
        L.seed_everything(cfg.seed, workers=True)
    datamodule = hydra.utils.instantiate(cfg.data)
    model = hydra.utils.instantiate(cfg.model)
    callbacks = instantiate_group(cfg.get("callbacks"))
    logger = instantiate_group(cfg.get("logger"))
    trainer: L.Trainer = hydra.utils.instantiate(cfg.trainer, callbacks=callbacks, logger=logger)
    # The module's hyperparameters hold Hydra partials, which torch.load's weights_only mode refuses.
    trainer.fit(model=model, datamodule=datamodule, ckpt_path=cfg.get("ckpt_path"), weights_only=False)
    return dict(trainer.callback_metrics), trainer


@hydra.main(version_base="1.3", config_path="../configs", config_name="train.yaml")
def main(cfg: DictConfig) -> None:
    train(cfg)


if __name__ == "__main__":
    main()
