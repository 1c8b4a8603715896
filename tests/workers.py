"""Module-level worker functions for the integration tests (importable by spawn/forkserver workers)."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
import time
from typing import Any

import torch

from mplaunch import Workers, parallel, worker_info


@dataclasses.dataclass
class Point:
    x: torch.Tensor
    label: str


def identity(*args: Any, **kwargs: Any) -> Any:
    return args, kwargs


def rank_and_env() -> dict[str, Any]:
    names = (
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMP_NUM_THREADS",
    )
    return {
        "info": worker_info(),
        "env": {n: os.environ.get(n) for n in names},
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
    }


def all_reduce_rank() -> torch.Tensor:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        value = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(value)
        return value
    finally:
        dist.destroy_process_group()


def big_result(megabytes: int) -> dict[str, Any]:
    n = megabytes * 2**20 // 4
    return {"tensor": torch.arange(n, dtype=torch.float32), "view": None, "meta": "ok"}


def nested_result() -> Any:
    base = torch.arange(10.0)
    return {
        "list": [base, base[2:5]],
        "tuple": (torch.ones(2, dtype=torch.bfloat16), 3),
        "point": Point(torch.zeros(3), "p"),
        "module": torch.nn.Linear(2, 3),
        "state": torch.nn.Linear(4, 5).state_dict(),
        "ints": list(range(100_000)),
    }


def raise_value_error(message: str = "bad value") -> None:
    if worker_info().rank == 1:
        raise ValueError(message)
    time.sleep(300)  # stopped long before, when rank 1 fails


def raise_everywhere() -> None:
    time.sleep(0.2 * worker_info().rank)
    raise KeyError(f"rank {worker_info().rank}")


def raise_everywhere_rank1_when_stopped(ready: str) -> None:
    """Rank 0 raises once rank 1 holds SIGTERM; rank 1 raises when the launch's stop (its SIGTERM) arrives."""
    if worker_info().rank == 1:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        open(ready, "w").close()
        signal.sigtimedwait({signal.SIGTERM}, 60)
    while not os.path.exists(ready):
        time.sleep(0.01)
    raise KeyError(f"rank {worker_info().rank}")


def exit_zero_on_rank0() -> int:
    if worker_info().rank == 0:
        sys.exit(0)
    return 1


def os_exit_on_rank(rank: int, code: int) -> int:
    if worker_info().rank == rank:
        sys.stdout.flush()
        os._exit(code)
    return worker_info().rank


def kill_self(signum: int) -> None:
    if worker_info().rank == 1:
        import faulthandler

        faulthandler.disable()  # pytest's crash dump, inherited through fork, would only add noise
        os.kill(os.getpid(), signum)
    time.sleep(30)


def sleep(seconds: float) -> int:
    time.sleep(seconds)
    return worker_info().rank


def launch_store() -> Any:
    """A client of the launch's c10d store (MASTER_ADDR:MASTER_PORT), as a bare TCPStore."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    return TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=60))


def meet(name: str) -> None:
    """Wait until every rank of the launch has called ``meet(name)`` (a barrier on the launch's c10d store, no
    process group)."""
    info = worker_info()
    store = launch_store()
    store.set(f"{name}-{info.rank}", "")
    store.wait([f"{name}-{rank}" for rank in range(info.world_size)])


def mutate(module: torch.nn.Linear, tensor: torch.Tensor) -> dict[str, float]:
    rank = worker_info().rank
    with torch.no_grad():
        module.weight.add_(rank + 1)
        tensor.add_(rank + 1)
    meet("updated")  # the other rank's update has landed, if memory were shared
    return {"weight": module.weight.sum().item(), "tensor": tensor.sum().item()}


class _DrawsDataset(torch.utils.data.Dataset[list[float]]):
    def __len__(self) -> int:
        return 2

    def __getitem__(self, index: int) -> list[float]:
        import random

        import numpy

        return [random.random(), float(numpy.random.rand()), torch.rand(1).item()]


def draws_and_loader_draws() -> list[float]:
    """This rank's Python, NumPy and torch draws, then what its DataLoader's worker draws for two samples."""
    import random

    import numpy

    loader = torch.utils.data.DataLoader(_DrawsDataset(), batch_size=None, num_workers=1)
    return [random.random(), float(numpy.random.rand()), torch.rand(1).item(), *[x for s in loader for x in s]]


def random_draws() -> dict[str, Any]:
    import random

    import numpy

    model = torch.nn.Linear(4, 3)
    return {
        "python": random.random(),
        "numpy": numpy.random.rand(3),
        "torch": torch.rand(3),
        "weight": model.weight.detach().clone(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul": torch.get_float32_matmul_precision(),
        "dtype": torch.get_default_dtype(),
    }


def ignore_sigterm_and_sleep(seconds: float) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if worker_info().rank == 1:
        raise RuntimeError("rank 1 fails")
    time.sleep(seconds)


def _wait_for(path: str, timeout: float = 60) -> None:
    """Wait until ``path`` exists; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.01)


