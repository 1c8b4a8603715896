"""A rank that sets its own rendezvous gets it, as under ``torch.multiprocessing.spawn``.

mplaunch's parent hosts the launch's store (torchrun's "agent store"), so a rank is told
``TORCHELASTIC_USE_AGENT_STORE=True``: torch's ``env://`` and ``tcp://`` rendezvous then connect every rank,
rank 0 included, as a client of the store at ``MASTER_ADDR:MASTER_PORT``. Code written for ``mp.spawn`` (the
PyTorch DDP tutorial's ``ddp_setup``) sets ``MASTER_PORT`` itself in each rank and expects rank 0 to host the
store there: as a client of a port nobody serves, it would wait for ``init_process_group``'s timeout (30
minutes). When the port a rendezvous uses is not the one mplaunch hosts (``MPLAUNCH_HOSTED_MASTER_PORT``), the
rank drops ``TORCHELASTIC_USE_AGENT_STORE`` first, so torch does what it does without an agent: rank 0 hosts.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from typing import Any

from mplaunch._env import OWN_PORT_VARIABLE

AGENT_STORE_VARIABLE = "TORCHELASTIC_USE_AGENT_STORE"


def follow_own_rendezvous() -> None:
    """Make torch's rendezvous in this process honour a port the rank chose itself (see the module's doc).

    Wraps ``torch.distributed.rendezvous._create_c10d_store``, which both the ``env://`` and ``tcp://``
    handlers call with the address they read; installed once. It acts only while this process runs a rank of
    an mplaunch launch whose parent hosts the store (``MPLAUNCH_HOSTED_MASTER_PORT`` is set), so a process
    that torchrun started keeps its agent store.
    """
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
    """The wrapper of torch's ``_create_c10d_store`` that :func:`follow_own_rendezvous` installs."""

    @functools.wraps(original)
    def create_store(hostname: str, port: int, *args: Any, **kwargs: Any) -> Any:
        hosted = os.environ.get(OWN_PORT_VARIABLE)
        if hosted is not None and str(port) != hosted and os.environ.get(AGENT_STORE_VARIABLE) == "True":
            del os.environ[AGENT_STORE_VARIABLE]  # the rank's own rendezvous: rank 0 hosts it
        return original(hostname, port, *args, **kwargs)

    create_store._mplaunch = True  # type: ignore[attr-defined]
    return create_store


def _made_on_import() -> dict[int, tuple[Any, Any]]:
    """The wrapper, made once where this module is imported (a launching process) for torch's function as it
    is then: a forked worker only installs it (each worker making its own cost a tenth of a millisecond)."""
    rendezvous = sys.modules.get("torch.distributed.rendezvous")
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None or getattr(original, "_mplaunch", False):
        return {}
    return {id(original): (original, _wrap(original))}


_MADE = _made_on_import()
