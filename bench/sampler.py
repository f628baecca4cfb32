"""A stack sampler for the event loop's thread of a server process, in pure Python.

Why not cProfile: statestore reaches PostgreSQL through SQLAlchemy's asyncio layer, which runs the ORM-free Core code
in greenlets; cProfile's call/return bookkeeping does not follow greenlet switches and charges their time to
whatever coroutine frame returns next (the outermost middleware, typically), and on a shared machine its wall-clock
timer charges every preemption to the function that happened to be running.

How this one works: a thread wakes every `interval` seconds and records the Python stack of the loop thread
(`sys._current_frames`). To take it, the sampler must hold the GIL, which the loop thread hands over at its next
switch point or when it blocks; the switch interval is lowered to a few microseconds while sampling so that the
hand-over comes right away, not at the next call that releases the GIL (a syscall), which would bias the samples
toward such calls. So a sample lands where the loop
thread was running, and while the loop thread is descheduled by the OS the sampler waits too: samples follow the
loop thread's CPU time, not the wall clock. A C call that holds the GIL (orjson, bytes.join, a socket write) shows up
as its Python caller. Samples whose innermost frame is the loop runner itself are the loop idle in epoll and are
counted apart.

SQLAlchemy's asyncio layer runs its Core code in a child greenlet whose frames do not link to the coroutine that
awaits it; a greenlet switch hook remembers the running greenlet so that such a stack is completed with the frames
of the parent greenlet (the request's coroutines), and the SQL work is charged to the statestore call that made it.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from types import FrameType
from typing import Any

import greenlet  # type: ignore[import-untyped]

Frame = tuple[str, int, str]  # file, first line of the function, function name
Stack = tuple[Frame, ...]  # innermost first

_IDLE_FILES = ("asyncio/runners.py", "uvloop/__init__.py")


def thread_cpu_ns(native_id: int) -> int:
    with open(f"/proc/self/task/{native_id}/sched", "rb") as f:
        for line in f:
            if line.startswith(b"se.sum_exec_runtime"):
                return int(float(line.split(b":", 1)[1]) * 1_000_000)
    return 0


def _stack(frame: FrameType | None) -> Stack:
    out: list[Frame] = []
    while frame is not None:
        code = frame.f_code
        out.append((code.co_filename, code.co_firstlineno, code.co_name))
        frame = frame.f_back
    return tuple(out)


def is_idle(stack: Stack) -> bool:
    return not stack or stack[0][0].endswith(_IDLE_FILES)


def is_own(stack: Stack) -> bool:
    """A sample of the sampler's greenlet hook running on the loop thread: the profiler's own cost."""
    return bool(stack) and stack[0][0] == __file__


class StackSampler:
    def __init__(self, *, interval: float = 0.0005, switch_interval: float = 0.000002) -> None:
        self._target = threading.main_thread()
        self._interval = interval
        self._switch_interval = switch_interval
        self._saved_switch = sys.getswitchinterval()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.samples: Counter[Stack] = Counter()
        self.cpu_ns = 0
        self._running: Any = None  # the greenlet running on the loop thread, when not the main one
        self._saved_trace: Any = None

    def _on_switch(self, event: str, args: Any) -> None:
        if event in ("switch", "throw"):
            _origin, target = args
            self._running = target if target.parent is not None else None
        if self._saved_trace is not None:
            self._saved_trace(event, args)

    def start(self) -> None:
        native_id = self._target.native_id
        assert native_id is not None and self._target.ident is not None
        self._cpu_start = thread_cpu_ns(native_id)
        # Called on the loop thread (greenlet's trace hook is per thread).
        self._saved_trace = greenlet.settrace(self._on_switch)
        sys.setswitchinterval(self._switch_interval)
        self._thread = threading.Thread(target=self._run, name="bench-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        sys.setswitchinterval(self._saved_switch)
        greenlet.settrace(self._saved_trace)
        native_id = self._target.native_id
        assert native_id is not None
        self.cpu_ns = thread_cpu_ns(native_id) - self._cpu_start

    def _run(self) -> None:
        ident = self._target.ident
        assert ident is not None
        sleep, frames, samples = time.sleep, sys._current_frames, self.samples
        while not self._stop.is_set():
            sleep(self._interval)
            stack = _stack(frames().get(ident))
            running = self._running
            while running is not None and running.parent is not None:
                # The parent is suspended in its switch() into this greenlet: its frames continue the stack.
                running = running.parent
                stack += _stack(running.gr_frame)
            samples[stack] += 1
