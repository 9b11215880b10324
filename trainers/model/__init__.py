"""The hybrid A/M/E/R language model trained by every trial.

How to use::

    from trainers.model import HybridLM, parse_pattern
    model = HybridLM(lane.model, lane.features, dispatcher)

See ``hybrid.py`` (model), ``blocks.py`` (the four block families), ``pattern.py`` (layer grammar and presets),
``flops.py`` (FLOPs per token with its convention).
"""

from trainers.model.hybrid import HybridLM, LMOutput
from ablate.config.pattern import PRESETS, family_counts, parse_pattern

__all__ = ["HybridLM", "LMOutput", "PRESETS", "family_counts", "parse_pattern"]
