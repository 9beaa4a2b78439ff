"""Preparing a save: the call's arguments checked on every rank, the state encoded and planned, the chunks an
incremental base keeps, and (for async saves) the state staged in host memory.

:func:`prepare_save` is steps 1-2 of :meth:`DistributedCheckpoint.save <torchrl_dcp.DistributedCheckpoint.save>`;
:func:`torchrl_dcp.save_engine.run` writes and commits the job it returns.

Example (one process):
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> from torchrl_dcp import save_engine
    >>> from torchrl_dcp.save_prepare import prepare_save
    >>> ckpt = tdcp.DistributedCheckpoint(model=torch.nn.Linear(2, 2))
    >>> job = prepare_save(ckpt, tempfile.mkdtemp() + "/c", 1, None, None, None)
    >>> save_engine.run(job).name
    'c'
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

from torchrl_dcp import _dist, save_engine
from torchrl_dcp.arguments import check_component_options, check_json, check_step
from torchrl_dcp.collective import refused_on_every_rank, run_agreed
from torchrl_dcp.format.manifest_depth import MAX_DEPTH
from torchrl_dcp.incremental import incremental_base, share_base
from torchrl_dcp.json_values import metadata_values
from torchrl_dcp.settings import check_environment
from torchrl_dcp.storage.backends import save_location
from torchrl_dcp.trainer_binding import register_op_hooks

if TYPE_CHECKING:
    from torchrl_dcp.adapters import CheckpointOptions
    from torchrl_dcp.checkpoint import DistributedCheckpoint

__all__ = ["prepare_save"]


def prepare_save(
    ckpt: DistributedCheckpoint,
    path: str | os.PathLike,
    step: int | None,
    metadata: Mapping[str, Any] | None,
    components: Collection[str] | None,
    component_options: Mapping[str, CheckpointOptions] | None,
    incremental_from: str | os.PathLike | None = None,
    stage: Any = None,
) -> save_engine.SaveJob:
    """Steps 1-2 of a save (encode, plan, chunks kept from an incremental base), and staging for async saves.

    Collective. With ``stage`` (async saves), each rank stages only the tensors and
    chunk rows it will write.
    """
    group = ckpt._group()
    rank, world = _dist.group_rank(group), _dist.group_size(group)
    try:  # the arguments, checked at the call: refused on one rank, on every rank (or the others would wait)
        check_environment()  # a bad TDCP_* value fails here, whichever step would read it
        register_op_hooks(getattr(ckpt, "_solo_of", ckpt))  # a bound Trainer's hooks that only register_op reaches
        location = save_location(path, ckpt.storage_options)  # a URL: an object-store prefix (docs/objectstores.md)
        several = _dist.group_size(group) > 1
        names = ckpt._select(components, ckpt.save_components, some_ranks=several)
        # (options for another rank's per-rank component: left out here; refused where no rank registered it)
        elsewhere = set(component_options or ()) - set(ckpt._components) if several else ()
        options = check_component_options(component_options, names, "saved", elsewhere=elsewhere)
        step = check_step(step)  # before anything is written: the manifest records an integer (or null)
        # (numpy and 0-d tensor scalars as numbers; nested as deep as the manifest holding it may be)
        metadata = metadata_values(metadata, MAX_DEPTH - 1)
    except Exception as err:
        refused_on_every_rank(group, err, lambda fail: save_engine.plan(group, fail))
    given = step
    if step is None and type(metadata.get("step")) is int:  # (rank 0's metadata is the one recorded)
        step = metadata["step"]

    def encode_step() -> save_engine.Encoded:
        if rank == 0:  # rank 0's metadata is the one recorded (another rank's mean over no episode may be NaN)
            check_json(metadata, "metadata")
        items = [
            save_engine.EncodeItem(
                n,
                ckpt._components[n].value,
                ckpt._adapter(n),
                ckpt._components[n].placement,
                ckpt._ctx(n, options.get(n)),
            )
            for n in names
        ]
        return save_engine.encode(items, rank)

    checks = {n: ckpt._components[n].replica_check or ckpt.replica_check for n in names}
    chosen = components if components is not None else ckpt.save_components
    call = {  # what every rank passes alike (layouts compared): the selection too, where per-rank components
        "path": str(location.path),  # one rank lacks are saved as absent on it
        "step": given,
        "components": None if chosen is None else sorted(chosen),
    }
    encoded, write_plan = save_engine.plan(group, encode_step, checks, call, component_options or ())
    job = save_engine.SaveJob(location.path, location, step, metadata, encoded, write_plan, group, rank, world)
    try:
        base = incremental_base(incremental_from, location, ckpt.storage_options)
        base_info = share_base(group, base, rank, before=location.sweep_before_save)  # (before any proof)
        if base_info is None:  # nothing to check in a base: local views only, no exchange
            save_engine.plan_chunks(job, None, stage is not None)
        else:
            job.kept_from = base_info.origins
            run_agreed(
                group,
                "planning the chunk files",
                lambda: save_engine.plan_chunks(job, base_info, stage is not None),
                monitored=False,
            )
        if stage is not None:
            run_agreed(group, "staging the state", lambda: _stage_share(job, stage), monitored=False)
    except BaseException:
        encoded.settle(None)
        raise
    return job


def _stage_share(job: save_engine.SaveJob, stage: Any) -> None:
    """Async saves: copy into host buffers what this rank writes (everything, for DCP's writer)."""
    encoded, write_plan = job.encoded, job.plan
    mine = set(write_plan.share(job.rank)) if write_plan.backend == "fast" else set(encoded.flat)
    todo = {k: t for k, t in encoded.flat.items() if k in mine}
    todo.update({f"chunk:{f}": rows for f, rows in job.chunk_rows.items() if rows is not None})
    staged, job.stage_event = stage(todo)
    encoded.flat = {k: staged.get(k, t) for k, t in encoded.flat.items()}  # the others are never read
    job.chunk_rows = {f: None if rows is None else staged[f"chunk:{f}"] for f, rows in job.chunk_rows.items()}
