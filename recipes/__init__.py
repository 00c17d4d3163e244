"""Ready experiment templates: LightningModules that own their data.

Each recipe is instantiated from a Hydra config through ``_target_`` (for example
``amp_plugin.recipes.DigitsRecipe``) with plain keyword arguments, and is precision-agnostic:
the precision plugin decides the parameter and compute dtypes, the recipe computes its loss
in FP32. Copy a recipe's file to start your own experiment.

This folder is installed as the package ``amp_plugin.recipes`` (see ``pyproject.toml``).

- ``DigitsRecipe``: sklearn's 8x8 digits, MLP or small CNN (the default recipe).
- ``CharGPTRecipe``: a tiny character-level GPT on Python's standard-library sources.
- ``ViTRecipe``: a tiny Vision Transformer on generated images of shapes (AdamW, default betas).
- ``BertRecipe``: a tiny BERT-style classifier on a generated counting task (AdamW, default betas).
- ``UnderflowDemoRecipe``: gradients around 1e-8 that FP16 flushes to zero without loss scaling.
- ``StagnationDemoRecipe``: updates below half an FP16 ulp, lost without FP32 master weights.
"""

from amp_plugin.recipes.bert import BertRecipe
from amp_plugin.recipes.char_gpt import CharGPTRecipe
from amp_plugin.recipes.digits import DigitsRecipe
from amp_plugin.recipes.stagnation_demo import StagnationDemoRecipe
from amp_plugin.recipes.underflow_demo import UnderflowDemoRecipe
from amp_plugin.recipes.vit import ViTRecipe

__all__ = ["BertRecipe", "CharGPTRecipe", "DigitsRecipe", "StagnationDemoRecipe", "UnderflowDemoRecipe", "ViTRecipe"]
