"""Half-precision training state: clipshard.optim.AdamW (16-bit weights and moments written with
stochastic rounding, adamw.py), to_half_precision_ (converts a model's weights), and the FSDP2
DTensor support that both use (dtensor.py). Imports: torch, clipshard.rounding and top-level helpers.
"""
from clipshard.optim.adamw import AdamW, second_moment_key, to_half_precision_

__all__ = ["AdamW", "second_moment_key", "to_half_precision_"]
