"""Benchmarks of mplaunch against raw ``torch.multiprocessing`` and other launchers; see ``run.py``."""
