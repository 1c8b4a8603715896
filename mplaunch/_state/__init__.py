"""Process-global state captured in the parent and restored in a worker: torch flags and RNG states,
Python's warning filters, ``logging``, umask and limits; and making shared memory private (``unshare``)."""
