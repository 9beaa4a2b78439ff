"""Asynchronous saves: stage tensors into reused host buffers, write and commit in a background thread.

:meth:`DistributedCheckpoint.async_save` encodes the state, copies every tensor into
host memory kept from the previous save (pinned, on a side CUDA stream ordered after
the step, when the tensor lives on a GPU), and returns a :class:`SaveHandle` while a
single background thread writes the files and commits the checkpoint atomically.
Collectives of the background write run on the checkpoint's own gloo group, in the
same order on every rank. One save is in flight at a time: the next ``save``,
``async_save`` or ``load`` first waits for it, and a failure in the background is
raised (as a :class:`CheckpointError`, on every rank) by ``handle.wait()`` or by that
next call, never swallowed. The background thread writes with the CPUs the training loop
leaves free: this rank's share of the node's CPUs less torch's intra-op threads, at least
one (``TDCP_WRITE_THREADS`` overrides it); ``TDCP_ASYNC_NICE`` lowers its priority.

Tensors backed by a memory-mapped file (``LazyMemmapStorage`` replay buffers) are
written from the file in place, without a staging copy, unless
``stage_memmap=True``: entries added to such a buffer while the save is in flight
may or may not be in the checkpoint.

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> model = torch.nn.Linear(4, 4)
    >>> ckpt = tdcp.DistributedCheckpoint(model=model)
    >>> handle = ckpt.async_save(tempfile.mkdtemp() + "/step-1", step=1)
    >>> # ... keep training; the checkpoint is written meanwhile ...
    >>> handle.wait().name
    'step-1'
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from torchrl_dcp.errors import CheckpointError
from torchrl_dcp.format.record import GATHER_BYTES, byte_view, can_write_fast, plain_tensor
from torchrl_dcp.settings import setting
from torchrl_dcp.storage.copying import leaving_cpus, yield_cpus
from torchrl_dcp.storage.stable_bytes import own
from torchrl_dcp.storage.urls import location_key


class SaveHandle:
    """A save running in the background; :meth:`wait` returns its path or raises its failure."""

    def __init__(self, path: Path, step: int | None, future: concurrent.futures.Future) -> None:
        self.path = path
        self.step = step
        self._future = future
        self.reported = False  # its failure was raised to the caller already
        self.reported_before_now = False

    def done(self) -> bool:
        """True once the checkpoint is committed or the save has failed."""
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until committed; return the checkpoint path.

        Raises:
            CheckpointError: the background write or commit failed (on every rank).
            TimeoutError: ``timeout`` seconds passed first (the save keeps running).
        """
        try:
            return self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"async save to {self.path} still running after {timeout}s") from None
        except CheckpointError:
            self.reported_before_now, self.reported = self.reported, True
            raise
        except BaseException as err:
            self.reported_before_now, self.reported = self.reported, True
            raise CheckpointError(f"async save failed: {type(err).__name__}: {err}", path=self.path) from err

    def exception(self) -> BaseException | None:
        """The failure once done, else None (does not block)."""
        return self._future.exception() if self._future.done() else None

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"SaveHandle({str(self.path)!r}, step={self.step}, {state})"


