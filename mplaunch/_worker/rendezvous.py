"""A rank that sets its own rendezvous gets it, as under ``torch.multiprocessing.spawn``.

The parent hosts the store (``TORCHELASTIC_USE_AGENT_STORE=True``); ``mp.spawn`` code sets ``MASTER_PORT`` and
expects rank 0 to host, else waits 30 minutes. On another port than the hosted one, the agent store is dropped."""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any

from mplaunch._env import OWN_PORT_VARIABLE

AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


def follow_own_rendezvous() -> None:
    """Wrap torch's ``_create_c10d_store`` to honour a rank's own port where ``MPLAUNCH_HOSTED_MASTER_PORT`` is set."""
    rendezvous = sys.modules.get("torch.distributed.rendezvous")  # not the function of that name
    if rendezvous is None:
        try:
            rendezvous = importlib.import_module("torch.distributed.rendezvous")
        except ImportError:  # torch built without distributed
            return
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None or getattr(original, "_mplaunch", False):
        return
    made = _MADE.get(id(original))
    wrapper = made[1] if made is not None and made[0] is original else _wrap(original)
    setattr(rendezvous, "_create_c10d_store", wrapper)  # noqa: B010 - a private name mypy does not know


def _wrap(original: Any) -> Any:
    """Return the wrapper :func:`follow_own_rendezvous` installs."""

    @functools.wraps(original)
    def create_store(hostname: str, port: int, *args: Any, **kwargs: Any) -> Any:
        hosted = os.environ.get(OWN_PORT_VARIABLE)
        if hosted is not None and str(port) != hosted and os.environ.get(AGENT_STORE_VARIABLE) == "True":
            del os.environ[AGENT_STORE_VARIABLE]  # the rank's own rendezvous: rank 0 hosts it
        return original(hostname, port, *args, **kwargs)

    create_store._mplaunch = True  # type: ignore[attr-defined]
    return create_store


def _made_on_import() -> dict[int, tuple[Any, Any]]:
    """Make the wrapper once at import, in the parent: a forked worker only installs it (speed: 0.1 ms each)."""
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None or getattr(original, "_mplaunch", False):
        return {}
    return {id(original): (original, _wrap(original))}


_MADE = _made_on_import()
