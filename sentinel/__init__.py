"""sentinel: keeps long PyTorch LLM pretraining runs alive and honest.

Import-light on purpose: ``sentinel.protocol`` is the contract the trainer imports, and the pure
core (detectors, rules, policy) needs no torch.
"""

__version__ = "0.1.0"
