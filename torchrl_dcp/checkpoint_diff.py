"""How two checkpoints differ: what ``torchrl-dcp diff A B`` compares and prints.

Components only on one side; per component, tensors only on one side, with another shape or dtype, or whose values
differ (how many elements, the largest finite absolute difference), and the paths of non-tensor values that differ.
Both checkpoints are checked as ``verify`` checks them before anything is read; tensors are read and checksummed
component by component (torch imported on first use).

Example:
    >>> import tempfile, torch, torchrl_dcp as tdcp
    >>> d = tempfile.mkdtemp()
    >>> a = tdcp.DistributedCheckpoint(w={"x": torch.zeros(3)}).save(d + "/a")
    >>> b = tdcp.DistributedCheckpoint(w={"x": torch.tensor([0.0, 1.0, 0.0])}).save(d + "/b")
    >>> diff_checkpoints(str(a), str(b), 0.0)["components"]["w"]["tensors"]["replicated/w/x"]["differing"]
    1
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

from torchrl_dcp.format.manifest_depth import MAPPING_NODES
from torchrl_dcp.placement import is_absent_skeleton

__all__ = ["diff_checkpoints", "print_diff", "tolerance"]


def tolerance(text: str) -> float:
    """``--atol``: a finite number ≥ 0 (a negative or NaN tolerance would hide or invent differences)."""
    import math

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def diff_checkpoints(a: str, b: str, atol: float, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """How checkpoints ``a`` and ``b`` differ; ``progress(done, total)``: bytes of tensors read (both sides)."""
    from torchrl_dcp.extract import as_source
    from torchrl_dcp.verification import check_structure

    sa, sb = as_source(a), as_source(b)
    ma, mb = sa.manifest(), sb.manifest()
    for src in (sa, sb):  # what verify checks before reading: another save's files, forged states (no checksums yet)
        check_structure(src)
    ca, cb = ma["components"], mb["components"]
    advance = None
    if progress is not None:
        from torchrl_dcp.storage.archive import byte_counter

        total = sum(2 * _tensor_bytes(ca[n]["inventory"], _comparable(ca[n], cb[n])) for n in set(ca) & set(cb))
        advance = byte_counter(total, progress)
    out: dict[str, Any] = {
        "a": str(sa.path),
        "b": str(sb.path),
        "only_in_a": sorted(set(ca) - set(cb)),
        "only_in_b": sorted(set(cb) - set(ca)),
        "components": {},
        "identical": True,
    }
    if out["only_in_a"] or out["only_in_b"]:
        out["identical"] = False
    for name in sorted(set(ca) & set(cb)):
        ra, rb = ca[name], cb[name]
        entry: dict[str, Any] = {"tensors": {}, "state_differs": False, "layout_differs": False}
        inv_a, inv_b = ra["inventory"], rb["inventory"]
        if (ra["adapter"], ra["adapter_version"], ra["placement"]) != (
            rb["adapter"],
            rb["adapter_version"],
            rb["placement"],
        ):
            entry["layout_differs"] = True
        values = _value_differences(_strip_tensors(ra), _strip_tensors(rb))
        if values:
            entry["state_differs"] = True  # non-tensor values (JSON leaves) differ
            entry["values"] = values
        common = _comparable(ra, rb)
        for key in sorted(set(inv_a) ^ set(inv_b)) + sorted(k for k in set(inv_a) & set(inv_b) if inv_a[k] != inv_b[k]):
            entry["tensors"][key] = {
                "status": "only in a"
                if key not in inv_b
                else "only in b"
                if key not in inv_a
                else "shape or dtype differs"
            }
        if common:
            entry["tensors"].update(_compare_tensors(sa, sb, name, common, atol, advance))
        if entry["tensors"] or entry["state_differs"] or entry["layout_differs"]:
            out["components"][name] = entry
            out["identical"] = False
    return out


def _comparable(ra: dict[str, Any], rb: dict[str, Any]) -> list[str]:
    """The keys of two components' inventories with one dtype and shape on both sides: their values are compared."""
    inv_a, inv_b = ra["inventory"], rb["inventory"]
    return sorted(k for k in set(inv_a) & set(inv_b) if inv_a[k] == inv_b[k])


def _tensor_bytes(inventory: dict[str, Any], keys: list[str]) -> int:
    from torchrl_dcp.format.codec import dtype_from_name

    return sum(math.prod(inventory[k]["shape"]) * dtype_from_name(inventory[k]["dtype"]).itemsize for k in keys)


def _compare_tensors(
    sa: Any, sb: Any, name: str, common: list[str], atol: float, advance: Callable[[int], None] | None
) -> dict[str, Any]:
    """The tensors of component ``name`` among ``common`` whose values differ, by key (sorted); ``advance`` is told
    the bytes of each tensor read."""
    import torch

    from torchrl_dcp.extract import iter_inventory

    found: dict[str, Any] = {}
    tensors_b = dict(_restrict(iter_inventory(sb, name), set(common)))
    if advance is not None:
        advance(sum(t.numel() * t.element_size() for t in tensors_b.values()))
    for key, ta in _restrict(iter_inventory(sa, name), set(common)):
        tb = tensors_b.pop(key)
        if advance is not None:
            advance(ta.numel() * ta.element_size())
        if torch.equal(ta, tb):
            continue
        difference = _tensor_difference(ta, tb, atol)
        if difference is not None:
            found[key] = difference
    return found


