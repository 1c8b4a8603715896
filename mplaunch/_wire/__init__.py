"""What crosses the process boundary: the records exchanged with workers, their pickling and shared-memory
transport, and what a ``spawn``/``forkserver`` worker can import by name. Imports neither side."""
