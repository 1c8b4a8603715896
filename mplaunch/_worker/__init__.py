"""What runs in a worker process: its entry point (:mod:`.entry`), the process group around the function,
stopping what the rank started (:mod:`.children`), and a normal interpreter's exit for its data
(:mod:`.exit`). Never imports the parent side."""
