"""Train a recipe with mixed precision: ``python train.py precision=fp16 recipe=digits``.

Configs live in ``configs/`` (``python train.py --help`` lists the groups and options).
Tests and notebooks call :func:`amp_plugin.app.run.train` with a composed config instead.
"""

import hydra
from omegaconf import DictConfig

from amp_plugin.app.cli import run_job
from amp_plugin.app.overrides import check_overrides
from amp_plugin.app.schema import register_configs

register_configs()


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_job(cfg)


if __name__ == "__main__":
    check_overrides()  # an unquoted ~ or bracket in a value: the fix in one line, not Hydra's lexer error
    main()