def _write(path: str, text: str) -> None:
    with open(path, "w") as file:
        file.write(text)


def finally_marker(path: str) -> None:
    """Rank 0 registers an atexit handler and waits in a try block (ready: ``path.ready``); then rank 1 fails."""
    if worker_info().rank == 1:
        _wait_for(path + ".ready")
        raise RuntimeError("rank 1 fails")
    import atexit

    atexit.register(_write, path + ".atexit", "atexit ran")
    try:
        _write(path + ".ready", "")
        time.sleep(30)
    finally:
        with open(path, "w") as file:
            file.write("finally ran")


class Unpicklable(Exception):
    def __reduce__(self) -> Any:
        raise TypeError("this exception refuses to be pickled")


def raise_unpicklable() -> None:
    raise Unpicklable("custom failure")


def raise_huge_message(size: int) -> None:
    raise RuntimeError("x" * size)


def return_unpicklable() -> Any:
    import threading

    return {"lock": threading.Lock()}


class Holder:
    """An object whose attribute cannot be pickled (a lock, deep inside a result or an argument)."""

    def __init__(self) -> None:
        import threading

        self.weights = torch.ones(3)
        self.logger = threading.Lock()


def return_holder() -> dict[str, Any]:
    return {"epochs": 3, "trainer": Holder()}


def yield_holder() -> Any:
    yield 1
    yield [Holder()]


def init_own_group() -> int:
    """Initialise the default process group in the function, as code written for torchrun does."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    return dist.get_rank()


def return_open_file(path: str) -> Any:
    return open(path, "w")  # noqa: SIM115 - the result under test


def keyboard_interrupt_on_rank0() -> int:
    if worker_info().rank == 0:
        raise KeyboardInterrupt
    return 1


def call_holding(function: Any, lock: Any) -> Any:
    with lock:
        return function()


def read_env(name: str) -> str | None:
    return os.environ.get(name)


class NeedsTwoArguments(Exception):
    """Pickles, but cannot be unpickled: BaseException pickles args=(message,), and __init__ needs two."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")


def raise_needs_two_arguments() -> None:
    raise NeedsTwoArguments(7, "cannot be rebuilt")


def cuda_result() -> dict[str, Any]:
    device = torch.device("cuda", worker_info().local_rank % torch.cuda.device_count())
    return {
        "tensor": torch.arange(4.0, device=device),
        "module": torch.nn.Linear(2, 2).to(device),
        "big": torch.ones(1 << 20, device=device),
    }


def all_reduce_in_given_group() -> tuple[int, float]:
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return dist.get_world_size(), value.item()


def chatty(lines: int) -> int:
    rank = worker_info().rank
    for i in range(lines):
        print(f"out {i} from {rank}", flush=i % 2 == 0)
    print(f"err from {rank}", file=sys.stderr)
    sys.stdout.write("no newline at the end")
    return rank


def newer_dtypes() -> dict[str, torch.Tensor]:
    return {
        "uint16": torch.arange(60_000, dtype=torch.int32).to(torch.uint16),
        "f8": torch.ones(8).to(torch.float8_e4m3fn),
    }


def nested_launch() -> list[tuple[int, float]]:
    """A launch from inside a worker that really launches (MPLAUNCH_IN_PROCESS=0): it hosts its own store."""
    from mplaunch import parallel

    os.environ["MPLAUNCH_IN_PROCESS"] = "0"

    inner = parallel(nprocs=2, start_method="fork", backend="gloo", return_all=True, timeout=60)
    return inner(all_reduce_in_given_group)()


def leave_a_thread_running() -> int:
    import threading

    threading.Thread(target=time.sleep, args=(120,), daemon=False).start()
    return worker_info().rank


class BrokenStr(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ is broken")


def raise_broken_str() -> None:
    if worker_info().rank == 1:
        raise BrokenStr("hidden")
    time.sleep(30)  # stopped when rank 1 fails


def raise_at_once() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()  # both ranks raise within microseconds of each other
    raise KeyError(f"rank {worker_info().rank}")


def anonymous_memory_after_reading(tensor: torch.Tensor) -> int:
    float(tensor.sum())  # touch every page
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("RssAnon:"))
    return int(line.split()[1]) * 1024


