"""The public face of format migrations: register upgrades of older checkpoints (docs/migrations.md).

The manifest schema and its validation live in :mod:`torchrl_dcp.format.manifest`, the migration registry in
:mod:`torchrl_dcp.format.migrations`; this module exposes what users call.

Example:
    >>> from torchrl_dcp.manifest import register_adapter_migration
    >>> @register_adapter_migration("example.counter", 1)  # doctest: +SKIP
    ... def counter_v1_to_v2(state):
    ...     return {**state, "new_field": 0}
"""

from __future__ import annotations

from torchrl_dcp.format.migrations import (
    make_skeleton_dict,
    register_adapter_migration,
    register_migration,
    skeleton_dict,
)

__all__ = ["make_skeleton_dict", "register_adapter_migration", "register_migration", "skeleton_dict"]
