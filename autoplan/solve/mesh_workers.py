"""Forked worker processes for the mesh search (autoplan.solve.mesh_search), handed work as they free up.

The meshes of one search differ a lot in cost: the 405B-class Llama's FSDP-alone sweep takes seconds, a mesh
where nothing fits a tenth of one. A fixed split (this process the first mesh, the workers the rest) left a
core idle for seconds while the other finished its share. Here every process, this one included, claims the
next unclaimed task of a round from a counter they share, until none is left; the order of the tasks is the
order they are started in. A worker sends each result back pickled through a queue (its feeder thread sends
it while the worker goes on) and says when the round has nothing left for it; a round ends when every result
is in and every worker is idle, or when this process stops it (`stop`: no claims after it, the results still
under way not waited for). The workers are forked once and serve every round of the search: they keep the
tables and layouts they made.

Besides the counter the processes share one number (`publish`), read by each claim: the mesh search's best
throughput without a pipeline, once it is known, for the pipelined meshes claimed after that.

Each task is deterministic (one CP-SAT worker per solve), so which process ran it changes nothing.
"""

from __future__ import annotations

import math
import multiprocessing
import pickle
import queue
import signal
from collections.abc import Callable

__all__ = ["MeshWorkers"]

_NEXT, _VALUE, _STOPPED = range(3)  # the shared array's slots
_NONE = object()  # no message waiting


class MeshWorkers:
    """`count` forked processes running `work(task, value)` on the tasks of each `run`, beside this process."""

    def __init__(self, count: int, work: Callable[[object, float], object]):
        self.count, self._work = count, work
        self._context = multiprocessing.get_context("fork")
        self._lock = self._context.Lock()
        self._shared = self._context.RawArray("d", 3)
        self._shared[_VALUE] = math.nan  # until published
        self._results = self._context.Queue()
        self._inboxes: list = []
        self._processes: list = []
        self._busy = 0  # workers that have not said they are idle since the last round began

    def start(self) -> None:
        """Fork the workers (with what this process holds now: the request, the tables made so far)."""
        for _ in range(self.count):
            reader, writer = self._context.Pipe(duplex=False)
            process = self._context.Process(target=self._serve, args=(reader,), daemon=True)
            process.start()
            reader.close()
            self._inboxes.append(writer)
            self._processes.append(process)

    def run(self, tasks: list, here: Callable[[int, object, float], object],
            done: Callable[[int, object, bool], None], spare: Callable[[], bool] | None = None) -> None:
        """Every task of `tasks` run once, by whichever process claims it first: `here(index, task, value)` in this
        process (which claims the first before the workers start), `work(task, value)` in a worker. `done(index,
        result, here)` is told each result as it arrives (an exception a worker's task raised comes as its result).
        `spare()`, while nothing is left to claim and a worker is still busy: other work done here (True), or none."""
        self._drain()
        with self._lock:
            self._shared[_NEXT], self._shared[_STOPPED] = 0, 0
        claim = self._claim(len(tasks))
        for inbox in self._inboxes:
            inbox.send(tasks)
        self._busy = self.count
        while claim is not None:
            index, value = claim
            done(index, here(index, tasks[index], value), True)
            while self._receive(done, block=False):
                pass
            claim = self._claim(len(tasks))
        while self._busy and not self._shared[_STOPPED]:
            if not self._receive(done, block=False) and not (spare is not None and spare()):
                self._receive(done, block=True)

    def publish(self, value: float) -> None:
        """`value` for the claims from now on (NaN until published)."""
        with self._lock:
            self._shared[_VALUE] = value

    def stop(self) -> None:
        """No claims from now on; `run` returns without waiting for the results still under way."""
        with self._lock:
            self._shared[_STOPPED] = 1

    def close(self) -> None:
        for process in self._processes:
            process.terminate()
        for process in self._processes:
            process.join(timeout=5)
        for inbox in self._inboxes:
            inbox.close()
        self._results.close()

    def __enter__(self) -> "MeshWorkers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _claim(self, tasks: int) -> tuple[int, float] | None:
        with self._lock:
            index = int(self._shared[_NEXT])
            if index >= tasks or self._shared[_STOPPED]:
                return None
            self._shared[_NEXT] = index + 1
            return index, self._shared[_VALUE]

    def _receive(self, done, block: bool) -> bool:
        """One message from the workers handled (False: none waiting, where not `block`)."""
        message = self._message(block)
        if message is _NONE:
            return False
        if message is None:
            self._busy -= 1
        else:
            index, result, error = pickle.loads(message)
            done(index, result if error is None else error, False)
        return True

    def _drain(self) -> None:
        """The results of a stopped round that were still under way, discarded: every worker idle again."""
        while self._busy:
            if self._message(block=True) is None:
                self._busy -= 1

    def _message(self, block: bool):
        """The next message from a worker (_NONE: none waiting, where not `block`); a worker that ended (killed
        from outside) is an error, not a wait for ever."""
        while True:
            try:
                return self._results.get(block=block, timeout=1.0 if block else None)
            except queue.Empty:
                if not block:
                    return _NONE
            if not all(process.is_alive() for process in self._processes):
                raise RuntimeError("a worker process of the mesh search ended before its work was done")

    def _serve(self, inbox) -> None:
        """A worker: each round's tasks claimed and run until none is left, each result sent back."""
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ended by `close`: quietly, not as the CLI's stop
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is this process's parent's to handle
        while (tasks := _received(inbox)) is not None:
            while (claim := self._claim(len(tasks))) is not None:
                index, value = claim
                try:
                    message = pickle.dumps((index, self._work(tasks[index], value), None))
                except Exception as exc:  # noqa: BLE001 -- the task's error is its result, raised where it is read
                    message = _error(index, exc)
                self._results.put(message)
            self._results.put(None)


def _received(inbox):
    try:
        return inbox.recv()
    except EOFError:  # this process's parent has gone
        return None


def _error(index: int, exc: Exception) -> bytes:
    try:
        return pickle.dumps((index, None, exc))
    except Exception:  # noqa: BLE001 -- an error that does not pickle goes back as its text
        return pickle.dumps((index, None, RuntimeError(f"{type(exc).__name__}: {exc}")))
