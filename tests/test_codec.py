from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchrl_dcp.errors import CheckpointFormatError, EncodingError
from torchrl_dcp.format.codec import decode, encode, tensor_specs


def roundtrip(value):
    skeleton, tensors = encode(value, "c")
    skeleton = json.loads(json.dumps(skeleton, allow_nan=False))  # must survive real JSON
    return decode(skeleton, {k: t.clone() for k, t in tensors.items()}), tensors


def test_every_supported_leaf_round_trips() -> None:
    od = OrderedDict(a=torch.ones(2))
    od._metadata = {"": {"version": 1}}
    value = {
        "t": torch.arange(6, dtype=torch.int16).reshape(2, 3),
        "bf": torch.ones(3, dtype=torch.bfloat16),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "arr": np.arange(4, dtype=np.uint8),
        "np_scalar": np.float32(1.5),
        "np_int": np.int64(-3),
        "nan": float("nan"),
        "inf": -math.inf,
        "size": torch.Size([2, 3]),
        "dtype": torch.float16,
        "device": torch.device("cpu"),
        "tuple": (1, "a", None, True),
        "set": {3, 1, 2},
        "bytes": b"\x00\xff",
        "complex": 1 + 2j,
        "slice": slice(1, None, 2),
        "range": range(0, 10, 3),
        "path": Path("/a/b"),
        "odict": od,
        3: "int key",
        "nested": [{"x": [torch.zeros(1)]}],
    }
    out, tensors = roundtrip(value)
    assert torch.equal(out["t"], value["t"]) and out["t"].dtype == torch.int16
    assert out["bf"].dtype == torch.bfloat16 and out["empty"].shape == (0, 4)
    assert isinstance(out["arr"], np.ndarray) and out["arr"].dtype == np.uint8
    assert type(out["np_scalar"]) is np.float32 and out["np_int"] == -3
    assert math.isnan(out["nan"]) and out["inf"] == -math.inf
    assert out["size"] == torch.Size([2, 3]) and out["dtype"] is torch.float16
    assert out["tuple"] == (1, "a", None, True) and out["set"] == {1, 2, 3}
    assert out["bytes"] == b"\x00\xff" and out["complex"] == 1 + 2j
    assert out["slice"] == slice(1, None, 2) and out["range"] == range(0, 10, 3)
    assert out["path"] == Path("/a/b") and out[3] == "int key"
    assert isinstance(out["odict"], OrderedDict) and out["odict"]._metadata == {"": {"version": 1}}
    assert "nested/0/x/0" in tensors


def test_keys_are_paths_and_shared_tensors_are_stored_once() -> None:
    w = torch.ones(3)
    skeleton, tensors = encode({"a": {"b/c": w}, "alias": w}, "c")
    assert list(tensors) == ["a/b%2Fc"]
    out = decode(skeleton, tensors)
    assert out["alias"] is out["a"]["b/c"]


@pytest.mark.parametrize(
    "bad", [object(), lambda: 0, {"k": {1, object()}}, np.array(["s"]), torch.eye(2).to_sparse_csr()]
)
def test_unencodable_value_names_its_path(bad) -> None:
    with pytest.raises(EncodingError, match=r"policy/outer/inner"):
        encode({"outer": {"inner": bad}}, "policy")


def test_specs_describe_every_tensor() -> None:
    skeleton, _ = encode({"a": torch.zeros(2, 3, dtype=torch.int64), "b": [torch.ones(1)]}, "c")
    specs = {s.key: s for s in tensor_specs(skeleton)}
    assert specs["a"].shape == (2, 3) and specs["a"].dtype == torch.int64
    assert specs["b/0"].shape == (1,)