class Trainer:
    """A class with a decorated method, found by spawn workers by its module and name."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    @parallel(nprocs=1, start_method="spawn", timeout=120)
    def fit(self, x: int) -> int:
        return self.offset + x


class Model:
    def __init__(self, scale: int) -> None:
        self.scale = scale

    def times(self, x: int) -> int:
        return self.scale * x


def load_through_dataloader(x: torch.Tensor, contexts: tuple[str | None, ...]) -> dict[str, Any]:
    """Issue 10: a tensor argument used by DataLoader workers, a queue to the rank's own child, share_memory_
    and torch.save, as in a process that torchrun starts."""
    import io
    import multiprocessing

    from torch.utils.data import DataLoader, TensorDataset

    counts = {}
    for context in contexts:
        loader = DataLoader(  # (one worker where each imports torch)
            TensorDataset(x),
            batch_size=1000,
            num_workers=2 if context is None else 1,
            multiprocessing_context=context,
            persistent_workers=True,
        )
        counts[str(context)] = sum(len(batch[0]) for _ in range(2) for batch in loader)
    queue = torch.multiprocessing.get_context("fork").SimpleQueue()
    queue.put(x)
    received = queue.get()
    buffer = io.BytesIO()
    torch.save(x, buffer)
    x.share_memory_()
    return {
        "counts": counts,
        "default_start_method": multiprocessing.get_start_method(),
        "queued": bool(torch.equal(received, x)),
        "saved": len(buffer.getvalue()) > x.numel() * 4,
        "shared": x.is_shared(),
    }


def outer_with_nested_call() -> dict[str, Any]:
    """Issue 10: a parallel function called inside a rank runs in-process as that rank."""
    import torch.distributed as dist

    from mplaunch import parallel

    inner = parallel(nprocs=2, backend="gloo", timeout=60)(inner_collective)
    value, pid = inner()
    return {"value": value, "same_pid": pid == os.getpid(), "group_kept": dist.is_initialized()}


def inner_collective() -> tuple[float, int]:
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item(), os.getpid()


class SlowToPickle:
    """A value whose pickling takes ``seconds``: rank 0 is still writing its outcome when the stop comes.
    Pickling creates ``started`` first, if given."""

    def __init__(self, seconds: float, started: str | None = None) -> None:
        self.seconds = seconds
        self.started = started

    def __reduce__(self) -> tuple[Any, ...]:
        if self.started:
            _write(self.started, "")
        time.sleep(self.seconds)
        return (SlowToPickle, (0.0,))


def slow_result_while_rank1_raises(seconds: float, started: str) -> Any:
    """Rank 0 returns a value whose pickling takes ``seconds``; rank 1 raises once that pickling has begun."""
    if worker_info().rank == 1:
        _wait_for(started)
        raise RuntimeError("hello")
    return SlowToPickle(seconds, started)


def raise_from_every_rank() -> None:
    """torch's test_exception_all: every rank raises after a random short sleep."""
    import random

    time.sleep(random.random() / 10)
    raise ValueError(f"legitimate exception from process {worker_info().rank}")


class StoppedWhilePickled(ValueError):
    """An error that sends its own worker SIGTERM when it is pickled: a stop (a peer failed, the launch ends)
    that lands while the rank records its failure."""

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        os.kill(os.getpid(), signal.SIGTERM)
        return type(self), self.args


def raise_stopped_while_pickled() -> None:
    raise StoppedWhilePickled("the rank's own error")


def killed_then_peer_fails(directory: str, after: float = 0.2) -> None:
    """Rank 1 ends by SIGKILL at once; rank 0 raises ``after`` seconds after rank 1 has ended, as a collective
    fails of a peer's death (gloo's "Connection closed by peer")."""
    marker = os.path.join(directory, "rank1.pid")
    if worker_info().rank == 1:
        with open(marker + ".tmp", "w") as file:
            file.write(str(os.getpid()))
        os.rename(marker + ".tmp", marker)
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.005)
    with open(marker) as file:
        pid = int(file.read())
    while time.monotonic() < deadline:  # until it has ended: a zombie, or reaped and gone
        try:
            with open(f"/proc/{pid}/stat") as file:
                if file.read().rpartition(")")[2].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.005)
    time.sleep(after)
    raise ValueError("a collective failed: rank 1 is gone")


def raise_on_rank(rank: int) -> None:
    """torch's test_exception_single."""
    if worker_info().rank == rank:
        raise ValueError(f"legitimate exception from process {rank}")
    time.sleep(30)


def exit_on_rank0(code: Any) -> int:
    """torch's test_terminate_exit and CPython's exit codes: ``sys.exit(code)`` on rank 0."""
    if worker_info().rank == 0:
        sys.exit(code)
    time.sleep(30)
    return 1


def return_then_raise() -> None:
    """torch's test_success_first_then_exception."""
    if worker_info().rank == 0:
        return
    time.sleep(0.1)
    raise ValueError("legitimate exception")


def _sleep_forever(index: int) -> None:
    time.sleep(600)


