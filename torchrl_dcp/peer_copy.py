"""Copy a committed checkpoint directory from one rank to another over the checkpoint's process group.

The node-local tier (:mod:`torchrl_dcp.local_tier`) keeps a replica of each rank's part on
ranks of other nodes and hands a part back to a rank whose node lost it. Both go through
:func:`exchange_entries`: every rank sends the entries it is asked to send (a header, then each
file in pieces of at most ``PIECE`` bytes) while it receives the ones sent to it, each into a
new staging directory beside its destination (files created ``O_EXCL | O_NOFOLLOW`` through the
directory's descriptor, each fsynced) that is published atomically once complete. Two buffers
per direction are reused for every piece (one in flight while the other is read or written), so
memory stays at four pieces whatever the entry size.

What travels is a checkpoint this job just wrote; the receiver still treats it as input: names
must be plain file names, sizes are bounded by the header, and nothing is trusted before the load
verifies every byte against the manifest's checksums.

Example (one process: nothing to send or receive):
    >>> from torchrl_dcp.peer_copy import exchange_entries
    >>> exchange_entries([], [], None)
"""

from __future__ import annotations

import json
import os
import re
import stat
import threading
import uuid
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from torchrl_dcp.errors import CheckpointError, CheckpointFormatError, from_os_error
from torchrl_dcp.json_bytes import loads_json
from torchrl_dcp.storage.commit import publish, remove_tree, staging_path
from torchrl_dcp.storage.files import DirHandle, is_real_dir

PIECE = 16 << 20  # bytes per message: bounds the memory of a copy (two buffers each way)
_HEADER_LIMIT = 1 << 20  # a part lists a handful of files: a larger header is not ours
_NAME = re.compile(r"^(?!\.\.?\Z)[A-Za-z0-9_.\-]{1,200}\Z")


def entry_files(path: Path) -> list[tuple[str, int]]:
    """The regular files of the committed entry ``path`` (name, size), sorted; anything else there is refused."""
    handle = DirHandle.open(path)
    try:
        files = []
        for name in handle.names():
            st = handle.lstat(name)
            if not stat.S_ISREG(st.st_mode) or not _NAME.match(name):
                raise CheckpointError(f"{name!r} is not a plain file of a checkpoint: not copied", path=path)
            files.append((name, st.st_size))
        return files
    finally:
        handle.close()


def exchange_entries(
    sends: Sequence[tuple[Path, int]],
    receives: Sequence[tuple[Path, int]],
    group: object,
    *,
    send_error: str | None = None,
) -> None:
    """Send each ``(entry, group_rank)`` of ``sends`` while receiving each ``(destination, group_rank)`` of ``receives``.

    Every rank calls it with the pairs its peers expect (each send has a matching receive on
    its peer, in the same order). ``send_error``: this rank could not produce its entries; each
    peer is told so (and raises it) instead of waiting for them. A failure on either side never
    leaves the other waiting: a sender that cannot read a file pads what it declared, a receiver
    that cannot write drains what it was sent. Raises the first failure of either direction
    after both finished, a receive's first (``receiving`` set on it: the entry this rank was to receive could not be
    had); a peer that is gone fails the receive at once, or at the group's timeout.
    """
    if not sends and not receives:
        return
    errors: list[BaseException] = []
    sent: list[BaseException] = []  # the sending side's failures (its peers were told, and raise their own)

    def send_all() -> None:
        buffers = [torch.empty(PIECE, dtype=torch.uint8) for _ in range(2)]
        for entry, peer in sends:
            try:
                _send_entry(entry, peer, group, buffers, send_error)
            except CheckpointError as err:  # the peer was told (header) or got padding; next entry
                sent.append(err)
            except BaseException as err:  # the group itself failed: nothing more can be sent
                sent.append(err)
                return

    sender = threading.Thread(target=send_all, name="tdcp-peer-send", daemon=True)
    sender.start()
    try:
        buffers = [torch.empty(PIECE, dtype=torch.uint8) for _ in range(2)]
        for destination, peer in receives:
            try:
                _receive_entry(destination, peer, group, buffers)
            except CheckpointFormatError as err:  # what follows cannot be told apart: stop receiving
                errors.append(err)
                break
            except CheckpointError as err:  # drained: the next entry's messages are next in line
                errors.append(err)
    finally:
        sender.join()
    for err in errors:  # (a receive's failure first: it is about what this rank was to hold)
        if isinstance(err, CheckpointError):
            err.receiving = True
    if errors or sent:
        raise (errors or sent)[0]