@pytest.mark.parametrize(
    "skeleton",
    [
        {"t": "nope"},
        {"t": "tensor", "key": "x"},
        {"t": "dict", "items": 3},
        {"t": "dtype", "v": "os.system"},
        [1],
        {"t": "device", "v": "float32"},
    ],  # fmt: skip
)
def test_malformed_skeleton_is_a_format_error(skeleton) -> None:
    with pytest.raises(CheckpointFormatError):
        decode(skeleton, {})


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=20,
)


@given(json_values)
def test_json_values_round_trip(value) -> None:
    out, tensors = roundtrip(value)
    assert out == value and not tensors


@given(
    st.recursive(
        st.none() | st.integers() | st.text() | st.booleans(),
        lambda c: st.lists(c) | st.dictionaries(st.sampled_from(["t", "v", "items", "key", "x"]), c),
        max_leaves=15,
    )
)
def test_random_skeletons_never_crash_otherwise(skeleton) -> None:
    try:
        decode(skeleton, {})
        list(tensor_specs(skeleton))
    except CheckpointFormatError:
        pass


def test_an_integer_json_cannot_hold_is_refused_at_encoding_naming_its_path(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Python writes at most 4,300 decimal digits of an integer to JSON: a larger one is refused when the state is
    encoded (named by its path), not when the manifest is committed; one just below the bound round-trips."""
    import torchrl_dcp as tdcp

    with pytest.raises(tdcp.EncodingError, match=r"stats/deep/1 \(an integer of more than 14000 bits"):
        tdcp.DistributedCheckpoint(stats={"deep": [1, 10**5000]}).save(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    big = -(1 << 13_999)
    path = tdcp.DistributedCheckpoint(stats={"n": big}).save(tmp_path / "b")
    live: dict = {}
    tdcp.DistributedCheckpoint(stats=live).load(path)
    assert live == {"n": big}


def _same(a: object, b: object) -> bool:
    """Equal with the same types all the way down (NaN equal to NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)  # type: ignore[index]
    if isinstance(a, np.ndarray):
        return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)  # type: ignore[union-attr]
    if isinstance(a, (float, np.floating)) and math.isnan(a):
        return math.isnan(b)  # type: ignore[arg-type]
    return bool(a == b)


@pytest.mark.parametrize(
    "value",
    [np.float64("nan"), np.float64("-inf"), np.float64(0.25), np.array(3.5), np.array(7, dtype=np.int16)],
    ids=["f64-nan", "f64-inf", "f64", "0d-f64-array", "0d-i16-array"],
)
def test_numpy_float64_scalars_and_0d_arrays_come_back_as_saved(tmp_path: Path, value: object) -> None:
    """NumPy's float64 is a float: a NaN one was written as ``np.float64(nan)``, which no load read (a committed
    checkpoint, unloadable); a finite one came back a Python float; a 0-d array came back of shape (1,)."""
    import torchrl_dcp as tdcp

    path = tdcp.DistributedCheckpoint(stats={"x": value}).save(tmp_path / "c")
    tdcp.verify(path)
    live: dict = {}
    tdcp.DistributedCheckpoint(stats=live).load(path)
    assert _same(live, {"x": value}), (live, value)


@pytest.mark.parametrize(
    "make, why",
    [
        (lambda: np.ma.masked_array([1.0, 2.0], mask=[False, True]), "numpy array subclass"),
        (lambda: np.matrix([[1, 2]]), "numpy array subclass"),
        (lambda: np.zeros(2, dtype=np.longdouble), "has no torch dtype"),
        (lambda: np.longdouble(1.5), "no exact Python value"),
        (lambda: torch.zeros(4, dtype=torch.uint8).view(torch.quint8), "does not save"),
        (lambda: torch.zeros(2, dtype=torch.uint8).view(torch.bits8), "does not save"),
        (lambda: range(0, 1 << 15000), "more than 14000 bits"),
    ],
    ids=["masked-array", "matrix", "longdouble-array", "longdouble-scalar", "quint8-view", "bits8", "huge-range"],
)
def test_values_a_load_would_not_give_back_are_refused_at_save_naming_them(tmp_path: Path, make, why: str) -> None:  # type: ignore[no-untyped-def]
    """What a load could not give back as saved is refused when the state is encoded, naming its path (a masked
    array lost its mask, a matrix its kind; the others failed at commit or while reading, naming nothing)."""
    import torchrl_dcp as tdcp

    with pytest.raises(tdcp.EncodingError, match=rf"stats/deep/x \(.*{why}"):
        tdcp.DistributedCheckpoint(stats={"deep": {"x": make()}}).save(tmp_path / "c")
    assert not (tmp_path / "c").exists()