def start_children_then(action: str, pid_file: str) -> int:
    """Start two non-daemon children with ``torch.multiprocessing.start_processes(join=False)`` (torch's
    test_nested), record their pids, then ``action``: ``"return"``, ``"raise"``, ``"sigterm"`` (kill self)
    or ``"wait"`` (to be stopped by the launch)."""
    from torch.multiprocessing.spawn import start_processes

    context = start_processes(_sleep_forever, nprocs=2, join=False, daemon=False, start_method="fork")
    if worker_info().rank == 0:
        _write(pid_file, " ".join(str(pid) for pid in context.pids()))
    if action == "raise":
        raise ValueError("done with an error")
    if action == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    if action == "wait":
        time.sleep(600)
    return worker_info().rank


def forked_child_then(action: str, pid_file: str) -> int:
    """Start a plain multiprocessing child that sleeps 600 s, then return or raise."""
    import multiprocessing

    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
    child.start()
    if worker_info().rank == 0:
        _write(pid_file, str(child.pid))
    if action == "raise":
        raise ValueError("done with an error")
    return worker_info().rank


def fail_after(seconds: float) -> None:
    if worker_info().rank == 1:
        time.sleep(seconds)
        raise RuntimeError("peer failed")
    time.sleep(600)


def dataloader_forever(directory: str, fail: bool = False) -> None:
    """Iterate a DataLoader with worker processes until stopped (issue 10: a stop prints nothing). Each rank
    creates ``directory/ready-<rank>`` once its DataLoader delivered a batch; with ``fail``, rank 1 raises
    RuntimeError once every rank is ready."""
    from torch.utils.data import DataLoader, TensorDataset

    info = worker_info()
    loader = DataLoader(TensorDataset(torch.arange(1000.0)), batch_size=10, num_workers=2, persistent_workers=True)
    ready = [os.path.join(directory, f"ready-{rank}") for rank in range(info.world_size)]
    while True:
        for _ in loader:
            if not os.path.exists(ready[info.rank]):
                _write(ready[info.rank], "")
            if fail and info.rank == 1 and all(os.path.exists(path) for path in ready):
                raise RuntimeError("peer failed")


def tied_result(device: str) -> dict[str, Any]:
    """Issue 11: tensors sharing one storage (a view, tied embedding weights), on ``device``."""
    if device == "cuda":
        device = f"cuda:{worker_info().local_rank % torch.cuda.device_count()}"
    base = torch.arange(1 << 16, dtype=torch.float32, device=device)
    embedding = torch.nn.Embedding(10, 4).to(device)
    head = torch.nn.Linear(4, 10, bias=False).to(device)
    head.weight = embedding.weight  # tied
    return {"base": base, "view": base[100:200], "embedding": embedding, "head": head}


def fail_while_peer_in_collective() -> None:
    """Rank 1 raises ValueError while rank 0 waits in all_reduce, which then fails too (gloo: connection
    closed by peer): the root cause is rank 1's ValueError."""
    import torch.distributed as dist

    store = launch_store()
    if worker_info().rank == 1:
        store.wait(["entering all_reduce"])
        raise ValueError("the root cause")
    store.set("entering all_reduce", "")
    dist.all_reduce(torch.ones(1))


def fork_and_fall_through(seconds: float) -> tuple[str, int]:
    """The function forks and the child returns instead of calling os._exit (a user's mistake)."""
    if os.fork() == 0:
        time.sleep(seconds)
        return ("child", os.getpid())
    return ("parent", os.getpid())


def plain_store_client() -> list[str]:
    """Meet the other ranks through the launch's store as a bare c10d client (no process group)."""
    from datetime import timedelta

    from torch.distributed import TCPStore  # type: ignore[attr-defined]

    info = worker_info()
    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timeout=timedelta(seconds=60))
    store.set(f"rank{info.rank}", str(os.getpid()))
    keys = [f"rank{rank}" for rank in range(info.world_size)]
    store.wait(keys)
    return [store.get(key).decode() for key in keys]


def log_through_memory_handlers(inherited_name: str, own_path: str, side_name: str) -> None:
    """Log a warning through the parent's MemoryHandler (on logger ``inherited_name``) and one through a
    MemoryHandler made here (to ``own_path.<rank>``), after freeing the handlers of logger ``side_name``."""
    import logging
    import logging.handlers

    logging.getLogger(side_name).handlers.clear()  # freed: logging drops its reference to them
    rank = worker_info().rank
    logging.getLogger(inherited_name).warning("rank %d, through the parent's handler", rank)
    target = logging.FileHandler(f"{own_path}.{rank}")
    own = logging.handlers.MemoryHandler(100, flushLevel=logging.CRITICAL + 1, target=target)
    logger = logging.getLogger(f"{inherited_name}.own")
    logger.propagate = False
    logger.addHandler(own)
    logger.warning("rank %d, through its own handler", rank)


def zeros_result() -> dict[str, Any]:
    """A module, a tensor and a NumPy array of zeros, each large enough (256 KiB+) to come back mapped."""
    import numpy

    module = torch.nn.Linear(256, 256, bias=False)
    torch.nn.init.zeros_(module.weight)
    return {"module": module, "tensor": torch.zeros(1 << 16), "array": numpy.zeros(1 << 16)}


