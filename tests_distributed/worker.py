"""Entry point of one rank started by :func:`tests_distributed.launch.launch`."""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch.distributed as dist


def main() -> None:
    target, args = sys.argv[1], json.loads(sys.argv[2])
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    dist.init_process_group("gloo")
    try:
        value = func(*args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = os.environ["TDCP_RESULT"]
    with open(out + ".tmp", "w") as f:  # (renamed whole: a rank killed meanwhile, by the launcher, leaves no half file)
        json.dump(value, f)
    os.replace(out + ".tmp", out)


def call_main(module: str, *argv: str) -> None:
    """Run ``module.main(argv)`` (an example script) on this rank, as ``torchrun -m module argv`` would."""
    importlib.import_module(module).main(list(argv))


def run_rank(target: str, args_json: str, env: dict[str, str], log: str) -> None:
    """A rank forked from the launcher's pre-loaded server (see ``launch.py``): its environment, output and argv."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(env.get("TDCP_ROOT", os.getcwd()))
    for entry in reversed(env.get("PYTHONPATH", "").split(os.pathsep)):
        if entry and entry not in sys.path:
            sys.path.insert(0, entry)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    sys.argv = [__file__, target, args_json]
    main()


if __name__ == "__main__":
    main()
