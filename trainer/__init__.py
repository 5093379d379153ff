"""trainer: a distributed GPT pretraining loop with full-state checkpoints and bitwise-exact resume."""

__version__ = "0.1.0"
