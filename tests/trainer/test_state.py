"""The checkpoint state's named pieces (trainer/state.py), in process: every piece round-trips
(``state_dict`` -> ``load_state_dict`` of another trainer gives the same state), the pieces together
are exactly train_state.json and the checkpoint's files, and each piece's ``check`` refuses its hostile
input in one line without touching the live state. Two offline tiny trainers, no run, no subprocess."""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch

from sentinel.contract.checkpoints import TrainStateFile
from trainer import flat_state
from trainer.checkpoint import CheckpointError
from trainer.errors import TrainingError
from trainer.state import TRAIN_STATE


def _trainer(dataset, run_dir):
    from trainer.config import resolve
    from trainer.dist import DistEnv
    from trainer.train import Trainer

    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = resolve(preset="tiny", overrides={"data.dir": str(dataset)})
    return Trainer(cfg, run_dir, DistEnv(0, 0, 1, torch.device("cpu")), offline=True)


@pytest.fixture(scope="module")
def trainers(tmp_path_factory, dataset):
    """(a, b): ``a`` one real step and a skip range ahead of a fresh ``b`` in every piece."""
    root = tmp_path_factory.mktemp("state")
    a, b = _trainer(dataset, root / "a"), _trainer(dataset, root / "b")
    ids, _, micro, micro_ids = a.next_batch()
    a.train_step(micro, micro_ids, a.lr_for(0, ids))
    a.state.step, a.state.tokens = 1, len(ids) * a.cfg.model.seq_len
    a.seq_now = a.cfg.model.seq_len
    a.skip.add([(5, 9)])
    return a, b


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return isinstance(y, (list, tuple)) and len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    return x == y


@pytest.mark.parametrize("name", ["model", "optimizer", "optimizer-torch-format", "rng", "counters", "sampler",
                                  "guard", "skiplist"])
def test_each_piece_round_trips_into_another_trainer(trainers, name):
    """``optimizer-torch-format``: ``optim.pt`` as checkpoints before the flat format hold it (torch's
    optimizer state dict) loads to the same state."""
    a, b = trainers
    torch_format = name == "optimizer-torch-format"
    name = "optimizer" if torch_format else name
    sa, sb = a.checkpoints.state.states[name], b.checkpoints.state.states[name]
    saved = copy.deepcopy(sa.state_dict())
    if torch_format:
        saved = flat_state.unpack(saved, "optim.pt")
        assert "state" in saved and "groups" not in saved
    if name == "rng":  # the generators are the process's: move them on, then bring them back
        random.random(), np.random.rand(), torch.rand(3)
    else:
        assert not _same(saved, sb.state_dict()), f"{name}: the fixture left both trainers alike"
    sb.check(saved, "step-00000001")
    sb.load_state_dict(copy.deepcopy(saved))
    assert _same(sa.state_dict(), sb.state_dict()), name
    if name == "optimizer":  # loaded into flat moments, as a fresh run lays them out: the next save copies none
        live = next(iter(b.opt.state.values()))
        for g in sb.state_dict()["groups"]:
            assert g["data"].untyped_storage().data_ptr() == live[g["key"]].untyped_storage().data_ptr(), g["key"]


def _torch_view(opt) -> str:
    """Everything torch's ``state_dict`` says of ``opt``, in order (key orders included), as text."""
    sd = opt.state_dict()
    return repr((sd["param_groups"], [(i, [(k, v.dtype, v.tolist()) for k, v in st.items()]) for i, st in sd["state"].items()]))


def _reload_slowly(piece, saved):
    """``saved`` loaded the way every load went before ``flat_state.copy_plan``: unpacked, then torch's load."""
    piece.tr.opt.load_state_dict(flat_state.unpack(copy.deepcopy(saved), "optim.safetensors"))


def test_a_file_laid_out_as_the_live_optimizer_loads_by_copies_exactly_as_torch_loads_it(trainers):
    """The in-process rollback's path (``flat_state.copy_plan``): once the live optimizer holds flat state,
    a file of the same layout is checked to a ``FlatCopy`` and loaded by a copy per flat tensor. The
    optimizer then says exactly what torch's load of the same file leaves (hyper-parameters, key
    orders, every value), and its moments stay the flat tensors the next save writes without a copy."""
    a, b = trainers
    sa, sb = a.checkpoints.state.states["optimizer"], b.checkpoints.state.states["optimizer"]
    saved = copy.deepcopy(sa.state_dict())
    _reload_slowly(sb, saved)
    want = _torch_view(b.opt)
    flats = [g["data"].untyped_storage().data_ptr() for g in sb.state_dict()["groups"]]
    with torch.no_grad():  # move the live state away from the file's: other moments, another group's betas
        for st in b.opt.state.values():
            for v in st.values():
                v.add_(1.5)
    b.opt.param_groups[0]["betas"] = (0.5, 0.5)
    plan = sb.check(saved, "step-00000001")
    assert isinstance(plan, flat_state.FlatCopy) and len(plan.copies) == 3
    sb.load_state_dict(plan)
    assert _torch_view(b.opt) == want
    assert [g["data"].untyped_storage().data_ptr() for g in sb.state_dict()["groups"]] == flats


