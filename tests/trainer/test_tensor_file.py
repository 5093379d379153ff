"""``trainer/tensor_file.py``: round trips of every value a checkpoint piece holds, the layout other tools
read (``safetensors``), and a table of hostile files, each refused in one line before any tensor is made."""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch

from trainer import tensor_file
from trainer.checkpoint import CheckpointError
from trainer.checkpoint_io import write_tensors
from trainer.piece_files import load_file


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


TIED = torch.randn(5, 3)
ROUND_TRIPS = {
    "state-dict": {"wte.weight": torch.randn(7, 4), "h.0.ln.bias": torch.zeros(4), "lm_head.weight": torch.randn(7, 4)},
    "tied-weights": {"wte.weight": TIED, "lm_head.weight": TIED},
    "every-dtype": {str(dt): torch.arange(6).to(dt).reshape(2, 3) for dt in tensor_file.DTYPES if not dt.is_floating_point or dt.itemsize > 1}
    | {"bool": torch.tensor([True, False, True]), "f8": torch.zeros(4, dtype=torch.float8_e4m3fn)},
    "scalars-and-empties": {"step": torch.tensor(3.0), "empty": torch.zeros(0, 5), "none": None, "flag": False, "n": -7, "s": "x"},
    "optimizer-like": {"format": "f/1", "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0, 1]}],
                       "groups": [{"key": "exp_avg", "params": [0, 1], "shapes": [[2], [3]], "data": torch.randn(5)}],
                       "other": {0: {"k": 1.5}, 1: {}}},
    "rng-like": {"python": {"version": 3, "state": torch.arange(625, dtype=torch.int64), "gauss": None},
                 "numpy": {"kind": "MT19937", "keys": torch.arange(624), "pos": 624, "has_gauss": 0, "gauss": 0.0},
                 "torch": torch.get_rng_state()},
    "non-finite-floats": {"a": [float("nan"), float("inf"), float("-inf")], "b": 1e308},
    "reserved-looking-keys": {"__tensor__": "not a tensor", "__dict__": [1, 2], "plain": {"__x": torch.ones(2)}},
    "non-contiguous": {"t": torch.arange(12.0).reshape(3, 4).t()},
}


@pytest.mark.parametrize("case", sorted(ROUND_TRIPS))
def test_a_tensor_file_round_trips_what_a_piece_holds(tmp_path, case):
    obj = ROUND_TRIPS[case]
    path = tmp_path / "x.safetensors"
    digest = write_tensors(path, obj)
    assert digest.startswith("blake3:")
    for mapped in (True, False):
        back = tensor_file.load(path, mapped=mapped)
        assert _same(obj, back), case
    if case == "tied-weights":
        back = tensor_file.load(path)
        assert back["wte.weight"] is back["lm_head.weight"]
        assert path.stat().st_size < 8 + 1024 + TIED.numel() * 4 * 2, "a tied tensor is written once"


