"""The launching process's side: the one engine that owns a set of ranks (:mod:`.ranks`), the drivers over it
(a launch: :mod:`.launch`; warm workers: :mod:`.warm`), the only code that starts processes
(:mod:`.processes`), checks before launching, the launch directory, the rendezvous store, restarts, in-process
runs and submitted launches (futures)."""