def is_file_backed(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives in a memory-mapped file (MemoryMappedTensor, ``torch.from_file``)."""
    if tensor.device.type != "cpu":
        return False
    try:
        return bool(getattr(tensor.untyped_storage(), "filename", None))
    except (RuntimeError, NotImplementedError):
        return False


ALIGN = 16  # offset of each tensor staged together: a multiple of every element size
TOGETHER_BELOW = 1 << 16  # device tensors smaller than this (bytes) are staged together


def staged_together(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is staged with the other small ones of its device (:meth:`AsyncSaver._stage_together`)."""
    return (
        tensor.device.type == "cuda"
        and 0 < tensor.numel() * tensor.element_size() < TOGETHER_BELOW
        and can_write_fast(tensor)
    )


_IN_FLIGHT: weakref.WeakSet[AsyncSaver] = weakref.WeakSet()  # savers that submitted a save (pending or not)


def _report_at_exit() -> None:
    """Say, at interpreter exit, which async saves failed unreported: a job that ends without ``wait()`` (or
    ``rotation.close()``) and destroys its process group while a save is in flight loses that save, whose failure no
    later call raises. Called before Python joins the threads (``threading._register_atexit``: a process started by
    multiprocessing's ``fork`` ends with ``os._exit`` after that, never running ``atexit``), so it waits for each save
    in flight first, as that join would; and at ``atexit`` too, where a process that skipped it still reports."""
    import sys

    for saver in list(_IN_FLIGHT):
        handle = saver._pending
        if handle is None or handle.reported:
            continue
        concurrent.futures.wait([handle._future])
        err = handle.exception()
        handle.reported = True  # (said once, whichever exit hook runs first)
        if err is not None:
            print(
                f"torchrl_dcp: the async save of step {handle.step} to {handle.path} did not commit and nothing "
                f"reported it before the process exited ({type(err).__name__}: {err}). Call handle.wait(), "
                "ckpt.wait() or rotation.close() before destroy_process_group() and before the job exits.",
                file=sys.stderr,
            )


atexit.register(_report_at_exit)
threading._register_atexit(_report_at_exit)  # type: ignore[attr-defined]  # (fork children: see the docstring)


class AsyncSaver:
    """Staging buffers, the side CUDA stream and the one background writer of a checkpoint.

    Staging buffers are kept by key and reused while the key's shape and dtype stay the
    same, so after the first save staging is a copy into memory already touched.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._together: torch.Tensor | None = None  # small device tensors' staged bytes (_stage_together)
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: SaveHandle | None = None
        self.group: Any = None  # the gloo group its background saves run their collectives on (set per save)
        self._stream: Any = None
        self._lock = threading.Lock()

    @property
    def pending(self) -> SaveHandle | None:
        """The save in flight (or finished but not yet waited for), if any."""
        return self._pending

    def wait_pending(self) -> Path | None:
        """Wait for the save in flight and return its path; raise its failure as a :class:`CheckpointError` unless
        ``wait()`` did (then ``None``, as when no save was in flight). Local: the handle stays pending until the
        next collective call settles it on every rank (:meth:`settle_pending`)."""
        handle = self._pending
        if handle is None:
            return None
        try:
            return handle.wait()
        except CheckpointError:
            if not handle.reported_before_now:
                raise
            return None

    def settle_pending(self, any_rank: Callable[[bool], bool]) -> Path | None:
        """At the start of a collective call: wait for the save in flight and settle it alike on every rank.

        Its failure is raised on every rank unless every rank has raised it already (a ``wait()`` on some ranks
        only, e.g. rank 0 checking the entry it evaluates): a rank raising it alone would skip the call the others
        make, and the ranks would stay a call apart. ``any_rank(flag)``: whether any rank passed ``True`` (one
        small exchange, on every rank that saved: all of them, an async save being collective).
        """
        handle, self._pending = self._pending, None
        if handle is None:
            return None
        failure: CheckpointError | None = None
        try:
            path: Path | None = handle.wait()
        except CheckpointError as err:
            failure, path = err, None
        if not any_rank(failure is not None and not handle.reported_before_now):
            return path
        if failure is None:  # this rank's part committed; another rank's failed, unreported there
            raise CheckpointError(
                "the background save failed on another rank (which raises why); this rank raises too, so that "
                "every rank skips this call alike: save again",
                path=handle.path,
            )
        raise failure

    def stage(self, flat: Mapping[str, torch.Tensor], *, stage_memmap: bool = False) -> tuple[dict[str, Any], Any]:
        """Copies of ``flat`` in reused host buffers; returns ``(staged, cuda_event_or_None)``.

        CUDA tensors are copied on a side stream that waits for the current stream;
        the current stream then waits for the copies, so the next step cannot
        overwrite a tensor before it is copied, and the caller does not block.
        """
        if self._pending is not None and not self._pending.done():
            raise RuntimeError("staging while a save is in flight would overwrite its buffers; wait for it first")
        staged: dict[str, Any] = {}
        buffers: dict[str, torch.Tensor] = {}
        cuda = [k for k, t in flat.items() if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
        stream = None
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            stream = self._stream
            stream.wait_stream(torch.cuda.current_stream())
        device = stream.device if stream is not None else torch.device("cpu")  # the side stream's (one device)
        together = {
            k: t for k, t in flat.items() if isinstance(t, torch.Tensor) and staged_together(t) and t.device == device
        }
        if len(together) > 1:
            staged.update(self._stage_together(together, stream))
        else:
            together = {}
        for key, tensor in flat.items():
            if key in together:
                continue
            if not isinstance(tensor, torch.Tensor) or not can_write_fast(tensor):
                staged[key] = tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor
                continue
            src = tensor.detach()
            if not stage_memmap and is_file_backed(src):
                staged[key] = src  # written from the file in place
                continue
            on_cuda = src.device.type == "cuda"
            buf = self._buffers.get(key)
            if buf is None or buf.shape != src.shape or buf.dtype != src.dtype or (on_cuda and not buf.is_pinned()):
                buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=on_cuda)
                own(buf)  # nothing but this saver writes it: written without a copy (storage/stable_bytes.py)
            if on_cuda:
                with torch.cuda.stream(stream):
                    buf.copy_(src, non_blocking=True)
                src.record_stream(stream)
            else:
                buf.copy_(src)
            buffers[key] = buf
            staged[key] = buf
        self._buffers = buffers
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            torch.cuda.current_stream().wait_stream(stream)
        return staged, event

    def _stage_together(self, tensors: Mapping[str, torch.Tensor], stream: Any) -> dict[str, torch.Tensor]:
        """Stage small device tensors together: their bytes gathered on the device (one ``torch.cat``, each at an
        offset aligned to ``ALIGN``) and copied once into a reused host buffer, of which each staged tensor is a view.

        A copy of each to the host costs tens of µs of launch and synchronisation (5,000 CUDA tensors blocked an
        async save 0.29 s on an H200). On ``stream`` (after the current stream, as every staging copy), without a
        stream synchronously (the CPU, in tests).
        """
        layout: list[tuple[str, int, torch.Tensor]] = []
        at = 0
        for key, tensor in tensors.items():  # each at an aligned offset of the host buffer
            at += -at % ALIGN
            layout.append((key, at, tensor))
            at += tensor.numel() * tensor.element_size()
        if self._together is None or self._together.numel() < at:
            self._together = torch.empty(at, dtype=torch.uint8, pin_memory=stream is not None)
            own(self._together)
        first = next(iter(tensors.values()))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            pad = torch.zeros(ALIGN, dtype=torch.uint8, device=first.device)
            start, end, parts = 0, 0, []
            for i, (_, offset, tensor) in enumerate(layout):
                if offset > end:
                    parts.append(pad[: offset - end])
                parts.append(byte_view(plain_tensor(tensor)))  # a contiguous copy, if one is needed, on the stream
                end = offset + tensor.numel() * tensor.element_size()
                if end - start >= GATHER_BYTES or i == len(layout) - 1:  # device memory of a gather, bounded
                    self._together[start:end].copy_(torch.cat(parts), non_blocking=stream is not None)
                    start, parts = end, []
        if stream is not None:
            for tensor in tensors.values():
                tensor.record_stream(stream)
        host = self._together
        return {key: host[a : a + t.numel() * t.element_size()].view(t.dtype).reshape(t.shape) for key, a, t in layout}

    def submit(self, path: Path, step: int | None, run: Callable[[], Path], event: Any = None) -> SaveHandle:
        """Run ``run`` (write + commit) in the background thread after ``event``; one at a time."""
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tdcp-async-save")

        training_threads = torch.get_num_threads()  # the loop's intra-op threads keep their CPUs (storage/copying.py)
        nice = setting("TDCP_ASYNC_NICE")  # read here: a bad value fails the call, not the background save

        def task() -> Path:
            yield_cpus(nice)
            if event is not None:
                event.synchronize()
            with leaving_cpus(training_threads):
                return run()

        handle = SaveHandle(path, step, self._executor.submit(task))
        self._pending = handle
        _IN_FLIGHT.add(self)
        return handle

    def wait_for_others(self, group: Any) -> None:
        """Wait until the background saves of this process's other checkpoints on ``group`` (this checkpoint's gloo
        group) are done, their outcome left to their own next call: checkpoints of one timeout share one group, and a
        collective started while another thread runs one on it would interleave with it (both stall until the
        timeout). Checkpoints without a group (a local tier's single-process saves) wait for nobody (a rotation waits
        for its own save in flight, of whichever checkpoint, before it picks the next commit's order)."""
        if group is None:
            return
        for other in list(_IN_FLIGHT):
            handle = other._pending
            if other is not self and handle is not None and other.group is group:
                concurrent.futures.wait([handle._future])

    def wait_for_path(self, path: Any) -> None:
        """Wait until the background saves of this process's other checkpoints to ``path`` are done (a load of a path
        being saved reads what that save commits, never the checkpoint it replaces), their outcome left to their own
        next call. Any group, or none: a load waits for nothing else of theirs."""
        target = location_key(path)
        for other in list(_IN_FLIGHT):
            handle = other._pending
            if other is not self and handle is not None and location_key(handle.path) == target:
                concurrent.futures.wait([handle._future])

    def release(self) -> None:
        """Drop the staging buffers (after waiting for the save in flight)."""
        try:
            self.wait_pending()
        finally:
            self._buffers, self._together = {}, None

    def shutdown(self) -> None:
        """Wait for the save in flight, then stop the background thread and drop the buffers (a later save restarts
        them)."""
        try:
            self.release()
        finally:
            executor, self._executor = self._executor, None
            if executor is not None:
                executor.shutdown(wait=True)
