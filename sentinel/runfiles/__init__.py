"""Torch-free readers (and the few writers the CLI needs) of a run directory, one module per file kind.

``sentinel.rundir`` re-exports all of them as one API; the file names and formats are the
contract's (``sentinel.contract.rundir``).
"""