def test_the_model_file_is_a_safetensors_file_to_other_tools(tmp_path):
    """The layout is safetensors': its own reader loads the tensors by their state-dict names, and the
    data starts 8-byte aligned with each tensor aligned to its element size."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    sd = {"b": torch.randn(3, dtype=torch.float16), "a": torch.randn(2, 2, dtype=torch.float64), "c": torch.arange(3, dtype=torch.int8)}
    path = tmp_path / "model.safetensors"
    write_tensors(path, sd)
    theirs = safetensors_torch.load_file(str(path))
    assert theirs.keys() == sd.keys() and all(torch.equal(theirs[k], sd[k]) for k in sd)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert n % 8 == 0 and header["__metadata__"]["format"] == tensor_file.FORMAT
    for name, e in header.items():
        if name != "__metadata__":
            assert e["data_offsets"][0] % sd[name].element_size() == 0, name


def _file(header: dict | None = None, data: bytes = b"", *, meta: dict | None = None, raw_header: bytes | None = None,
          pad: bool = True) -> bytes:
    if raw_header is None:
        h = dict(header or {})
        h["__metadata__"] = {"format": tensor_file.FORMAT, "tree": json.dumps({"t": {"__tensor__": "t"}})} if meta is None else meta
        raw_header = json.dumps(h).encode()
    if pad:  # as every writer here pads it: to 8 bytes, with spaces
        raw_header += b" " * (-len(raw_header) % 8)
    return struct.pack("<Q", len(raw_header)) + raw_header + data


GOOD_T = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
# case -> (file bytes, what the one line says)
HOSTILE = {
    "empty": (b"", "shorter than its length prefix"),
    "header-longer-than-file": (struct.pack("<Q", 1 << 20) + b"{}", "does not fit the file"),
    "header-huge": (struct.pack("<Q", 1 << 40), "does not fit the file"),
    "header-not-json": (_file(raw_header=b"{not json"), "header is not JSON"),
    "header-a-list": (_file(raw_header=b"[1, 2]"), "header is not a JSON object"),
    "header-nested-deep": (_file(raw_header=b"[" * 100_000 + b"]" * 100_000), "header is not JSON"),
    "no-metadata": (_file(raw_header=json.dumps(GOOD_T).encode(), data=bytes(8)), "not a sentinel.tensor-tree/1 file"),
    "other-format": (_file(GOOD_T, bytes(8), meta={"format": "pt", "tree": "{}"}), "format 'pt'"),
    "plain-safetensors": (_file(GOOD_T, bytes(8), meta={}), "not a sentinel.tensor-tree/1 file"),
    "unknown-dtype": (_file({"t": {"dtype": "F128", "shape": [1], "data_offsets": [0, 16]}}, bytes(16)), "unknown dtype 'F128'"),
    "extra-entry-key": (_file({"t": {**GOOD_T["t"], "x": 1}}, bytes(8)), "expected exactly dtype, shape and data_offsets"),
    "negative-dim": (_file({"t": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8)), "shape is not a list of sizes"),
    "bool-dim": (_file({"t": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4)), "shape is not a list of sizes"),
    "huge-dims": (_file({"t": {"dtype": "U8", "shape": [1 << 40, 1 << 40], "data_offsets": [0, 8]}}, bytes(8)), "does not fill"),
    "offsets-past-the-end": (_file({"t": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8)), "data_offsets out of the file"),
    "offsets-reversed": (_file({"t": {"dtype": "F32", "shape": [0], "data_offsets": [8, 0]}}, bytes(8)), "data_offsets out of the file"),
    "shape-does-not-fill": (_file({"t": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8)), "does not fill its 8 bytes"),
    "overlap": (_file({"t": GOOD_T["t"], "u": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12)), "overlap"),
    "gap": (_file({"t": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8)), "leave a gap"),
    "trailing-bytes": (_file(GOOD_T, bytes(12)), "the data is 12 bytes, its tensors cover 8"),
    "header-unpadded": (_file(raw_header=b'{"a":1}', pad=False), "not a multiple of 8"),
    "misaligned-tensor": (_file({"s": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]}, "t": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}},
                                bytes(10)), "not aligned to its 4-byte elements"),
    "tree-not-json": (_file(GOOD_T, bytes(8), meta={"format": tensor_file.FORMAT, "tree": "{"}), "the tree is not JSON"),
    "tree-names-a-missing-tensor": (_file(GOOD_T, bytes(8), meta={"format": tensor_file.FORMAT, "tree": '{"__tensor__": "nope"}'}),
                                    "names a tensor the header lacks"),
    "tree-unknown-tag": (_file(GOOD_T, bytes(8), meta={"format": tensor_file.FORMAT, "tree": '{"__code__": "os.system"}'}), "unknown tag"),
    "tree-tag-with-company": (_file(GOOD_T, bytes(8), meta={"format": tensor_file.FORMAT, "tree": '{"__tensor__": "t", "x": 1}'}),
                              "node has other keys"),
    "tree-bad-float": (_file(GOOD_T, bytes(8), meta={"format": tensor_file.FORMAT, "tree": '{"__float__": "1e999"}'}), "__float__"),
    "tree-bare-nan": (_file(GOOD_T, bytes(8), meta={"format": tensor_file.FORMAT, "tree": "[NaN]"}), "bare non-finite"),
    "tree-dict-not-pairs": (_file(GOOD_T, bytes(8), meta={"format": tensor_file.FORMAT, "tree": '{"__dict__": [[1]]}'}), "[key, value] pairs"),
    "tree-dict-tensor-key": (_file(GOOD_T, bytes(8), meta={"format": tensor_file.FORMAT, "tree": '{"__dict__": [[{"__tensor__": "t"}, 1]]}'}),
                             "key that is not a plain value"),
    "tree-nested-deep": (_file(GOOD_T, bytes(8), meta={"format": tensor_file.FORMAT, "tree": "[" * 50_000 + "]" * 50_000}),
                         "the tree is"),
    "a-torch-pickle": (None, "not a readable tensor file"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_tensor_file_is_refused_in_one_line(tmp_path, case):
    data, why = HOSTILE[case]
    path = tmp_path / "step-00000001" / "optim.safetensors"
    path.parent.mkdir()
    if data is None:
        torch.save({"t": torch.ones(2)}, path)
    else:
        path.write_bytes(data)
    msgs = []
    for _ in range(2):  # the second time its header's parse may be kept (``tensor_file._parsed``): the same verdict
        with pytest.raises(CheckpointError) as ei:
            load_file(path, mapped=True)
        msgs.append(str(ei.value))
    msg = msgs[0]
    assert "\n" not in msg and msg.startswith("step-00000001: optim.safetensors is not a readable tensor file"), msg
    assert why in msg and msgs[1] == msg, msgs


def test_a_header_parsed_before_is_judged_with_its_new_data():
    """``tensor_file._parsed`` keeps the parse of a header, keyed by its bytes and the data's length:
    the same header over other values gives views of the new bytes; over more bytes, it is refused."""
    first = tensor_file.read(bytearray(_file(GOOD_T, struct.pack("<2f", 1.0, 2.0))))
    buf = bytearray(_file(GOOD_T, struct.pack("<2f", 3.0, 4.0)))
    second = tensor_file.read(buf)
    assert first["t"].tolist() == [1.0, 2.0] and second["t"].tolist() == [3.0, 4.0]
    buf[-4:] = struct.pack("<f", 9.0)  # a view of the new bytes, not of the first file's
    assert second["t"].tolist() == [3.0, 9.0] and first["t"].tolist() == [1.0, 2.0]
    with pytest.raises(tensor_file.TensorFileError, match="the data is 12 bytes, its tensors cover 8"):
        tensor_file.read(bytearray(_file(GOOD_T, bytes(12))))


def test_what_no_tensor_file_can_hold_is_refused_when_it_is_written(tmp_path):
    """A writer's bug, not a hostile file: an object JSON cannot carry fails the save, naming where it is."""
    for obj, why in (({"a": {"b": object()}}, "a.b: a object"), ({"x": torch.ones(2, dtype=torch.complex64)}, "complex64"),
                     ({(1, 2): 3}, "not a plain value")):
        with pytest.raises(TypeError, match=why):
            tensor_file.encode(obj)


