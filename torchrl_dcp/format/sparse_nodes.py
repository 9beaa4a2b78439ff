"""A sparse COO tensor's node in a state skeleton: its indices and values stored as two plain tensors.

torch's SGD with momentum keeps a sparse ``momentum_buffer`` for a parameter whose gradients are sparse
(``nn.Embedding(sparse=True)``), and a module may hold a sparse buffer. Such a tensor is saved as::

    {"t": "sparse_coo", "shape": [...], "coalesced": bool, "indices": <tensor node>, "values": <tensor node>}

``indices`` (``int64``, ``[sparse_dim, nnz]``) and ``values`` (``[nnz, *dense dims]``) are the tensor's own,
uncoalesced ones when it is uncoalesced (``_indices()``, ``_values()``): the next optimizer step sees the same
entries in the same order, so a resume is exact. A load rebuilds it with ``check_invariants=True``: an index out of
the saved shape, or a claim of ``coalesced`` for indices that are not, is refused as a forged manifest instead of
reaching torch's kernels (which trust them). Other sparse layouts (CSR, CSC, BSR, BSC) are refused at save time.

Example:
    >>> import torch
    >>> t = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.tensor([1.0, 2.0]), (3,))
    >>> node = sparse_node(t, {"t": "tensor"}, {"t": "tensor"})
    >>> node["shape"], node["coalesced"]
    ([3], False)
    >>> build_sparse(node, t._indices(), t._values()).to_dense().tolist()
    [1.0, 0.0, 2.0]
"""

from __future__ import annotations

from typing import Any

import torch

from torchrl_dcp.errors import CheckpointFormatError
from torchrl_dcp.format.tensor_nodes import TensorSpec

__all__ = ["build_sparse", "check_sparse_indices", "sparse_node", "sparse_parts"]

MAX_DIMS = 64  # torch's own limit on a tensor's dimensions
_MAX_SIZE = (1 << 63) - 1  # a size torch takes (int64)


def sparse_parts(value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The indices and values a save stores for a sparse COO tensor, as it holds them (never coalesced here)."""
    value = value.detach()
    return value._indices(), value._values()


def sparse_node(value: torch.Tensor, indices: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """The node of sparse COO tensor ``value`` whose parts have the tensor nodes ``indices`` and ``values``."""
    node = {
        "t": "sparse_coo",
        "shape": list(value.shape),
        "coalesced": bool(value.is_coalesced()),
        "indices": indices,
        "values": values,
    }
    if value.requires_grad:
        node["grad"] = True
    return node


def _bad(what: str) -> CheckpointFormatError:
    return CheckpointFormatError(f"malformed sparse tensor: {what}; the checkpoint is damaged or forged")


def _shape(node: dict[str, Any]) -> tuple[int, ...]:
    shape = node["shape"]
    if (
        type(shape) is not list
        or len(shape) > MAX_DIMS
        or not all(type(n) is int and 0 <= n <= _MAX_SIZE for n in shape)
        or type(node["coalesced"]) is not bool
        or node.get("grad", False) is not True
        and "grad" in node
    ):
        raise _bad(f"shape {str(shape)[:60]}, coalesced {str(node['coalesced'])[:20]}")
    for part in ("indices", "values"):
        inner = node[part]
        if type(inner) is not dict or inner.get("t") != "tensor":
            raise _bad(f"its {part} are not a tensor node")
    return tuple(shape)


def build_sparse(node: dict[str, Any], indices: Any, values: Any) -> Any:
    """The sparse COO tensor of ``node`` from its decoded parts: tensors, or while a load is planned their
    :class:`TensorSpec` (then a spec of the whole tensor: its shape, the values' dtype and device).

    Raises:
        CheckpointFormatError: the parts do not make a sparse tensor of the node's shape, an index is out of it,
            or the node claims coalesced indices that are not.
    """
    shape = _shape(node)
    if indices.dtype != torch.int64 or len(indices.shape) != 2 or indices.shape[0] > len(shape):
        raise _bad(f"indices of {indices.dtype} {list(indices.shape)} for shape {list(shape)}")
    sparse_dim, nnz = indices.shape
    if tuple(values.shape) != (nnz, *shape[sparse_dim:]):
        raise _bad(f"{nnz} indices but values of shape {list(values.shape)} for shape {list(shape)}")
    if isinstance(values, TensorSpec):
        return TensorSpec(values.key.rpartition("/")[0] or "_", shape, values.dtype, values.device)
    if indices.device != values.device:
        indices = indices.to(values.device)
    _check_coalesced_claim(node, sparse_dim, nnz)
    try:
        out = torch.sparse_coo_tensor(indices, values, shape, is_coalesced=node["coalesced"], check_invariants=True)
    except _TORCH_REFUSALS as err:  # torch's own invariant checks: an index out of range, uncoalesced indices
        raise _bad(str(err).splitlines()[0][:200]) from None
    if node.get("grad") and (values.dtype.is_floating_point or values.dtype.is_complex):
        out.requires_grad_(True)
    return out


#: what torch raises for sizes and indices it refuses (``TypeError``: a size past int64 on some paths)
_TORCH_REFUSALS = (RuntimeError, TypeError, ValueError, OverflowError)


def _check_coalesced_claim(node: dict[str, Any], sparse_dim: int, nnz: int) -> None:
    """torch's invariant checks do not look at the claim for a tensor of no sparse dimensions: coalesced, it holds
    at most one entry."""
    if node["coalesced"] and sparse_dim == 0 and nnz > 1:
        raise _bad(
            f"coalesced claimed for {nnz} entries of a tensor of no sparse dimensions (at most 1 once coalesced)"
        )


def check_sparse_indices(node: dict[str, Any], indices: torch.Tensor) -> None:
    """Refuse ``indices`` (read for ``node``, checked by :func:`build_sparse` while planning) that torch's invariant
    checks refuse: what a load and ``verify`` run on every sparse tensor before anything is restored (torch's own
    checks, on stand-in values of one byte per entry).

    Example:
        >>> node = {"t": "sparse_coo", "shape": [3], "coalesced": True, "indices": {"t": "tensor"},
        ...         "values": {"t": "tensor"}}
        >>> check_sparse_indices(node, torch.tensor([[0, 2]]))
        >>> check_sparse_indices(node, torch.tensor([[2, 0]]))
        Traceback (most recent call last):
        ...
        torchrl_dcp.errors.CheckpointFormatError: malformed sparse tensor: cannot set is_coalesced to true if indices correspond to uncoalesced COO tensor; the checkpoint is damaged or forged
    """
    shape = _shape(node)
    sparse_dim, nnz = indices.shape
    _check_coalesced_claim(node, sparse_dim, nnz)
    stand_in = torch.zeros(nnz, dtype=torch.uint8, device=indices.device)
    try:
        torch.sparse_coo_tensor(
            indices, stand_in, shape[:sparse_dim], is_coalesced=node["coalesced"], check_invariants=True
        )
    except _TORCH_REFUSALS as err:
        raise _bad(str(err).splitlines()[0][:200]) from None