def _bits(x: float) -> bytes:
    import struct

    return struct.pack(">d", x)


@pytest.mark.parametrize("bits", ["fff8000000000000", "7ff8000000000123", "7ff0000000000001", "7ff8000000000000"])
def test_a_nan_keeps_its_sign_and_payload(bits: str) -> None:
    import struct

    nan = struct.unpack(">d", bytes.fromhex(bits))[0]
    (out, _) = roundtrip({"x": nan, "l": [nan]})
    assert _bits(out["x"]).hex() == bits and _bits(out["l"][0]).hex() == bits


@pytest.mark.parametrize("bits", ["zz", "3ff0000000000000", 7, "7ff8"])
def test_forged_nan_bits_are_a_format_error(bits) -> None:
    with pytest.raises(CheckpointFormatError, match="NaN bits"):
        decode({"t": "float", "v": "nan", "bits": bits}, {})


@pytest.mark.parametrize(
    ("dtype", "words"),
    [
        ("float32", [0x7F800001]),
        ("float32", [0xFFC01234]),
        ("float16", [0x7C01]),
        ("complex64", [0x7FC01234, 0xFF800001]),
    ],
)
def test_a_narrow_numpy_nan_scalar_keeps_its_bits(dtype: str, words: list[int]) -> None:
    """A float32 signalling NaN scalar came back quiet (its Python float is a float64: the conversion sets the
    quiet bit); a complex64's NaN part too."""
    raw = np.array(words, dtype=np.uint16 if dtype == "float16" else np.uint32).tobytes()
    value = np.frombuffer(raw, dtype=dtype)[0]
    (out, _) = roundtrip({"x": value})
    assert type(out["x"]) is type(value) and out["x"].tobytes() == raw


@pytest.mark.parametrize("bits", ["zz", "0000803f", "0100807f00", 7, "01008"])
def test_forged_numpy_nan_bits_are_a_format_error(bits: object) -> None:
    """Bits that are not hex of the dtype's size, or that spell a number, where the value says NaN: refused."""
    node = {"t": "np", "dtype": "<f4", "v": {"t": "float", "v": "nan"}, "bits": bits}
    with pytest.raises(CheckpointFormatError, match="NaN bits"):
        decode(node, {})
    with pytest.raises(CheckpointFormatError, match="NaN bits"):  # a NaN's bits on a number
        decode({"t": "np", "dtype": "<f4", "v": 1.0, "bits": "0100807f"}, {})


def test_pure_paths_keep_their_flavour() -> None:
    from pathlib import PurePosixPath, PureWindowsPath

    value = {"w": PureWindowsPath(r"C:\data\run1"), "p": PurePosixPath("/data/run1"), "c": Path("/data/x")}
    out, _ = roundtrip(value)
    assert out == value and [type(out[k]) for k in value] == [type(v) for v in value.values()]
    assert out["w"].parts == ("C:\\", "data", "run1")
    with pytest.raises(CheckpointFormatError, match="path kind"):
        decode({"t": "path", "v": "x", "kind": "os.system"}, {})


