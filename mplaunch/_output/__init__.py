"""Per-rank output: the worker's fd 1 and 2, the parent's reader thread, whole lines from several ranks."""
