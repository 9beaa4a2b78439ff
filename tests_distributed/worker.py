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
    with open(os.environ["TDCP_RESULT"], "w") as f:
        json.dump(value, f)


if __name__ == "__main__":
    main()