def _tensor_difference(ta: Any, tb: Any, atol: float) -> dict[str, Any] | None:
    """How two tensors of one dtype and shape differ (``None``: within ``atol``); JSON-safe (no NaN).

    Bools count the differing elements; numbers also give the largest finite absolute difference (``None`` when the
    differences are all NaN or infinite: e.g. a NaN against a number).
    """
    import torch

    if ta.dtype == torch.bool:
        return {"status": "values differ", "differing": int((ta != tb).sum())}
    if ta.is_complex():
        diff = (ta - tb).abs()
    elif ta.is_floating_point() or ta.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        diff = (ta.double() - tb.double()).abs()
    else:
        return {"status": "values differ", "differing": int((ta != tb).sum())}
    same = (ta == tb) | (torch.isnan(ta) & torch.isnan(tb)) if ta.is_floating_point() else ta == tb
    unequal = ~same
    finite = diff[unequal & torch.isfinite(diff)]
    max_abs = float(finite.max()) if finite.numel() else None
    nonfinite = bool((unequal & ~torch.isfinite(diff)).any())
    if not ta.is_floating_point() and not ta.is_complex() and max_abs is not None:
        max_abs = max(
            max_abs, 1.0
        )  # (integers past 2**53 differ by less than float64 tells: unequal ones by 1 or more)
    if not nonfinite and max_abs is not None and max_abs <= atol:
        return None
    if not bool(unequal.any()):
        return None  # (NaN in the same places: the same values)
    return {"status": "values differ", "differing": int(unequal.sum()), "max_abs_diff": max_abs}


#: skeleton nodes of single values (their fields are no paths of the user's state)
_LEAF_NODES = frozenset(
    {"float", "np", "enum", "complex", "bytes", "bytearray", "dtype", "device", "path", "size", "slice", "range"}
)


def _value_differences(a: Any, b: Any, where: str = "", limit: int = 20) -> list[str]:
    """Paths (into the saved state skeletons) where two components' JSON values differ, at most ``limit``."""
    out: list[str] = []

    def walk(x: Any, y: Any, path: str) -> None:
        if len(out) >= limit:
            return
        if isinstance(x, dict) and isinstance(y, dict) and (x.get("t") in _LEAF_NODES or y.get("t") in _LEAF_NODES):
            if x != y:  # one value (a NaN's bits, a NumPy scalar's dtype): said whole, never by its node's fields
                out.append(f"{path or '/'}: {_short(x)} != {_short(y)}")
            return
        if isinstance(x, dict) and isinstance(y, dict):
            if x.get("t") in MAPPING_NODES and y.get("t") == x.get("t") and "items" in x and "items" in y:
                xi = {json.dumps(i[0]): i[1] for i in x["items"] if len(i) == 2}
                yi = {json.dumps(i[0]): i[1] for i in y["items"] if len(i) == 2}
                for k in sorted(set(xi) | set(yi)):
                    sub = f"{path}/{json.loads(k)}"
                    if k not in xi or k not in yi:
                        out.append(f"{sub} (only in {'b' if k not in xi else 'a'})")
                    else:
                        walk(xi[k], yi[k], sub)
                return
            for k in sorted(set(x) | set(y)):
                if k in x and k in y:
                    walk(x[k], y[k], path if k in ("t", "v", "items") else f"{path}/{k}")
                else:
                    out.append(f"{path}/{k} (only in {'b' if k not in x else 'a'})")
            return
        if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")
            return
        if type(x) is not type(y) or x != y:  # (True, 1 and 1.0 are equal in Python, restored as different values)
            out.append(f"{path or '/'}: {_short(x)} != {_short(y)}")

    walk(a, b, where)
    return out


def _short(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _restrict(items: Any, keys: set[str]) -> Any:
    return ((k, v) for k, v in items if k in keys)


def _strip_tensors(rec: dict[str, Any]) -> Any:
    """A component's saved states without tensor references: only the JSON values remain."""

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            if node.get("t") in ("tensor", "dtensor", "alias", "xref"):
                return "<tensor>"
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    if rec["placement"] != "per_rank":
        return walk(rec["state"])
    # (a rank that registered none saved the absent marker: shown as such, not as a value of the user's)
    return {r: ABSENT_SHOWN if is_absent_skeleton(s["state"]) else walk(s["state"]) for r, s in rec["ranks"].items()}


#: what ``diff`` shows for a rank's per-rank state saved absent (the rank registered no such component)
ABSENT_SHOWN = "<not registered on this rank>"


def print_diff(info: dict[str, Any]) -> None:
    if info["identical"]:
        print(f"identical: {info['a']} and {info['b']}")
        return
    for side in ("a", "b"):
        if info[f"only_in_{side}"]:
            print(f"only in {side}: {', '.join(info[f'only_in_{side}'])}")
    for name, entry in info["components"].items():
        notes = []
        if entry["layout_differs"]:
            notes.append("adapter/placement differ")
        if entry["state_differs"]:
            notes.append("non-tensor values differ")
        print(f"{name}: {len(entry['tensors'])} tensors differ" + (f" ({'; '.join(notes)})" if notes else ""))
        for key, t in entry["tensors"].items():
            extra = f", {t['differing']} elements" if "differing" in t else ""
            if t.get("max_abs_diff") is not None:
                extra += f", max abs diff {t['max_abs_diff']:.6g}"
            print(f"  {key}: {t['status']}{extra}")
        for value in entry.get("values", ()):
            print(f"  value {value}")
