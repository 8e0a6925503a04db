"""The numbers behind every metric, as float64 slots of one buffer: a process's own memory,
or, for the API processes of one server (`minivllm serve --api-server-count N`), a file of
a directory they share, which each maps and the others read. `/metrics` in any of them is
then one view of all: what each process counted adds up, and the engine's own state (which
every process hears about) is taken once, not N times. This is vLLM's multiprocess
Prometheus mode, with its gauge modes reduced to the two that apply here.
"""

from __future__ import annotations

import enum
import mmap
import os
import secrets
import time

import numpy as np

CAPACITY = 4096  # slots per process (32 KiB); the metrics use well under a thousand


class Aggregate(enum.IntEnum):
    """How the processes' values of one slot make the server's."""

    SUM = 0  # what each process counted: its requests, its tokens, its latencies
    MAX = 1  # a cumulative counter of the engine's that every process follows
    LATEST = 2  # the engine's state: the value of the process that heard from it last


_STAMP = 0  # slot 0: when this process last heard the engine's state (time.time())


class MetricValues:
    """`values[i]` is slot i (a float64 memoryview); `allocate` hands out slots with their
    aggregate; `combined()` is every slot as the whole server sees it. With `directory`,
    the slots live in `directory/<pid>-<random>.values`, kept there after the process ends (its
    counts still count) until the server removes the directory."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory
        self.path: str | None = None
        if directory is None:
            self.values = memoryview(bytearray(8 * CAPACITY)).cast("d")
        else:
            name = f"{os.getpid()}-{secrets.token_hex(4)}.values"
            self.path = os.path.join(directory, name)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.ftruncate(fd, 8 * CAPACITY)
                mapped = mmap.mmap(fd, 8 * CAPACITY)  # unmapped when the process ends
            finally:
                os.close(fd)
            self.values = memoryview(mapped).cast("d")
        self.aggregates = [Aggregate.LATEST]
        self._mask: dict[Aggregate, np.ndarray] = {}

    def allocate(self, n: int, aggregate: Aggregate) -> int:
        """The first of `n` new slots."""
        first = len(self.aggregates)
        if first + n > CAPACITY:
            raise ValueError(f"metrics need over {CAPACITY} slots")
        self.aggregates += [aggregate] * n
        self._mask.clear()
        return first

    def stamp(self) -> None:
        """This process heard the engine's state now: its LATEST slots are the server's."""
        self.values[_STAMP] = time.time()

    def combined(self) -> np.ndarray:
        """Every slot as the server sees it: this process's own, or all processes' merged."""
        own = np.frombuffer(self.values, dtype=np.float64, count=len(self.aggregates))
        if self.directory is None:
            return own.copy()
        rows = [own] + [row for row in self._others() if row is not None]
        stack = np.stack([row[: len(self.aggregates)] for row in rows])
        if not self._mask:
            kinds = np.array(self.aggregates)
            self._mask = {a: kinds == a for a in Aggregate}
        out = stack.sum(axis=0)
        out[self._mask[Aggregate.MAX]] = stack[:, self._mask[Aggregate.MAX]].max(axis=0)
        latest = stack[int(np.argmax(stack[:, _STAMP]))]
        out[self._mask[Aggregate.LATEST]] = latest[self._mask[Aggregate.LATEST]]
        return out

    def _others(self):
        """The other processes' slots (those that ended too)."""
        assert self.directory is not None
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:  # the server is being removed
            return
        for name in names:
            path = os.path.join(self.directory, name)
            if path == self.path or not name.endswith(".values"):
                continue
            try:
                with open(path, "rb") as f:
                    data = f.read(8 * CAPACITY)
            except OSError:
                continue
            if len(data) == 8 * CAPACITY:
                yield np.frombuffer(data, dtype=np.float64)