def _send_header(header: dict, peer: int, group: object) -> None:
    raw = json.dumps(header).encode()
    _send(torch.tensor([len(raw)], dtype=torch.int64), peer, group)
    _send(torch.frombuffer(bytearray(raw), dtype=torch.uint8), peer, group)


def _send_entry(entry: Path, peer: int, group: object, buffers: list[torch.Tensor], error: str | None) -> None:
    try:
        if error is not None:
            raise CheckpointError(error, path=entry)
        files = entry_files(entry)
    except (OSError, CheckpointError) as err:
        failure = err if isinstance(err, CheckpointError) else from_os_error(err, "listing a part to send", entry)
        _send_header({"error": str(failure)[:4096]}, peer, group)
        raise failure from None
    _send_header({"files": files}, peer, group)
    failure: CheckpointError | None = None
    pending: list = [None, None]  # the send in flight from each buffer: a buffer is refilled once its send is done
    piece = 0
    handle = DirHandle.open(entry)
    try:
        for name, size in files:
            fd = _open_or_none(handle, name)
            try:
                for done in range(0, size, PIECE):
                    n, slot = min(PIECE, size - done), piece % 2
                    if pending[slot] is not None:
                        pending[slot].wait()
                    view = memoryview(buffers[slot].numpy())[:n]
                    got = os.preadv(fd, [view], done) if fd is not None and failure is None else 0
                    if got != n:  # unreadable or shrunk: pad what the header declared, the peer is not left waiting
                        view[got:] = bytes(n - got)
                        failure = failure or CheckpointError(
                            f"{name} could not be read whole while it was sent to rank {peer}", path=entry
                        )
                    pending[slot] = _isend(buffers[slot][:n], peer, group)
                    piece += 1
            finally:
                if fd is not None:
                    os.close(fd)
    finally:
        handle.close()
        for work in pending:
            if work is not None:
                work.wait()
    if failure is not None:
        raise failure


def _open_or_none(handle: DirHandle, name: str) -> int | None:
    try:
        return handle.open_file(name)
    except OSError:
        return None


def _receive_entry(destination: Path, peer: int, group: object, buffers: list[torch.Tensor]) -> None:
    size = torch.empty(1, dtype=torch.int64)
    _recv(size, peer, group)
    if not 0 < int(size) <= _HEADER_LIMIT:
        raise CheckpointFormatError(f"rank {peer} sent a header of {int(size)} bytes", path=destination)
    raw = torch.empty(int(size), dtype=torch.uint8)
    _recv(raw, peer, group)
    files = _parse_header(raw.numpy().tobytes(), peer, destination)
    stream = _Pieces([min(PIECE, n - done) for _, n in files for done in range(0, n, PIECE)], peer, group, buffers)
    staging = staging_path(destination, uuid.uuid4().hex)
    failure: CheckpointError | None = None
    handle = None
    step_dir = destination.parent  # (a missing one fails where the staging directory is made, saying so)
    if os.path.lexists(step_dir) and not is_real_dir(step_dir):  # (still drained: the next entry's messages follow)
        failure = CheckpointError(
            f"the step directory the part received from rank {peer} goes into is not a directory (a link or a file "
            "was put in its place): refused, never written through; the part was not received",
            path=step_dir,
        )
    elif not _replaceable(destination):
        failure = CheckpointError(
            f"a directory that is not a checkpoint this tier replaces (a user's, or a part holding a user's file) "
            f"is where the part received from rank {peer} goes: it was left as it is and the part not received; "
            "move it (the resume takes an older step, or the shared tier)",
            path=destination,
        )
    try:
        if failure is None:
            staging.mkdir()
            handle = DirHandle.open(staging)
    except OSError as err:
        failure = from_os_error(err, f"receiving a checkpoint from rank {peer}", destination)
    try:
        for name, length in files:
            failure = _receive_file(handle if failure is None else None, name, length, peer, stream) or failure
            if failure is not None:
                handle = _close(handle)
        if handle is not None:
            handle.fsync()
            handle = _close(handle)
            publish(staging, destination, replaceable=_replaceable)  # (asked again of what it moves out of the way)
    except OSError as err:
        failure = from_os_error(err, f"receiving a checkpoint from rank {peer}", destination)
    except BaseException:
        _close(handle)
        remove_tree(staging)
        raise
    if failure is not None:
        _close(handle)
        remove_tree(staging)
        raise failure


