"""Sweeps: campaign -> matched blocks (plan), resource accounting, the Ray Tune runner and its progress display.

``ablate.sweep.plan`` imports neither Ray nor torch (``ablate validate`` uses it); ``run`` loads Ray lazily.
"""
