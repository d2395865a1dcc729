"""Measured memory of a rank's training steps on CPU, where torch keeps no allocator statistics.

Lives here: `measure_peak_bytes` (the most bytes this rank held at once during a call, e.g.
an `Engine` step: what the planner's `peak_memory_bytes` predicts), `held_bytes` (the bytes of
the distinct storages behind some tensors) and `engine_tensors` (what an engine keeps between
steps). Lives elsewhere: the prediction (`autosbp.planner.memory.device_bytes`), the steps
(`runtime.engine`), the tests that compare the two (tests/runtime/test_memory.py).

How it measures: `torch.profiler` with `profile_memory=True` makes c10's CPU allocator report
every allocation and free it serves while profiling (`ProfiledCPUMemoryReporter`), each with the
running total of the bytes it has handed out and not taken back. The call runs twice while
profiling; the second is measured: its peak is what the caller holds as it starts
(`held_bytes` of what it names: an engine's parameters, buffers, constants, gradients and
their buckets, optimizer states, each storage once) plus the largest rise of that running total
during it. The first call makes what the second frees (last step's gradients, the saved
tensors of a step) tracked, so its frees are seen: a tensor allocated before profiling and
freed during it is reported by no event (the allocator frees it silently). Not counted, on
either side: what the allocator does not serve (gloo's transport buffers, Python objects).

Frees on other threads: the reporter counts an allocation or free only on a thread the profiler
watches (`memoryProfilingEnabled` is thread-local), unless c10's flag
`caffe2_report_cpu_memory_usage` is set. A gloo collective's output dies on gloo's worker
thread when that thread lets its work go after the caller has (the thread ran late: on a loaded
machine), and the running total then kept the dead block to the end: a forward gather's 32 kB
output counted at the backward peak, one rank-run in ~20 under load (measured 1.164 for 1.064).
So the flag is set while measuring (`_every_thread_counted`): the running total is then
every thread's, and the main thread's events report it.

Reference: c10/core/CPUAllocator.cpp (ProfiledCPUMemoryReporter); torch/profiler/
_memory_profiler.py reads the same allocation events.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

if TYPE_CHECKING:
    from runtime.engine import Engine

__all__ = ["engine_tensors", "held_bytes", "measure_peak_bytes"]

_MARK = "runtime.verify.peak_memory.measured"  # the profiler range around the measured call


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The bytes of the distinct storages behind `tensors` (views and shared storages once)."""
    storages: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None and tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def measure_peak_bytes(
    step: Callable[[], object], held: Callable[[], Iterable[torch.Tensor | None]]
) -> int:
    """The most CPU bytes held at once during a call of `step()`: it runs twice while profiling,
    and the second call is measured, so what the first allocated and the second frees (last
    step's gradients) is seen freed. `held()` lists what the caller keeps between calls; its
    `held_bytes` between the two calls, plus the largest rise of the allocator's outstanding
    bytes during the second, is the peak."""
    with (
        _every_thread_counted(),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        step()
        start = held_bytes(held())
        with record_function(_MARK):
            step()
    tree = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    mark_ns = min(event.start_time_ns for event in tree if event.name == _MARK)
    allocations = sorted(
        (
            (event.start_time_ns, event.typed[1])
            for event in tree
            if event.typed[0] == _EventType.Allocation and event.typed[1].device.type == "cpu"
        ),
        key=lambda timed: timed[0],
    )
    before = [fields for time_ns, fields in allocations if time_ns < mark_ns]
    during = [fields for time_ns, fields in allocations if time_ns >= mark_ns]
    if not during:
        return start
    if before:
        outstanding = before[-1].total_allocated
    else:
        outstanding = during[0].total_allocated - during[0].alloc_size
    rise = max(fields.total_allocated for fields in during) - outstanding
    return start + max(rise, 0)


@contextlib.contextmanager
def _every_thread_counted() -> Iterator[None]:
    """c10's CPU allocator reporter counts the allocations and frees of every thread (its
    `caffe2_report_cpu_memory_usage` flag: it logs them at INFO, below c10's default level),
    restored afterwards."""
    library = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libc10.so"))
    flag = ctypes.c_bool.in_dll(library, "FLAGS_caffe2_report_cpu_memory_usage")
    was = flag.value
    flag.value = True
    try:
        yield
    finally:
        flag.value = was


def engine_tensors(engine: Engine) -> list[torch.Tensor | None]:
    """Every tensor `engine` keeps between steps: its state (parameters, buffers, constants),
    the programs' persistent tensors (each chunk's, interleaved), gradients, gradient buckets, the tensors the optimizer
    steps (ZeRO-1's shards) and optimizer states."""
    tensors: list[torch.Tensor | None] = list(engine.state.values())
    tensors += [t for p in engine.programs for t in p.template if isinstance(t, torch.Tensor)]
    tensors += [param.grad for param in engine.parameters.values()]
    tensors += list(engine.optimized.values())  # ZeRO-1's shards (else the parameters)
    tensors += [t.grad for t in engine.optimized.values()]
    tensors += [bucket.flat for bucket in engine.grad_sync.buckets]
    for state in engine.optimizer.state.values():
        tensors += [t for t in state.values() if isinstance(t, torch.Tensor)]
    return tensors


def _walk(roots: Iterable[Any]) -> Iterator[Any]:
    """Every event of the profiler's event tree (`_ProfilerEvent`s: untyped in torch's stubs)."""
    stack = list(roots)
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        yield event