def test_a_tensor_autograd_tracked_comes_back_tracked(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A dict's ``Parameter``, a list storage's transition saved with ``requires_grad=True``: restored into fresh
    tensors, they lost it (``torch.load`` keeps it), and samples of the buffer differed. A forged ``grad`` value is
    refused."""
    import json

    from torchrl.data import ListStorage, ReplayBuffer

    import torchrl_dcp as tdcp

    rb = ReplayBuffer(storage=ListStorage(4), batch_size=2)
    rb.extend([torch.ones(3, requires_grad=True), torch.zeros(3)])
    state = {"alpha": torch.nn.Parameter(torch.ones(2)), "plain": torch.ones(2)}
    path = tdcp.DistributedCheckpoint(x=state, buffer=rb).save(tmp_path / "c")
    fresh, rb2 = {}, ReplayBuffer(storage=ListStorage(4), batch_size=2)
    tdcp.DistributedCheckpoint(x=fresh, buffer=rb2).load(path)
    assert fresh["alpha"].requires_grad and not fresh["plain"].requires_grad
    assert [t.requires_grad for t in rb2._storage._storage] == [True, False]

    raw = json.loads((path / "manifest.json").read_text())
    text = json.dumps(raw).replace('"grad": true', '"grad": 1')
    assert text != json.dumps(raw)
    from torchrl_dcp.format.manifest import CHECKSUM_FIELD, seal

    forged = json.loads(text)
    forged.pop(CHECKSUM_FIELD)
    (path / "manifest.json").write_text(json.dumps(seal(forged)))
    with pytest.raises(tdcp.CheckpointFormatError, match="'grad' is true or absent"):
        tdcp.DistributedCheckpoint(x={}).load(path, components=["x"])


def test_a_tensor_laid_out_densely_comes_back_in_its_layout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A transposed or channels-last tensor, a Fortran-ordered array (in a dict, in a list storage) came back
    row-major where ``torch.load`` keeps the layout (and an op on it may round differently). Fresh tensors are
    allocated with the saved strides; a forged stride that is not a dense layout of the shape is refused."""
    import json

    import numpy as np
    from torchrl.data import ListStorage, ReplayBuffer

    import torchrl_dcp as tdcp
    from torchrl_dcp.format.manifest import CHECKSUM_FIELD, seal

    state = {
        "t": torch.randn(300, 500).t(),  # (large: read through a view of its destination when contiguous)
        "small": torch.randn(3, 4).t(),
        "cl": torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last),
        "f": np.asfortranarray(np.random.randn(3, 4)),
        "reversed": np.arange(5.0)[::-1],  # (torch cannot view negative strides: saved row-major)
        "part": torch.randn(6, 6)[:, :3],  # (a view of part of a larger tensor: saved row-major)
    }
    rb = ReplayBuffer(storage=ListStorage(4))
    rb.extend([torch.randn(4, 3).t(), np.asfortranarray(np.ones((2, 3)))])
    path = tdcp.DistributedCheckpoint(x=state, buffer=rb).save(tmp_path / "c")
    fresh, rb2 = {}, ReplayBuffer(storage=ListStorage(4))
    tdcp.DistributedCheckpoint(x=fresh, buffer=rb2).load(path)
    for key in ("t", "small", "cl"):
        assert fresh[key].stride() == state[key].stride() and torch.equal(fresh[key], state[key]), key
    assert fresh["f"].strides == state["f"].strides and np.array_equal(fresh["f"], state["f"])
    assert np.array_equal(fresh["reversed"], state["reversed"]) and fresh["reversed"].flags.c_contiguous
    assert fresh["part"].is_contiguous() and torch.equal(fresh["part"], state["part"])
    saved, loaded = rb._storage._storage, rb2._storage._storage
    assert loaded[0].stride() == saved[0].stride() == (1, 3) and loaded[1].strides == saved[1].strides

    raw = json.loads((path / "manifest.json").read_text())
    for bad in ("[1, 1]", "[0, 500]", "[1]", '[1, "500"]', "[1, -500]", "[1, 501]"):
        text = json.dumps(raw).replace('"stride": [1, 500]', f'"stride": {bad}')
        assert text != json.dumps(raw)
        forged = json.loads(text)
        forged.pop(CHECKSUM_FIELD)
        (path / "manifest.json").write_text(json.dumps(seal(forged)))
        with pytest.raises(tdcp.CheckpointFormatError, match="'stride'"):
            tdcp.DistributedCheckpoint(x={}).load(path, components=["x"])
        with pytest.raises(tdcp.CheckpointFormatError, match="'stride'"):
            tdcp.verify(path)


