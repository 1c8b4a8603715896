"""The launching process's side: the steps of a launch, the only code that starts and stops worker
processes (:mod:`.processes`), waiting for them (:mod:`.supervise`), checks before launching, the launch
directory, the rendezvous store, restarts, in-process runs and submitted launches (futures)."""