def mutate_items(items: dict[str, Any]) -> dict[str, float]:
    """Add rank + 1 in place to ``items``' module, tensor and array; their sums once the peer has too."""
    rank = worker_info().rank
    with torch.no_grad():
        items["module"].weight.add_(rank + 1)
    items["tensor"].add_(rank + 1)
    items["array"] += rank + 1
    meet("updated")  # the other rank's update has landed, if memory were shared
    return {key: float(items[key].sum()) for key in ("tensor", "array")} | {
        "weight": items["module"].weight.sum().item()
    }


# --- objects that multiprocessing sends only to a starting process (test_handles.py) --------------------


@dataclasses.dataclass
class LogQueue:
    """A logging ``QueueHandler``'s queue, inside a dataclass."""

    queue: Any


class Counter:
    """A plain object holding a shared value and the lock that guards it."""

    def __init__(self, value: Any, lock: Any) -> None:
        self.value = value
        self.lock = lock


def use_start_objects(queue: Any, sync: dict[str, Any], counters: list[Any], conn: Any, shared: Any) -> int:
    """Use each object the way mp.spawn code does; the parent checks what the ranks did through them."""
    import logging.handlers

    rank = worker_info().rank
    queue.put(rank)
    if rank == 1:
        sync["event"].set()
    elif not sync["event"].wait(60):
        raise TimeoutError("rank 1 never set the Event")
    sync["barrier"].wait(60)
    value, counter = counters
    with value.get_lock():
        value.value += 1
    with counter.lock:
        counter.value.value += 1
    shared[rank] = os.getpid()
    if rank == 0:
        conn.send("hello from rank 0")
        tensor = sync["tensors"].get(timeout=60)
        tensor.add_(1)  # torch shared memory: the parent's tensor changes too
    logger = logging.getLogger(f"mplaunch-start-objects-{rank}")
    logger.propagate = False
    logger.addHandler(logging.handlers.QueueHandler(sync["log"].queue))
    logger.warning("rank %d logs through the queue", rank)
    return rank


def put_rank(queue: Any) -> int:
    """Put this rank into ``queue``."""
    rank = worker_info().rank
    queue.put(rank)
    return rank


