"""The OpenMP runtimes loaded in this process, and freeing their thread pools before a fork.

GNU OpenMP (libgomp, which PyTorch's Linux wheels ship) keeps a pool of threads after the first parallel
region. ``fork`` copies only the calling thread, so a forked child that enters a parallel region waits
forever for pool threads that do not exist in it. OpenMP 5.0's ``omp_pause_resource_all(omp_pause_hard)``
(OpenMP API 5.0, section 3.2.43) frees the pool; libgomp, LLVM's libomp and Intel's libiomp implement it.
The loaded runtimes are found by threadpoolctl (``ThreadpoolController``), which knows every OpenMP
runtime's names and never loads one.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any

from mplaunch._platform.environ import environ_kept

_OMP_PAUSE_HARD = 2  # omp_pause_resource_t: omp_pause_soft = 1, omp_pause_hard = 2
_scanned: tuple[int, list[Any]] = (-1, [])  # (len(sys.modules) when scanned, the runtimes' libraries)


def loaded_runtimes() -> list[Any]:
    """The loaded OpenMP runtimes, as ctypes libraries; looked up again only after new imports (a runtime
    is loaded by importing an extension), as the look-up costs about a millisecond."""
    global _scanned
    if _scanned[0] != len(sys.modules):
        with environ_kept():  # threadpoolctl sets KMP_DUPLICATE_LIB_OK when imported; the user did not
            from threadpoolctl import ThreadpoolController

        found = ThreadpoolController().select(internal_api="openmp").lib_controllers
        _scanned = (len(sys.modules), [controller.dynlib for controller in found])
    return _scanned[1]


def release_pools() -> bool:
    """Free the thread pool of every loaded OpenMP runtime (in the parent, before forking).

    Returns:
        True when no runtime is loaded or every loaded one freed its pool (forked workers may then use
        several threads); False when one could not (the call is missing, or another thread is inside a
        parallel region), in which case a forked worker that runs a parallel region could hang.
    """
    if not sys.platform.startswith("linux"):
        return True
    for library in loaded_runtimes():
        pause = getattr(library, "omp_pause_resource_all", None)
        if pause is None:
            return False
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        if pause(_OMP_PAUSE_HARD) != 0:
            return False
    return True
