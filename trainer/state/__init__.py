"""An engine's state on disk: checkpoints and resharding, the 16-bit export, pretrained
weights in and out of HF checkpoint files.

Imports ``zero`` and everything below it.
"""
