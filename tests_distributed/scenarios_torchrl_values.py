"""Rank code: torchrl's GlobalRNGState saved on 2 ranks (each its own streams) and resumed per rank."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torchrl.checkpoint import GlobalRNGState

import torchrl_dcp as tdcp


def save_and_resume_global_rng(path: str) -> dict[str, Any]:
    rank = dist.get_rank()
    torch.manual_seed(10 + rank)  # each rank's own streams: a replicated placement refused the save
    np.random.seed(10 + rank)
    random.seed(10 + rank)
    tdcp.DistributedCheckpoint(rng=GlobalRNGState()).save(path)
    expected = [torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random()]
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    tdcp.DistributedCheckpoint(rng=GlobalRNGState()).load(path)
    return {"expected": expected, "resumed": [torch.rand(2).tolist(), np.random.rand(2).tolist(), random.random()]}
