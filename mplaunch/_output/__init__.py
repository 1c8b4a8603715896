"""Per-rank output: the worker's fd 1 and 2 (:mod:`.fds`), the parent's reader thread (:mod:`.pump`), and
writing several ranks' text in whole lines (:mod:`.lines`)."""
