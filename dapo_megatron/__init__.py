"""dapo_megatron: a Megatron-core backend for DAPO training."""

__version__ = "0.1.0"
