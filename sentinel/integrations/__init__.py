"""Drop-in integrations of the sentinel with training frameworks (each imports its framework itself):

- ``sentinel.integrations.hf``: a ``transformers.TrainerCallback`` and a relaunching ``train(trainer)``;
- ``sentinel.integrations.lightning``: a ``lightning.pytorch.Callback``;
- ``sentinel.integrations.torch_data``: skip-list-aware data with stable sample ids, for any torch loop.

Importing this package imports no framework and no torch.
"""
