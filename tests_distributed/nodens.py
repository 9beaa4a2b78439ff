"""Run a command as one "node" with a private ``/tmp``: the inside of ``unshare -m --propagation private``.

    unshare -m --propagation private python -m tests_distributed.nodens SHARED LISTING -- CMD...

mounts a fresh tmpfs on ``/tmp`` (so the node sees none of the host's or the other
nodes' temporary files), binds the shared directory ``SHARED`` back at its own path
when it lies under ``/tmp`` (as pytest's ``tmp_path`` does: the "shared file
system"), runs ``CMD`` with ``TMPDIR=/tmp``, then writes what the command left in
the private ``/tmp`` (outside ``SHARED``) to ``LISTING`` (JSON) and exits with its
status. ``--probe`` only checks that the mounts work here.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

MS_BIND = 4096
PR_SET_PDEATHSIG = 1


def _mount(source: str, target: str, fstype: str | None, flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None, flags, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {source} on {target}: {os.strerror(err)}")


ROOT = Path(__file__).resolve().parent.parent  # the code under test: must stay visible too


def _kept(shared: Path | None) -> list[Path]:
    """What must stay visible under the private ``/tmp``: the shared directory, this checkout and the interpreter
    (a virtualenv's prefix and its base), when they lie there; a path inside another kept one is kept with it."""
    candidates = [shared, ROOT, Path(sys.prefix), Path(sys.base_prefix), Path(sys.executable).parent]
    paths = sorted({p.resolve() for p in candidates if p is not None}, key=lambda p: len(p.parts))
    kept: list[Path] = []
    for p in paths:
        if p.is_relative_to("/tmp") and not any(p.is_relative_to(k) for k in kept):
            kept.append(p)
    return kept


def private_tmp(shared: Path | None) -> None:
    """Cover ``/tmp`` with a new tmpfs; keep ``shared`` (and the checkout) visible at their paths (bound back)."""
    keep = [(p, os.open(p, os.O_RDONLY | os.O_DIRECTORY)) for p in _kept(shared)]  # reachable after the mount
    _mount("tmpfs", "/tmp", "tmpfs", 0)
    os.chmod("/tmp", 0o1777)
    for target, fd in keep:
        target.mkdir(parents=True, exist_ok=True)
        _mount(f"/proc/self/fd/{fd}", str(target), None, MS_BIND)
        os.close(fd)


def listing(shared: Path) -> list[str]:
    """Every path under the private ``/tmp`` except the kept directories' contents."""
    kept = set(_kept(shared))
    out = []
    for top, dirs, files in os.walk("/tmp"):
        dirs[:] = [d for d in dirs if Path(top, d) not in kept]
        out += [os.path.join(top, name) for name in dirs + files]
    return sorted(out)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if argv == ["--probe"]:
        private_tmp(None)
        Path("/tmp/probe").write_text("private")
        return 0
    shared, out, sep, *cmd = argv
    assert sep == "--" and cmd, "usage: nodens SHARED LISTING -- CMD..."
    private_tmp(Path(shared))
    env = {**os.environ, "TMPDIR": "/tmp"}
    code = subprocess.call(cmd, env=env, preexec_fn=_die_with_parent)
    Path(out).write_text(json.dumps(listing(Path(shared))))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
