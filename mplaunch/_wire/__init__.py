"""What crosses the process boundary: the records a launch exchanges with its workers, how they are pickled
and written to shared memory, and what a ``spawn``/``forkserver`` worker can import by name.

Both sides import this package; it imports neither (checked by the import contracts in ``pyproject.toml``).
"""
