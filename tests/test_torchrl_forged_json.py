"""Every JSON value of a ``torchrl.checkpoint`` checkpoint replaced by a value of another kind: ``verify`` and a load
raise a ``CheckpointError`` naming a file, or accept it; never a raw ``TypeError``, ``AttributeError`` or ``KeyError``.

torchrl's format has no checksums: any value in its JSON files may be anything. The cases are generated from the
files a real checkpoint holds (a module, an optimizer, a prioritized buffer): each key of each JSON object, to depth
two, set to each of a list, an object, a string, a negative number, ``null`` and an integer past 64 bits.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict
from torchrl.data import LazyTensorStorage, PrioritizedSampler, ReplayBuffer

import torchrl_dcp as tdcp

REPLACEMENTS = ([], {}, "x", -1, None, 2**64)


def _objects() -> dict[str, Any]:
    torch.manual_seed(0)
    policy = torch.nn.Linear(4, 2)
    optim = torch.optim.Adam(policy.parameters())
    policy(torch.randn(3, 4)).sum().backward()
    optim.step()
    rb = ReplayBuffer(storage=LazyTensorStorage(16), sampler=PrioritizedSampler(16, 0.7, 0.5))
    rb.extend(TensorDict({"obs": torch.randn(5, 3)}, [5]))
    return {"policy": policy, "optim": optim, "buffer": rb}


def _paths(value: Any, depth: int = 0) -> Iterator[tuple[Any, ...]]:
    if isinstance(value, dict) and depth < 2:
        for key, sub in value.items():
            yield (key,)
            yield from ((key, *rest) for rest in _paths(sub, depth + 1))


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    out = json.loads(json.dumps(value))
    node = out
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = new
    return out


def test_a_torchrl_checkpoint_whose_json_values_are_of_other_kinds_is_refused_naming_a_file(tmp_path: Path) -> None:
    from torchrl.checkpoint import Checkpoint

    source = tmp_path / "source"
    Checkpoint(**_objects()).save(source)
    files = sorted(p.relative_to(source) for p in source.rglob("*.json"))
    assert len(files) >= 5  # (the manifest, the module's and optimizer's schemas, the buffer's metadata)
    leaked, cases = [], 0
    for rel in files:
        original = json.loads((source / rel).read_text())
        for path in _paths(original):
            for new in REPLACEMENTS:
                cases += 1
                forged = tmp_path / f"case{cases}"
                shutil.copytree(source, forged)
                (forged / rel).write_text(json.dumps(_replaced(original, path, new)))
                for what in ("verify", "load"):
                    try:
                        with warnings.catch_warnings():
                            warnings.simplefilter("ignore")
                            if what == "verify":
                                tdcp.verify(forged)
                            else:
                                tdcp.DistributedCheckpoint(**_objects()).load(forged, strict="error")
                    except tdcp.CheckpointError as err:
                        if err.path is None:
                            leaked.append(f"{rel} {list(path)} = {new!r}: {what}: names no file: {err}")
                    except Exception as err:  # noqa: BLE001 - what the test looks for
                        leaked.append(f"{rel} {list(path)} = {new!r}: {what}: {type(err).__name__}: {err}")
                shutil.rmtree(forged)
    assert cases > 100
    assert not leaked, "\n".join(leaked[:20])
