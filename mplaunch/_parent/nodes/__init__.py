"""Launches over several nodes (``nnodes > 1``), through ``torch.distributed.elastic``."""
