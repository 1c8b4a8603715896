"""Imported by the fork server after its preloads, and nowhere else: freezes its objects (see ``exit``)."""

from mplaunch._worker.exit import freeze_fork_server

freeze_fork_server()
