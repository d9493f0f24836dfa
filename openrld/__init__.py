"""openrld: a self-hosted Tinker-compatible service for RL post-training."""

__version__ = "0.1.0"