def test_layouts_torch_load_keeps_are_kept_everywhere_a_load_allocates(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Layouts the first change missed: strides that differ from row-major on dims of one element only (a
    channels-last 1x1 convolution's weight, grayscale frames), a tensor another component stores (a load of the
    referring one alone allocates it), a lazy replay-buffer storage (channels-last frames: torchrl's ``_init``
    allocates like the row it is given); and a transposed bool tensor holding bytes other than 0 and 1 (memory
    ``torch.empty`` left), saved as it was, was refused at every load."""
    from tensordict import TensorDict
    from torchrl.data import LazyTensorStorage, ReplayBuffer

    import torchrl_dcp as tdcp

    conv = torch.nn.Conv2d(8, 8, 1).to(memory_format=torch.channels_last)
    frames = torch.randn(3, 1, 4, 5).contiguous(memory_format=torch.channels_last)
    garbage = torch.empty(64, 64, dtype=torch.uint8).random_(2, 255).view(torch.bool).t()
    shared = torch.randn(5, 7).t()
    state = {"w": conv.weight.detach(), "frames": frames, "bools": garbage}
    rb = ReplayBuffer(storage=LazyTensorStorage(8))
    rb.extend(TensorDict(pixels=torch.rand(4, 3, 6, 6).contiguous(memory_format=torch.channels_last), batch_size=[4]))
    path = tdcp.DistributedCheckpoint(a={"t": shared}, b={"t": shared}, x=state, buffer=rb).save(tmp_path / "c")
    fresh, b, rb2 = {}, {}, ReplayBuffer(storage=LazyTensorStorage(8))
    tdcp.DistributedCheckpoint(b=b, x=fresh, buffer=rb2).load(path, components=["b", "x", "buffer"])
    assert fresh["w"].stride() == conv.weight.stride() != torch.empty(8, 8, 1, 1).stride()
    assert fresh["frames"].stride() == frames.stride() and torch.equal(fresh["frames"], frames)
    assert b["t"].stride() == shared.stride() and torch.equal(b["t"], shared)
    assert torch.equal(fresh["bools"].view(torch.uint8), (garbage.view(torch.uint8) != 0).to(torch.uint8))
    pixels, loaded = rb._storage._storage["pixels"], rb2._storage._storage["pixels"]
    assert loaded.stride() == pixels.stride() and torch.equal(loaded[:4], pixels[:4])


def test_a_forged_stride_past_the_element_count_or_numpy_kind_is_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A stride of 2**63 on a dim of one element passed the layout check and failed inside torch (a ``TypeError``
    reported as an incompatible component, skipped with ``strict="warn"``, accepted by ``verify``); an ``ndarray``
    node naming another numpy kind than its tensor (``<i4`` for float32) loaded converted values."""
    import json

    import numpy as np

    import torchrl_dcp as tdcp
    from torchrl_dcp.format.manifest import CHECKSUM_FIELD, seal

    path = tdcp.DistributedCheckpoint(x={"t": torch.randn(4, 1, 3).transpose(0, 2), "a": np.ones(3, "<f4")}).save(
        tmp_path / "c"
    )
    raw = (path / "manifest.json").read_text()
    assert '"stride":[1,3,3]' in raw and '"np_dtype":"<f4"' in raw
    for old, new, match in (
        ('"stride":[1,3,3]', f'"stride":[1,{2**63},3]', "'stride'"),
        ('"stride":[1,3,3]', '"stride":[1,13,3]', "'stride'"),
        ('"np_dtype":"<f4"', '"np_dtype":"<i4"', "numpy dtype '<i4' does not match"),
    ):
        forged = json.loads(raw.replace(old, new))
        forged.pop(CHECKSUM_FIELD)
        (path / "manifest.json").write_text(json.dumps(seal(forged)))
        for strict in ("error", "warn"):
            with pytest.raises(tdcp.CheckpointFormatError, match=match):
                tdcp.DistributedCheckpoint(x={}, strict=strict).load(path)
        with pytest.raises(tdcp.CheckpointFormatError, match=match):
            tdcp.verify(path)


def test_sets_encode_alike_in_every_process_whatever_the_hash_seed() -> None:
    """Set items were ordered by ``repr``, and a frozenset's ``repr`` follows string hashing, randomised per process:
    an equal replicated set of frozensets was refused as "differs between rank 0 and rank 1" depending on
    ``PYTHONHASHSEED``. Each process here encodes it, and a nested tuple of one, under another seed."""
    import os
    import subprocess
    import sys

    script = (
        "import json; from torchrl_dcp.format.codec import encode; "
        "v = {'s': {frozenset({'alpha', 'beta', 'gamma'}), frozenset({'delta', 'eps', 'zeta'})}, "
        "'t': {('k', frozenset({'x', 'y', 'z'})), ('j', frozenset({'u', 'v'}))}}; "
        "print(json.dumps(encode(v)[0]))"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in (1, 2, 3)
    }
    assert len(outputs) == 1, outputs


def test_a_nested_or_quantized_tensor_is_refused_with_advice_that_works() -> None:
    """A jagged nested tensor was told to use ``.to_sparse_coo()`` or ``.to_dense()``: both raise on it."""
    parts = [torch.randn(2, 3), torch.randn(4, 3)]
    for layout in (torch.jagged, torch.strided):
        nested = torch.nested.nested_tensor(parts, layout=layout)
        with pytest.raises(EncodingError, match=r"a nested tensor: save its components, value.unbind\(\), as a list"):
            encode({"nt": nested})
        (out, _) = roundtrip({"nt": list(nested.unbind())})  # what it says works
        assert all(torch.equal(a, b) for a, b in zip(out["nt"], parts))
    q = torch.quantize_per_tensor(torch.randn(4), 0.1, 0, torch.qint8)
    with pytest.raises(EncodingError, match=r"quantized tensor: save value.dequantize\(\)"):
        encode({"q": q})


class _ScaledTensor(torch.Tensor):
    pass


def test_a_tensor_subclass_is_refused_at_save_not_called_forged_at_load(tmp_path) -> None:
    """A module buffer of a user's tensor subclass: the save committed (DCP's writer pickled the class into the
    record), and the save's own verify and load called the checkpoint damaged or forged. Refused at save now, saying
    what to save instead, which works; parameters and memory-mapped tensors are saved as before."""
    from tensordict import MemoryMappedTensor

    import torchrl_dcp as tdcp

    model = torch.nn.Linear(2, 2)
    model.register_buffer("scale", torch.ones(2).as_subclass(_ScaledTensor))
    with pytest.raises(EncodingError, match=r"subclass .*_ScaledTensor.*value.as_subclass\(torch.Tensor\)"):
        tdcp.DistributedCheckpoint(model=model).save(tmp_path / "a")
    assert not (tmp_path / "a").exists()
    model.scale = model.scale.as_subclass(torch.Tensor)  # what it says works
    path = tdcp.DistributedCheckpoint(model=model).save(tmp_path / "a")
    assert tdcp.verify(path)
    (out, _) = roundtrip({"p": torch.nn.Parameter(torch.ones(2)), "m": MemoryMappedTensor.from_tensor(torch.ones(3))})
    assert torch.equal(out["p"], torch.ones(2)) and torch.equal(out["m"], torch.ones(3))


class _Phase(__import__("enum").IntEnum):
    WARMUP = 1
    TRAIN = 2


class _Mode(str, __import__("enum").Enum):
    EXPLORE = "explore"


class _Color(__import__("enum").Enum):
    RED = (1, "r")


def test_enum_members_keep_their_class_and_subclasses_of_int_or_str_are_refused() -> None:
    """An ``IntEnum`` or ``str`` Enum member came back as a plain int or str (``is Phase.TRAIN`` false, ``.name``
    gone), as dict keys too; a user's subclass of int was saved as an int where one of float was refused."""
    import enum

    value = {"phase": _Phase.TRAIN, "mode": _Mode.EXPLORE, "color": _Color.RED, _Phase.WARMUP: [_Mode.EXPLORE]}
    (out, _) = roundtrip(value)
    assert out["phase"] is _Phase.TRAIN and out["mode"] is _Mode.EXPLORE and out["color"] is _Color.RED
    assert out[_Phase.WARMUP] == [_Mode.EXPLORE] and type(next(iter(k for k in out if k == 1))) is _Phase

    class MyInt(int):
        pass

    with pytest.raises(EncodingError, match="a subclass of int"):
        encode({"n": MyInt(3)})

    class Local(enum.Enum):
        A = 1

    with pytest.raises(EncodingError, match="defined inside a function"):
        encode({"e": Local.A})
    flags = enum.IntFlag("Flags", "A B")
    with pytest.raises(EncodingError, match="combination of flags"):
        encode({"f": flags.A | flags.B})


@pytest.mark.parametrize(
    ("node", "why"),
    [
        ({"t": "enum", "cls": "os:system", "name": "x"}, "there is none of that name"),
        ({"t": "enum", "cls": "surely_not_imported_module:E", "name": "A"}, "not imported: import surely_not"),
        ({"t": "enum", "cls": f"{__name__}:_Phase", "name": "EVAL"}, "has no member 'EVAL'"),
        ({"t": "enum", "cls": f"{__name__}:_Phase.__class__", "name": "A"}, "there is none"),
        ({"t": "enum", "cls": 7, "name": "A"}, "malformed enum"),
        ({"t": "deque", "items": [1, 2, 3], "maxlen": 2}, "malformed deque"),
        ({"t": "deque", "items": [], "maxlen": -1}, "malformed deque"),
        ({"t": "deque", "items": [], "maxlen": True}, "malformed deque"),
        ({"t": "defaultdict", "items": [], "factory": "os.system"}, "malformed defaultdict: factory 'os.system'"),
        ({"t": "defaultdict", "items": [], "factory": ["int"]}, "malformed defaultdict"),
        ({"t": "defaultdict", "items": []}, None),  # (no factory: None, as defaultdict() has)
    ],
)
def test_forged_enum_and_deque_entries_are_refused_without_importing_anything(node: dict, why: str) -> None:
    import sys

    if why is None:
        assert decode(node, {}).default_factory is None
        return
    with pytest.raises(CheckpointFormatError, match=why):
        decode(node, {})
    assert "surely_not_imported_module" not in sys.modules


def test_a_defaultdict_keeps_its_factory_or_is_refused_by_name(tmp_path: Path) -> None:
    """A nested ``defaultdict(list)`` came back as a dict (``d["new"].append(x)`` raised ``KeyError`` after a resume,
    silently). Its factory is kept when it is a type the node can name; a function is refused at save, naming it,
    except for the registered value itself (filled in place: its own factory stays)."""
    from collections import defaultdict

    import torchrl_dcp as tdcp

    state = {"returns": defaultdict(list, {"a": [1.0]}), "counts": {"x": defaultdict(int, k=2)}, "none": defaultdict()}
    path = tdcp.DistributedCheckpoint(no_dist=True, stats=state).save(tmp_path / "c")
    live: dict = {}
    tdcp.DistributedCheckpoint(no_dist=True, stats=live).load(path)
    assert live["returns"].default_factory is list and live["counts"]["x"].default_factory is int
    assert live["none"].default_factory is None and live == state
    live["returns"]["b"].append(2.0)  # (a KeyError before)
    with pytest.raises(tdcp.EncodingError, match=r"stats/nested \(a defaultdict whose default_factory is .*<lambda>"):
        tdcp.DistributedCheckpoint(no_dist=True, stats={"nested": defaultdict(lambda: 0)}).save(tmp_path / "f")
    assert not (tmp_path / "f").exists()
    top = defaultdict(lambda: 7, a=1)
    tdcp.DistributedCheckpoint(no_dist=True, top=top).save(tmp_path / "t")
    again = defaultdict(lambda: 7)
    tdcp.DistributedCheckpoint(no_dist=True, top=again).load(tmp_path / "t")
    assert again == {"a": 1} and again["new"] == 7


def test_a_deque_keeps_its_maxlen_in_any_component(tmp_path: Path) -> None:
    """A ``deque(maxlen=3)`` in a dict component came back as a list (its window grew without bound after a resume,
    silently), and a ``Counter`` as a dict (``c["new"] += 1`` raised ``KeyError``); through an object's
    ``state_dict`` the deque was refused."""
    from collections import Counter, deque

    import torchrl_dcp as tdcp

    state = {"recent": deque([1.0, 2.0, 3.0], maxlen=3), "counts": Counter(left=3), "open": deque([torch.ones(2)])}
    path = tdcp.DistributedCheckpoint(no_dist=True, stats=state).save(tmp_path / "c")
    live: dict = {}
    result = tdcp.DistributedCheckpoint(no_dist=True, stats=live).load(path)
    assert live["recent"] == deque([1.0, 2.0, 3.0]) and live["recent"].maxlen == 3
    assert type(live["counts"]) is Counter and type(result.values["stats"]["open"]) is deque
    window = deque([0.0], maxlen=3)  # a live deque is filled in place
    tdcp.DistributedCheckpoint(no_dist=True, w=window).save(tmp_path / "w")
    other = deque(maxlen=5)
    with pytest.raises(tdcp.IncompatibleComponentError, match=r"register deque\(maxlen=3\)"):
        tdcp.DistributedCheckpoint(no_dist=True, w=other).load(tmp_path / "w")
    same = deque([9.0, 9.0], maxlen=3)
    tdcp.DistributedCheckpoint(no_dist=True, w=same).load(tmp_path / "w")
    assert list(same) == [0.0]


@pytest.mark.parametrize(
    "node",
    [
        {"t": "np", "dtype": "<i2", "v": 1.5},
        {"t": "np", "dtype": "<f4", "v": 1e300},
        {"t": "np", "dtype": "|b1", "v": 2},
        {"t": "np", "dtype": "<i4", "v": True},
        {"t": "np", "dtype": "<c8", "v": "x"},
    ],
)
def test_a_numpy_scalar_its_dtype_cannot_hold_exactly_is_refused(node: dict) -> None:
    """``int16`` of 1.5 loaded as 1, ``float32`` of 1e300 as inf, ``bool`` of 2 as True: numpy casts them, where
    no save writes such a value."""
    with pytest.raises(CheckpointFormatError, match="numpy scalar of dtype"):
        decode(node, {})


def test_numpy_scalars_of_every_kind_round_trip_exactly() -> None:
    values = [np.int16(-3), np.uint64(2**64 - 1), np.float32(0.1), np.float16(65504), np.float32("inf"), np.bool_(1)]
    values += [np.complex64(1 + 2j), np.complex128(complex(float("nan"), 1.0)), np.float64(0.1), np.int8(-128)]
    (out, _) = roundtrip({"v": values})
    assert all(type(a) is type(b) and a.tobytes() == b.tobytes() for a, b in zip(out["v"], values))
