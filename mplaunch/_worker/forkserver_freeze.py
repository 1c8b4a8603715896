"""Imported by the fork server after the modules it preloads (see ``_launcher._preload``), and nowhere else:
freezes the server's objects so that its workers' exit walks only what they create (``_exit``)."""

from mplaunch._worker.exit import freeze_fork_server

freeze_fork_server()