def _groups_reordered(sd):
    return {**sd, "groups": sd["groups"][::-1]}


def _indices_moved(sd):  # torch maps a file's parameters by position: any distinct indices load alike
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        g["params"] = [100 + i for i in g["params"]]
    for g in sd["groups"]:
        g["params"] = [100 + i for i in g["params"]]
    return sd


def _moments_in_float64(sd):  # torch casts each moment to its parameter's dtype
    return {**sd, "groups": [{**g, "data": g["data"].double()} if g["key"] != "step" else g for g in sd["groups"]]}


def _hook(opt):
    return opt.register_load_state_dict_post_hook(lambda o: None)


# a file torch loads, laid out otherwise than the live state (or a load with a hook to run): no copy plan,
# and the load gives what torch's does
NEAR_MISSES = {
    "state-groups-reordered": (_groups_reordered, None),
    "parameter-indices-moved": (_indices_moved, None),
    "moments-in-float64": (_moments_in_float64, None),
    "a-load-hook-registered": (lambda sd: sd, _hook),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_a_file_laid_out_otherwise_takes_torchs_load(trainers, case):
    a, b = trainers
    change, hook = NEAR_MISSES[case]
    sa, sb = a.checkpoints.state.states["optimizer"], b.checkpoints.state.states["optimizer"]
    saved = copy.deepcopy(sa.state_dict())
    _reload_slowly(sb, saved)  # the live state is flat: only the file's layout (or the hook) stands in the way
    assert isinstance(sb.check(copy.deepcopy(saved), "step-00000001"), flat_state.FlatCopy)
    handle = hook(b.opt) if hook else None
    try:
        assert flat_state.copy_plan(change(copy.deepcopy(saved)), b.opt) is None
        _reload_slowly(sb, change(copy.deepcopy(saved)))
        want = _torch_view(b.opt)
        with torch.no_grad():
            for st in b.opt.state.values():
                for v in st.values():
                    v.add_(1.5)
        sb.load_state_dict(sb.check(change(copy.deepcopy(saved)), "step-00000001"))
        assert _torch_view(b.opt) == want
    finally:
        if handle:
            handle.remove()


@pytest.mark.parametrize("name", ["run", "scheduler"])
def test_the_pieces_saved_for_the_record_load_nothing(trainers, name):
    """The run's identity and the LR schedule's position (a function of the step) are checked and
    saved, never applied: the run id follows the run dir, the counters bring the step back."""
    a, b = trainers
    saved, before = a.checkpoints.state.states[name].state_dict(), b.checkpoints.state.states[name].state_dict()
    b.checkpoints.state.states[name].check(saved, "step-00000001")
    b.checkpoints.state.states[name].load_state_dict(saved)
    after = b.checkpoints.state.states[name].state_dict()
    for sd in (before, after):
        sd.pop("last_checkpoint_time", None)
    assert _same(before, after)


def test_the_pieces_are_exactly_train_state_json_and_the_checkpoint_files(trainers):
    a, _ = trainers
    st = a.checkpoints.state
    owned = [k for p in st.states.values() for k in p.keys]
    assert len(owned) == len(set(owned)), "a train_state.json key owned by two pieces"
    assert set(owned) == set(TrainStateFile.model_fields)
    ts = TrainStateFile.model_validate(st.train_state())  # what a save writes passes the loader's schema
    assert ts.step == ts.scheduler.step == a.state.step == 1 and ts.skiplist == [[5, 9]]
    shared, per_rank = st.files()
    assert sorted(shared) == ["model.safetensors", "optim.safetensors", TRAIN_STATE] and list(per_rank) == ["rng-rank0.safetensors"]
    shared, per_rank = st.files(shared_files=False)  # a rank other than 0 builds no model/optimizer state
    assert list(shared) == [TRAIN_STATE] and list(per_rank) == ["rng-rank0.safetensors"]
    assert list(st.layout(sharded=True))[0] == "model_optimizer" and "model" not in st.layout(sharded=True)


def _model_reshaped(sd):
    k = next(iter(sd))
    return {**sd, k: torch.zeros(3, 3)}


def _opt_group(key, **change):
    """The flat optimizer file's group of ``key`` changed (``trainer/flat_state.py``)."""
    def corrupt(sd):
        sd = copy.deepcopy(sd)
        g = next(g for g in sd["groups"] if g["key"] == key)
        for k, f in change.items():
            g[k] = f(g[k], g)
        return sd
    return corrupt


def _first_moment_as(n):  # the first parameter's exp_avg as n values: the file stays consistent in itself
    def data(d, g):
        first = 1
        for x in g["shapes"][0]:
            first *= x
        return torch.cat([d[:n], d[first:]])
    return {"data": data, "shapes": lambda s, g: [[n]] + s[1:]}  # in this order: data reads the old shapes


def _opt_torch_format_reshaped(sd):
    sd = copy.deepcopy(flat_state.unpack(sd, "optim.pt"))
    next(iter(sd["state"].values()))["exp_avg"] = torch.zeros(7)
    return sd


def _train_state(key, **change):
    return lambda sd: {**sd, key: {**sd[key], **change}}


# piece -> (corrupt its good state_dict, error type, what the one line says)
HOSTILE = {
    "model-not-a-dict": ("model", lambda sd: [1, 2], CheckpointError, "model.safetensors is not a state dict"),
    "model-entry-missing": ("model", lambda sd: dict(list(sd.items())[1:]), CheckpointError, "model.safetensors lacks entry"),
    "model-entry-unknown": ("model", lambda sd: {**sd, "extra.weight": torch.zeros(1)}, CheckpointError, "has an unknown entry 'extra.weight'"),
    "model-wrong-shape": ("model", _model_reshaped, CheckpointError, "is (3, 3) torch.float32, expected"),
    "optim-empty": ("optimizer", lambda sd: {}, CheckpointError, "optim.safetensors is not an optimizer state dict"),
    "optim-group-lost": ("optimizer", lambda sd: {**sd, "param_groups": sd["param_groups"][:-1]}, CheckpointError, "parameter groups, expected"),
    "optim-moment-reshaped": ("optimizer", _opt_group("exp_avg", **_first_moment_as(7)), CheckpointError,
                              "exp_avg does not match the parameter's shape"),
    "optim-torch-format-reshaped": ("optimizer", _opt_torch_format_reshaped, CheckpointError, "exp_avg does not match the parameter's shape"),
    "optim-format-unknown": ("optimizer", lambda sd: {**sd, "format": "sentinel.flat-optimizer/9"}, CheckpointError,
                             "has format 'sentinel.flat-optimizer/9'; this trainer reads"),
    "optim-groups-not-a-list": ("optimizer", lambda sd: {**sd, "groups": "all"}, CheckpointError, "optim.safetensors is not an optimizer state dict"),
    "optim-group-not-a-dict": ("optimizer", lambda sd: {**sd, "groups": [7]}, CheckpointError, "optim.safetensors: state group 0 is malformed"),
    "optim-data-2d": ("optimizer", _opt_group("exp_avg", data=lambda d, g: d.view(1, -1)), CheckpointError, "has no 1-D data"),
    "optim-data-short": ("optimizer", _opt_group("exp_avg", data=lambda d, g: d[:-1]), CheckpointError, "is shorter than its shapes say"),
    "optim-data-long": ("optimizer", _opt_group("exp_avg_sq", data=lambda d, g: torch.cat([d, d[:1]])), CheckpointError,
                        "values, its shapes"),
    "optim-index-negative": ("optimizer", _opt_group("step", params=lambda p, g: [-1] + p[1:]), CheckpointError,
                             "malformed parameter indices or shapes"),
    "optim-index-not-int": ("optimizer", _opt_group("step", params=lambda p, g: ["0"] + p[1:]), CheckpointError,
                            "malformed parameter indices or shapes"),
    "optim-shape-negative": ("optimizer", _opt_group("exp_avg", shapes=lambda s, g: [[-4, 2]] + s[1:]), CheckpointError,
                             "malformed parameter indices or shapes"),
    "optim-shape-too-deep": ("optimizer", _opt_group("exp_avg", shapes=lambda s, g: [[1] * 40] + s[1:]), CheckpointError,
                             "malformed parameter indices or shapes"),
    "optim-index-repeated": ("optimizer", _opt_group("step", params=lambda p, g: [p[0], p[0]] + p[2:]), CheckpointError,
                             "repeats step of parameter"),
    "optim-unknown-parameter": ("optimizer", _opt_group("step", params=lambda p, g: p[:-1] + [999]), CheckpointError,
                                "state for unknown parameter 999"),
    "optim-moment-missing": ("optimizer", lambda sd: {**sd, "groups": [g for g in sd["groups"] if g["key"] != "exp_avg_sq"]},
                             CheckpointError, "exp_avg_sq does not match"),
    "optim-other-malformed": ("optimizer", lambda sd: {**sd, "other": {"x": 1}}, CheckpointError, "state of parameter 'x' is malformed"),
    "rng-garbage": ("rng", lambda sd: {"python": torch.zeros(3)}, CheckpointError, "rng-rank0.safetensors is not a valid RNG state"),
    "rng-numpy-keys-out-of-range": ("rng", lambda sd: {**sd, "numpy": {**sd["numpy"], "keys": sd["numpy"]["keys"] - 2**40}},
                                    CheckpointError, "not a valid RNG state"),
    "rng-torch-state-truncated": ("rng", lambda sd: {**sd, "torch": sd["torch"][:10]}, CheckpointError, "not a valid RNG state"),
    "other-dataset": ("run", lambda sd: {**sd, "dataset_fingerprint": "0" * 16}, TrainingError, "dataset fingerprint mismatch"),
    "other-world-size": ("run", lambda sd: {**sd, "world_size": 2}, TrainingError, "was written by 2 ranks, this run has 1"),
    "other-seq-len": ("counters", lambda sd: {**sd, "seq_len": 32}, TrainingError, "was trained at seq_len 32"),
    "other-sample-count": ("sampler", _train_state("sampler", num_samples=7), TrainingError, "was trained at 7 samples"),
    "other-guard-window": ("guard", _train_state("guard", window=3), TrainingError, "has a guard window of 3"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_each_piece_refuses_its_hostile_state_in_one_line_and_touches_nothing(trainers, case):
    a, _ = trainers
    name, corrupt, err, says = HOSTILE[case]
    piece = a.checkpoints.state.states[name]
    before = copy.deepcopy(piece.state_dict())
    with pytest.raises(err) as e:
        piece.check(corrupt(copy.deepcopy(before)), "step-00000012")
    msg = str(e.value)
    assert says in msg and "\n" not in msg and "step-00000012" in msg, msg
    now = piece.state_dict()
    if name == "run":
        before.pop("last_checkpoint_time"), now.pop("last_checkpoint_time")
    assert _same(before, now), f"{case}: check changed the live state"


# ---------------------------------------------------------------------------- byte plans (trainer/byte_plan.py)
def _write(path, obj):
    """``obj`` as a checkpoint's tensor file (``trainer/tensor_file.py``), at ``path``."""
    from trainer import tensor_file

    header, data = tensor_file.encode(obj)
    with open(path, "wb") as f:
        f.write(header)
        for d in data:
            f.write(d)
    return path


@pytest.fixture(scope="module")
def planned(trainers, tmp_path_factory, dataset):
    """(a, c, files): ``a``'s model and optimizer files, and a fresh trainer ``c`` that loaded each the
    plain way, which left a byte plan in each piece (the optimizer's from its second load: a fresh one
    has no state for a file to be laid out as)."""
    from sentinel.contract.fsio import map_file
    from trainer.checkpointing import TrainerCheckpoints

    a, _ = trainers
    root = tmp_path_factory.mktemp("plans")
    c = _trainer(dataset, root / "c")
    files = {}
    for name, file in (("model", "model.safetensors"), ("optimizer", "optim.safetensors")):
        files[name] = _write(root / file, copy.deepcopy(a.checkpoints.state.states[name].state_dict()))
        piece = c.checkpoints.state.states[name]
        for _ in range(2):  # a fresh optimizer has no state to plan for before its first load
            piece.load_state_dict(TrainerCheckpoints._prepare(piece, files[name], map_file(files[name])))
        assert piece._plan is not None, f"{name}: the plain load made no plan"
    return a, c, files


def _perturb(c) -> None:
    with torch.no_grad():
        for t in [*c.raw_model.parameters(), *(v for st in c.opt.state.values() for v in st.values())]:
            t.add_(1.5)


def _restore(piece, file):
    from sentinel.contract.fsio import map_file
    from trainer.checkpointing import TrainerCheckpoints

    piece.load_state_dict(TrainerCheckpoints._prepare(piece, file, map_file(file)))


@pytest.mark.parametrize("name", ["model", "optimizer"])
def test_a_file_with_the_header_of_the_last_restores_by_its_bytes_exactly(planned, name):
    """The second file with a header seen before (a rollback's load) is cut at the plan's offsets and
    copied into the same live bytes, nothing parsed or checked: the state is the file's, bit for bit,
    from a live state moved away from it (every parameter and moment), and tied weights stay tied."""
    from sentinel.contract.fsio import map_file

    a, c, files = planned
    sa, sc = a.checkpoints.state.states[name], c.checkpoints.state.states[name]
    _restore(sc, files[name])  # a plan again if a trainer built since (registering parameters) dropped it
    _perturb(c)
    assert not _same(sa.state_dict(), sc.state_dict())
    got = sc.planned(map_file(files[name]))
    copies = got[0] if name == "model" else [dst for dst, _ in got.copies]
    assert got is not None and all(t.dtype == torch.uint8 for t in copies), "the plan was not taken"
    sc.load_state_dict(got)
    assert _same(sa.state_dict(), sc.state_dict()), name
    if name == "model":
        assert c.raw_model.lm_head.weight is c.raw_model.wte.weight


def _swap_data(c):
    p = c.raw_model.wte.weight
    p.data = torch.zeros_like(p)


def _new_parameter(c):
    c.raw_model.ln_f.weight = torch.nn.Parameter(torch.zeros_like(c.raw_model.ln_f.weight))


def _moment_cloned(c):
    st = next(iter(c.opt.state.values()))
    st["exp_avg"] = st["exp_avg"].clone()


def _load_hook(c):
    c.opt.register_load_state_dict_pre_hook(lambda opt, sd: None)


@pytest.mark.parametrize("name, change", [("model", _swap_data), ("model", _new_parameter),
                                          ("optimizer", _moment_cloned), ("optimizer", _load_hook)],
                         ids=["parameter-data-swapped", "parameter-registered", "moment-replaced", "load-hook"])
def test_a_plan_whose_live_tensors_changed_is_dropped_and_the_file_loads_the_plain_way(planned, trainers, dataset, tmp_path, name, change):
    """A live tensor that moved or was replaced, a parameter registered anywhere, a moment that is no
    longer a view of the flat state, or a load hook: the plan would copy into the wrong bytes or skip
    the hook, so ``planned`` refuses it; the plain path then loads the file exactly, into the live
    tensors as they are now."""
    a, _, files = planned
    c = _trainer(dataset, tmp_path / "c")  # its own: the change stays in it
    piece = c.checkpoints.state.states[name]
    for _ in range(2):
        _restore(piece, files[name])
    assert piece._plan is not None
    change(c)
    _perturb(c)
    from sentinel.contract.fsio import map_file

    assert piece.planned(map_file(files[name])) is None and piece._plan is None
    _restore(piece, files[name])
    assert _same(a.checkpoints.state.states[name].state_dict(), piece.state_dict()), name


def _header_byte(raw: bytearray) -> None:  # the JSON still parses: one tensor's name differs by a letter
    at = raw.index(b'"wte.weight"')
    raw[at + 1:at + 4] = b"wtf"


def _longer(raw: bytearray) -> None:
    raw.extend(b"\0" * 8)


@pytest.mark.parametrize("edit", [_header_byte, _longer], ids=["header-differs", "file-longer"])
def test_a_file_whose_header_or_size_differs_from_the_plans_is_read_and_checked(planned, tmp_path, edit):
    """The plan stands for its header's bytes and its file's size alone: a file that differs in either
    takes the plain path, whose check refuses it in one line, the live model untouched."""
    from sentinel.contract.fsio import map_file
    from trainer.checkpointing import TrainerCheckpoints

    _, c, files = planned
    piece = c.checkpoints.state.states["model"]
    _restore(piece, files["model"])  # a plan again: a trainer built since registered parameters, which drops it
    raw = bytearray(files["model"].read_bytes())
    edit(raw)
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(bytes(raw))
    before = copy.deepcopy(piece.state_dict())
    assert piece._plan[0].sources(map_file(bad)) is None
    with pytest.raises(CheckpointError) as e:
        TrainerCheckpoints._prepare(piece, bad, map_file(bad))
    assert "\n" not in str(e.value) and "model.safetensors" in str(e.value)
    assert _same(before, piece.state_dict())
