"""The faces other tools expect: the DeepSpeed facade (``deepspeed.*`` modules for HF and
Accelerate), Lightning's strategy, and the version checks of both.

Imports ``trainer.api`` (``initialize``) and every layer below it; only ``demo`` and the user
entry modules sit above it.
"""
