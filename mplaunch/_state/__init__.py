"""Process-global state captured in the parent and restored in a worker; making shared memory private."""