def test_a_sync_saves_host_stage_keeps_ties_reuses_its_buffers_and_writes_the_same_file(tmp_path):
    """``HostStage`` (a sync save's copy of its device tensors into kept buffers; CUDA in a run, the CPU's
    own tensors here): the values as they were, one host tensor for two names of the same memory (a tied
    weight, written once), the same buffers at the next save of the same shapes, new ones when a shape
    changes, none kept for a state over its cap, and the bytes of the file exactly those of the unstaged
    state's."""
    from trainer.checkpoint_thread import HostStage

    emb = torch.randn(10, 4)
    state = {"wte": emb, "lm_head": emb, "ln": torch.randn(4), "t": emb.t()}
    per_rank = {"rng": [torch.arange(3)], "n": 5}
    stage = HostStage(device_type="cpu")
    shared, mine = stage.stage(state, per_rank)
    assert shared["wte"] is shared["lm_head"] and shared["wte"] is not emb and torch.equal(shared["wte"], emb)
    assert torch.equal(shared["t"], emb.t()) and torch.equal(mine["rng"][0], per_rank["rng"][0]) and mine["n"] == 5
    ptrs = [b.data_ptr() for b in stage.buffers]
    write_tensors(tmp_path / "staged.safetensors", shared)
    write_tensors(tmp_path / "live.safetensors", state)
    assert (tmp_path / "staged.safetensors").read_bytes() == (tmp_path / "live.safetensors").read_bytes()

    emb.add_(1)  # the next save: the same shapes, new values, the same buffers
    again, _ = stage.stage(state, per_rank)
    assert [b.data_ptr() for b in stage.buffers] == ptrs and torch.equal(again["wte"], emb)
    grown, _ = stage.stage({**state, "ln": torch.randn(8)}, per_rank)
    assert grown["ln"].shape == (8,) and len(stage.buffers) == len(ptrs)
    assert stage.stage({"n": 1}, {}) == ({"n": 1}, {})  # nothing to copy: the objects as they were
    stage.keep_bytes = 100  # a state larger than what is kept: buffers of its own save, none kept
    big, _ = stage.stage(state, per_rank)
    assert big["wte"] is big["lm_head"] and torch.equal(big["wte"], emb) and stage.buffers == [] and stage.specs is None