def _replaceable(destination: Path) -> bool:
    """Whether a received part may replace what is at ``destination``: nothing, a link (replaced, never followed),
    or what a save replaces (:func:`~torchrl_dcp.storage.directory.is_replaceable`: an empty directory, a checkpoint
    of ours holding no file of the user's, a damaged one of ours); never a directory of the user's, nor a part with a
    user's file put into it (a local save refuses to replace them alike)."""
    from torchrl_dcp.storage.directory import is_replaceable

    if destination.is_symlink() or not os.path.lexists(destination):
        return True
    return is_replaceable(destination)


def _close(handle: DirHandle | None) -> None:
    if handle is not None:
        handle.close()


class _Pieces:
    """The pieces of an entry as they arrive: the next one is received into the other buffer while one is written."""

    def __init__(self, sizes: list[int], peer: int, group: object, buffers: list[torch.Tensor]) -> None:
        self.sizes, self.peer, self.group, self.buffers = sizes, peer, group, buffers
        self.index, self.work = 0, self._post(0) if sizes else None

    def _post(self, index: int) -> object:
        return _irecv(self.buffers[index % 2][: self.sizes[index]], self.peer, self.group)

    def next(self) -> memoryview:
        """The next piece (valid until the call after this one)."""
        self.work.wait()  # type: ignore[union-attr]
        index = self.index
        self.index += 1
        self.work = self._post(self.index) if self.index < len(self.sizes) else None
        return memoryview(self.buffers[index % 2].numpy())[: self.sizes[index]]


def _receive_file(
    handle: DirHandle | None, name: str, length: int, peer: int, stream: _Pieces
) -> CheckpointError | None:
    """Receive ``name`` into ``handle``'s directory (``None``: drain it); the write failure, if any, after draining."""
    failure: CheckpointError | None = None
    fd = None
    if handle is not None:
        try:
            fd = handle.create(name)
        except OSError as err:
            failure = from_os_error(err, f"receiving {name} from rank {peer}", handle.path)
    try:
        for done in range(0, length, PIECE):
            view, offset = stream.next(), done
            if fd is None:
                continue
            try:
                while view:
                    written = os.pwrite(fd, view, offset)
                    view, offset = view[written:], offset + written
            except OSError as err:
                failure = from_os_error(err, f"receiving {name} from rank {peer}", handle.path)  # type: ignore[union-attr]
                os.close(fd)
                fd = None
        if fd is not None:
            os.fsync(fd)
    finally:
        if fd is not None:
            os.close(fd)
    return failure


def _parse_header(raw: bytes, peer: int, destination: Path) -> list[tuple[str, int]]:
    try:
        header = loads_json(raw)
        if isinstance(header, dict) and "error" in header:
            raise CheckpointError(f"rank {peer} could not send it: {str(header['error'])[:4096]}", path=destination)
        out = [(str(name), int(length)) for name, length in header["files"]]
    except (ValueError, TypeError, KeyError) as err:
        raise CheckpointFormatError(f"rank {peer} sent a malformed header ({err})", path=destination) from None
    names = [name for name, _ in out]
    if len(set(names)) != len(names) or not all(_NAME.match(n) for n in names) or any(n < 0 for _, n in out):
        raise CheckpointFormatError(
            f"rank {peer} sent file names or sizes that are not a checkpoint's", path=destination
        )
    return out


def _send(tensor: torch.Tensor, peer: int, group: object) -> None:
    dist.send(tensor, group=group, group_dst=peer)  # type: ignore[arg-type]


def _recv(tensor: torch.Tensor, peer: int, group: object) -> None:
    dist.recv(tensor, group=group, group_src=peer)  # type: ignore[arg-type]


def _isend(tensor: torch.Tensor, peer: int, group: object) -> object:
    return dist.isend(tensor, group=group, group_dst=peer)  # type: ignore[arg-type]


def _irecv(tensor: torch.Tensor, peer: int, group: object) -> object:
    return dist.irecv(tensor, group=group, group_src=peer)  # type: ignore[arg-type]
