"""What crosses the process boundary: records, pickling, shared-memory transport, what a worker can import."""
