"""What runs in a worker process: entry, setup, outcome, exit, children. Never imports the parent side."""
