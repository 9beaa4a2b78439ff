"""Runnable examples (``python -m torchrl_dcp.examples.<name>``, under ``torchrun``)."""
