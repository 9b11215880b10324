"""The hybrid A/M/E/R language model trained by every trial.

How to use::

    from trainers.model import HybridLM, parse_pattern
    model = HybridLM(lane.model, lane.features, dispatcher)

See ``hybrid.py`` (model), ``blocks.py`` (the four block families), ``flops.py`` (FLOPs per token with its
convention); the layer grammar and presets live in ``ablate/config/pattern.py`` (torch-free, re-exported here).
"""

from trainers.model.hybrid import HybridLM, LMOutput
from ablate.config.pattern import PRESETS, family_counts, parse_pattern

__all__ = ["HybridLM", "LMOutput", "PRESETS", "family_counts", "parse_pattern"]
