"""Async checkpoints, exact resume and save points (see :mod:`yatt.checkpoint.files` for the layout)."""