def device_trial(directory: str, name: str) -> str:
    """Write ``name.start`` (when, and the devices seen), wait for the test's ``release`` file, write ``name.end``."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    with open(os.path.join(directory, f"{name}.start"), "w") as file:
        file.write(f"{time.monotonic()} {visible}")
    while not os.path.exists(os.path.join(directory, "release")):
        time.sleep(0.01)
    with open(os.path.join(directory, f"{name}.end"), "w") as file:
        file.write(str(time.monotonic()))
    return visible


def placement_seen() -> dict[str, Any]:
    """What placement this rank got: its CPUs, threads and a few variables."""
    return {
        "rank": worker_info().rank,
        "cpus": sorted(os.sched_getaffinity(0)),
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "threads": torch.get_num_threads(),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "extra": {k: v for k, v in os.environ.items() if k.startswith("PLACEMENT_")},
    }


def import_and_warn() -> list[str]:
    """Import ``fork_given_path`` (on env='s PYTHONPATH); whether a UserWarning is raised or only warned."""
    import warnings

    import fork_given_path  # type: ignore[import-not-found]

    try:
        warnings.warn("a warning", UserWarning, stacklevel=1)
    except UserWarning:
        return [fork_given_path.VALUE, "raised"]
    return [fork_given_path.VALUE, "warned"]


def touch(path: str) -> None:
    with open(path, "w"):
        pass


def cuda_seen() -> tuple[str | None, int]:
    """This rank's CUDA_VISIBLE_DEVICES and the number of devices torch sees."""
    return os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()


def stuck_here(seconds: float) -> None:
    """Issue 22: where a rank is stuck, in the user's code."""
    time.sleep(seconds)


def stuck_or_in_barrier(seconds: float) -> None:
    """Issue 22: rank 0 stuck in a user function, the others waiting for it in a gloo barrier."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        if dist.get_rank() == 0:
            stuck_here(seconds)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def blocked_in_read(ready: str) -> None:
    """Issue 22: every rank blocked in a C call (a read from a pipe nobody writes)."""
    read_end, write_end = os.pipe()
    open(f"{ready}.{worker_info().rank}", "w").close()
    os.read(read_end, 1)
    os.close(write_end)


def waiting_here(ready: str, seconds: float) -> int:
    """Issue 22: each rank says it runs, then waits (future.stacks() looks meanwhile)."""
    open(f"{ready}.{worker_info().rank}", "w").close()
    time.sleep(seconds)
    return worker_info().rank


def catches(signum: int) -> bool:
    """Whether this process has a handler for ``signum`` (the kernel's ``SigCgt`` mask, which also shows a
    handler that C code, such as faulthandler's, installed)."""
    with open("/proc/self/status") as status:
        mask = next(int(line.split()[1], 16) for line in status if line.startswith("SigCgt:"))
    return bool(mask >> (signum - 1) & 1)


def silent_here(seconds: float) -> None:
    time.sleep(seconds)


def beat_then_fall_silent(silent_rank: int, beats: int, period: float) -> int:
    """Issue 22: every rank beats ``beats`` times, ``period`` s apart; ``silent_rank`` then stops beating
    (and sleeps), the others keep beating until the launch stops them."""
    import mplaunch

    rank = worker_info().rank
    for _ in range(beats):
        mplaunch.heartbeat()
        time.sleep(period)
    if rank == silent_rank:
        silent_here(60)
    while True:
        mplaunch.heartbeat()
        time.sleep(period)


def beat_or_not(beating_ranks: tuple[int, ...], seconds: float, period: float) -> int:
    """Issue 22: the ranks in ``beating_ranks`` beat every ``period`` s, the others never; all return after
    ``seconds``."""
    import mplaunch

    rank = worker_info().rank
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if rank in beating_ranks:
            mplaunch.heartbeat()
        time.sleep(period)
    return rank


def allocate_until_killed(rank: int) -> None:
    """Issue 22: ``rank`` allocates (and touches) memory until the out-of-memory killer ends it."""
    if worker_info().rank != rank:
        time.sleep(120)
        return
    import faulthandler

    faulthandler.disable()  # pytest's crash dump, inherited through fork, would only add noise
    chunks = []
    while True:
        chunks.append(bytearray(b"\x01") * (32 << 20))


def rank1_frozen(ready: str) -> None:
    """Issue 22: rank 1 stops itself (SIGSTOP): it cannot dump its stacks; rank 0 waits in a user function."""
    open(f"{ready}.{worker_info().rank}", "w").close()
    if worker_info().rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    stuck_here(60)


class Endless(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """0, 1, 2, ... without end (a DataLoader worker process serves it)."""

    def __iter__(self) -> Any:
        count = 0
        while True:
            yield torch.tensor([float(count)])
            count += 1


def save_when_preempted(directory: str) -> int:
    """Read batches from a DataLoader with one worker process until ``mplaunch.preempted()``; then read one more
    batch, save ``ckpt_rank{N}.pt`` and return the rank. ``ready-{N}`` holds the pids of the rank and of its
    DataLoader worker once the loader runs."""
    import psutil

    from mplaunch import preempted

    rank = worker_info().rank
    batches = iter(torch.utils.data.DataLoader(Endless(), batch_size=None, num_workers=1))
    seen = [next(batches)]
    pids = [os.getpid(), *(child.pid for child in psutil.Process().children())]
    _write(os.path.join(directory, f"ready-{rank}.tmp"), " ".join(map(str, pids)))
    os.rename(os.path.join(directory, f"ready-{rank}.tmp"), os.path.join(directory, f"ready-{rank}"))
    deadline = time.monotonic() + 120
    while not worker_info().preempted:
        if time.monotonic() > deadline:
            raise TimeoutError("never preempted")
        seen.append(next(batches))
        time.sleep(0.01)
    seen.append(next(batches))  # the DataLoader worker still serves after the notice
    assert preempted()
    torch.save({"rank": rank, "seen": len(seen), "last": seen[-1]}, os.path.join(directory, f"ckpt_rank{rank}.pt"))
    return rank


def record_start_then_raise(directory: str, kind: str, succeed_at: int = -1) -> int:
    """Append this attempt's start time to ``starts``; raise ``kind`` (``ValueError``, ``ConnectionError``,
    ``retry``/``fatal`` as ``RuntimeError``, ``kill`` by SIGKILL) unless the attempt is ``succeed_at``."""
    info = worker_info()
    with open(os.path.join(directory, "starts"), "a") as file:
        file.write(f"{time.monotonic()}\n")
    if info.restart_count == succeed_at:
        return info.restart_count
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    errors: dict[str, BaseException] = {
        "value": ValueError("bad input"),
        "connection": ConnectionError("peer went away"),
        "retry": RuntimeError("flaky: retry me"),
        "fatal": RuntimeError("fatal"),
    }
    raise errors[kind]


def _append(path: str, text: str) -> None:
    with open(path, "a") as file:
        file.write(text + "\n")


def record_and_sleep(directory: str, seconds: float) -> int:
    """Append ``<pid> <restart_count>`` to ``directory/pid-<rank>``, sleep ``seconds``, then append ``ran`` to
    ``directory/finally-<rank>`` (also when stopped by SIGTERM)."""
    info = worker_info()
    _append(os.path.join(directory, f"pid-{info.rank}"), f"{os.getpid()} {info.restart_count}")
    try:
        time.sleep(seconds)
    finally:
        _append(os.path.join(directory, f"finally-{info.rank}"), "ran")
    return info.world_size


def start_a_tree(pid_file: str, then: str) -> int:
    """Start ``sleep 100`` (a subprocess), an orphan (``sh`` starts ``sleep 100`` in the background and exits)
    and, but for ``"die"``, a fork child; record their pids, then ``then``: ``"return"``; ``"linger"``: rank 1
    ignores SIGTERM (the launch must SIGKILL it) while rank 0 raises; ``"die"``: rank 1 SIGKILLs itself."""
    import multiprocessing
    import subprocess

    rank = worker_info().rank
    if then == "linger" and rank == 1:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sleeper = subprocess.Popen(["sleep", "100"])
    orphan = subprocess.run(
        ["sh", "-c", "sleep 100 >/dev/null 2>&1 </dev/null & echo $!"], capture_output=True, text=True
    )
    pids = [os.getpid(), sleeper.pid, int(orphan.stdout)]
    if then != "die":
        child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(100,))
        child.start()
        pids.append(child.pid or 0)
    _write(f"{pid_file}.tmp{rank}", " ".join(map(str, pids)))
    os.rename(f"{pid_file}.tmp{rank}", f"{pid_file}{rank}")
    if then == "die" and rank == 1:
        while not os.path.exists(f"{pid_file}0"):  # rank 0's tree is recorded before the launch stops it
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    if then in ("linger", "die"):
        if rank == 1:
            time.sleep(600)
        while not os.path.exists(f"{pid_file}1"):
            time.sleep(0.01)
        if then == "linger":
            raise RuntimeError("rank 0 failed")
        time.sleep(600)
    return rank


def signal_self(signum: int) -> int:
    """Send ``signum`` to this worker, then return the rank (a signal it ignores changes nothing)."""
    os.kill(os.getpid(), signum)
    time.sleep(0.2)  # a signal that is not ignored lands meanwhile
    return worker_info().rank


def memory_files_seen() -> list[str]:
    """The memory files (memfd) this worker holds descriptors of."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("/memfd:"):
                found.append(target)
    return found


def handlers_in_a_forked_child() -> str:
    """What a process the function forks has for SIGTERM and SIGINT (Python's defaults, not the worker's)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        seen = f"{signal.getsignal(signal.SIGTERM)!r} {signal.getsignal(signal.SIGINT) is signal.default_int_handler}"
        os.write(write_end, seen.encode())
        os._exit(0)
    os.close(write_end)
    seen = os.read(read_end, 200).decode()
    os.close(read_end)
    os.waitpid(pid, 0)
    return seen


def multiprocessing_view() -> tuple[str, int | None, bool, bool]:
    """What ``multiprocessing`` says in this rank: its process name, its parent's pid, whether the parent is
    alive, and whether this rank is listed among the children of the process that launched it (never)."""
    parent = multiprocessing.parent_process()
    return (
        multiprocessing.current_process().name,
        None if parent is None else parent.pid,
        parent is not None and parent.is_alive(),
        bool(multiprocessing.active_children()),
    )


def fail_first_attempt(directory: str) -> str:
    """Raise in the first attempt (after leaving ``directory/failed``); return in the next."""
    if worker_info().restart_count == 0:
        open(os.path.join(directory, "failed"), "w").close()
        raise ValueError("first attempt")
    return "second attempt"


def hold_restarted_forks(directory: str) -> None:
    """An at-fork hook: a child forked once ``directory/failed`` exists (a restarted rank, before its set-up)
    leaves ``directory/held`` and waits for ``directory/go``."""
    if os.path.exists(os.path.join(directory, "failed")) and not os.path.exists(os.path.join(directory, "go")):
        open(os.path.join(directory, "held"), "w").close()
        while not os.path.exists(os.path.join(directory, "go")):
            time.sleep(0.01)


def forked_child_catches(signum: int) -> bool:
    """Whether a process this rank forks has a handler for ``signum`` (see :func:`catches`)."""
    pid = os.fork()
    if pid == 0:
        os._exit(1 if catches(signum) else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 1


def rank0_returns_then_lingers(directory: str) -> str:
    """Rank 0 returns, then lingers in an exit handler (a tracker uploading); rank 1 fails once rank 0 has
    returned, so the launch stops rank 0 while it lingers."""
    if worker_info().rank == 0:

        def linger() -> None:
            open(os.path.join(directory, "returned"), "w").close()
            _wait_for(os.path.join(directory, "never"))

        import atexit

        atexit.register(linger)
        return "rank 0's value"
    _wait_for(os.path.join(directory, "returned"))
    raise KeyError("rank 1 fails once rank 0 has returned")


def environments_seen() -> dict[str, Any]:
    """The rank's environment as Python, C code (``getenv``) and a program it runs (``exec``) see it; then
    the same after the rank sets and removes a variable itself."""
    import ctypes
    import subprocess

    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p

    def seen() -> dict[str, Any]:
        program = subprocess.run(["env"], capture_output=True, check=True, text=True).stdout.splitlines()
        return {
            "python": dict(os.environ),
            "bytes": {name.decode(): value.decode() for name, value in os.environb.items()},
            "c": {name: (getenv(name.encode()) or b"").decode() for name in os.environ},
            "exec": dict(line.split("=", 1) for line in program if "=" in line),
        }

    first = seen()
    os.environ["SET_IN_RANK"] = "1"
    del os.environ["OMP_NUM_THREADS"]
    return {"first": first, "after": seen()}


def threads_of_nested_warm_ranks() -> list[tuple[str | None, int]]:
    """In a rank: drop OMP_NUM_THREADS, then start warm fork workers of its own; what each of theirs reads."""
    del os.environ["OMP_NUM_THREADS"]
    with Workers(nprocs=2, start_method="fork", return_all=True, timeout=60) as warm:
        found: list[tuple[str | None, int]] = warm.run(_omp_and_threads)
    return found


def _omp_and_threads() -> tuple[str | None, int]:
    return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


def breakpoint_hook_is_pythons() -> bool:
    """Whether ``breakpoint()`` in this rank is Python's own (``PYTHONBREAKPOINT`` decides), not mplaunch's."""
    return sys.breakpointhook is sys.__breakpointhook__


def nested_launch_stopped_by_sigterm() -> tuple[str, float]:
    """A rank that launches fork workers of its own (sleeping 30 s) and gets SIGTERM 0.5 s later: what the
    nested call raised, and after how long."""
    import threading

    os.environ["MPLAUNCH_IN_PROCESS"] = "0"  # a real launch from inside this rank
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    try:
        parallel(nprocs=2, start_method="fork", timeout=60)(sleep)(30.0)
    except BaseException as error:  # noqa: BLE001 - what the stop raised is the answer
        return type(error).__name__, time.monotonic() - started
    return "returned", time.monotonic() - started


def devnull_descriptors() -> list[int]:
    """This rank's descriptors above 2 that are open on /dev/null."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if int(name) > 2 and os.readlink(f"/proc/self/fd/{name}") == os.devnull:
                found.append(int(name))
    return found


# The probes of the options table (tests/integration/test_option_modes.py): each shows an option's effect in
# what it returns, raises, writes or prints.

#: Set by a test in the parent before it launches: a forked rank inherits the value, a spawned one imports None.
INHERITED: str | None = None


def seen(directory: str) -> dict[str, Any]:
    """What this rank sees of the options that place it; prints a line and notes its start in ``directory``."""
    import torch.distributed as dist

    info = worker_info()
    print(f"probe line of rank {info.rank}", flush=True)
    _append(os.path.join(directory, f"starts-{info.rank}"), f"{time.monotonic()} {info.restart_count}")
    return {
        "rank": info.rank,
        "world_size": info.world_size,
        "restart_count": info.restart_count,
        "inherited": INHERITED,
        "backend": dist.get_backend() if dist.is_initialized() else None,
        "env": os.environ.get("MPLAUNCH_PROBE"),
        "cpus": sorted(os.sched_getaffinity(0)),
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "draw": torch.rand(1).item(),
    }


def fail_once(directory: str, kind: str) -> dict[str, Any]:
    """Raise ``ValueError`` (``kind="value"``) or ``KeyError`` in the first attempt; :func:`seen` in the next."""
    if worker_info().restart_count == 0:
        _append(os.path.join(directory, f"starts-{worker_info().rank}"), f"{time.monotonic()} 0")
        raise (ValueError if kind == "value" else KeyError)("first attempt")
    return seen(directory)


def ignore_stops_and_sleep(seconds: float) -> None:
    """Ignore SIGTERM and SIGINT (a launch's stop, a warm call's interrupt), then sleep: only SIGKILL ends it."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stuck_here(seconds)


def wait_for_preemption(directory: str, run_on: bool) -> int:
    """Say this rank runs (``ready-N``), then wait until ``mplaunch.preempted()``; return, or with ``run_on``
    sleep on past any grace."""
    import mplaunch

    rank = worker_info().rank
    _write(os.path.join(directory, f"ready-{rank}"), "")
    deadline = time.monotonic() + 60
    while not mplaunch.preempted():
        if time.monotonic() > deadline:
            raise TimeoutError("never preempted")
        time.sleep(0.01)
    if run_on:
        stuck_here(60)
    return rank


def yielding(function: Any, *args: Any) -> Any:
    """A generator of ``function(*args)``: yields its value once, and returns it."""
    value = function(*args)
    yield value
    return value
