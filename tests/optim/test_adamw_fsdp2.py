"""clipshard.optim.AdamW on FSDP2 (fully_shard) models, 2 and 3 gloo ranks on CPU, against the same
model unsharded in one process with the same gradients (set exactly from fixed full tensors, so no
reduction order differs):
- fp32: the trajectory of torch.optim.AdamW;
- bf16 / fp16 weights and states with stochastic rounding: bitwise the unsharded clipshard AdamW;
  bytes per parameter per rank 6;
- mixed groups (a plain parameter, a Replicate() DTensor, FSDP2 shards) and uneven shards (a first
  dimension no world size divides, a 1-element parameter: empty shards);
- a Partial DTensor raises naming the parameter before anything is updated;
- optimizer.state_dict() of an unsharded run, and of a sharded one, loads into a sharded optimizer;
- a DCP checkpoint saved on 2 ranks, loaded on 1 and on 3: the continuation is bitwise the
  uninterrupted run.
Each world size starts once and runs several cases (process start-up dominates on 2 cores)."""
import io

import pytest
import torch
import torch.distributed as dist
from torch import nn

import clipshard  # noqa: F401
from clipshard.optim import AdamW, second_moment_key, to_half_precision_
from tests.dist_utils import run_group

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without torch.distributed")

SHAPES = {"a": (7, 5), "b": (1,), "c": (4, 3), "d": (10,)}  # 7 and 10: uneven on 2 and 3 ranks
HYPER = dict(lr=3e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1)
CONFIGS = [  # (param dtype, state dtype)
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16), (torch.float32, torch.bfloat16)]
STEPS, SAVE_AT = 4, 2


class Leaves(nn.Module):
    """Parameters of the SHAPES, initialised from a fixed generator (the same on every rank)."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            setattr(self, name, nn.Parameter(torch.randn(shape, generator=gen)))


def _grads(step, dtype):
    """The full gradient of every parameter at `step`: fixed, realistic magnitudes, never zero."""
    gen = torch.Generator().manual_seed(100 + step)
    return {name: (torch.randn(shape, generator=gen) * 1e-2).to(dtype) for name, shape in SHAPES.items()}


def _grad_like(p, full):
    """This rank's part of the full gradient `full`, laid out as parameter p (FSDP2's layout)."""
    from torch.distributed.tensor import DTensor

    from clipshard.optim.dtensor import index_base
    if not isinstance(p, DTensor):
        return full.clone()
    local = p.to_local()
    base = index_base(p)
    shard = full.reshape(-1)[base:base + local.numel()].view(local.shape).clone()
    return DTensor.from_local(shard, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())


def _set_grads(model, step, dtype):
    for name, full in _grads(step, dtype).items():
        p = getattr(model, name)
        p.grad = _grad_like(p, full)


def _model(param_dtype):
    model = Leaves()
    if param_dtype != torch.float32:
        # before fully_shard: the conversion sees whole tensors, and FSDP2 then shards 16-bit storage
        to_half_precision_(model, param_dtype, generator=torch.Generator().manual_seed(1))
    return model


def _optimizer(model, state_dtype):
    return AdamW(model.parameters(), **HYPER, state_dtype=state_dtype,
                 generator=torch.Generator().manual_seed(2))


def _full(t):
    from clipshard.optim.dtensor import is_dtensor
    return (t.full_tensor() if is_dtensor(t) else t).detach().clone()


def _snapshot(model, opt):
    """Every parameter and moment as a full tensor (a collective for DTensors)."""
    out = {}
    for name, p in model.named_parameters():
        state = opt.state[p]
        out[name] = _full(p)
        out[name + ".exp_avg"] = _full(state["exp_avg"])
        key = second_moment_key(state["exp_avg"].dtype)
        out[name + "." + key] = _full(state[key])
    return out


def _train(model, opt, dtype, steps):
    for step in steps:
        _set_grads(model, step, dtype)
        opt.step()


def _sharded(world_size, param_dtype, state_dtype):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    model = _model(param_dtype)
    fully_shard(model, mesh=init_device_mesh("cpu", (world_size,)))
    return model, _optimizer(model, state_dtype)


def unsharded_runs():
    """The reference, in this process: for each config, the snapshot after STEPS steps."""
    out = {}
    for param_dtype, state_dtype in CONFIGS:
        model = _model(param_dtype)
        opt = _optimizer(model, state_dtype)
        _train(model, opt, param_dtype, range(STEPS))
        out[(param_dtype, state_dtype)] = _snapshot(model, opt)
    return out


def _fp32_against_torch(world_size):
    """fp32 FSDP2 shards against torch.optim.AdamW on the unsharded model; the worst relative error."""
    model, opt = _sharded(world_size, torch.float32, None)
    ref_model = Leaves()
    ref = torch.optim.AdamW(ref_model.parameters(), **HYPER, foreach=False)
    for step in range(STEPS):
        _set_grads(model, step, torch.float32)
        _set_grads(ref_model, step, torch.float32)
        opt.step()
        ref.step()
    worst = 0.0
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(_full(p), q.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(_full(opt.state[p]["exp_avg_sq"]), ref.state[q]["exp_avg_sq"], rtol=1e-6,
                                   atol=1e-12)
        worst = max(worst, ((_full(p) - q.detach()).abs() / q.detach().abs().clamp_min(1e-30)).max().item())
    return worst


def _bytes_per_parameter(model, opt):
    """This rank's bytes of parameters and moments per parameter element it holds."""
    from clipshard.optim.dtensor import local
    numel = held = 0
    for p in model.parameters():
        state = opt.state[p]
        tensors = [p, state["exp_avg"], state[second_moment_key(state["exp_avg"].dtype)]]
        held += sum(local(t).numel() * local(t).element_size() for t in tensors)
        numel += local(p).numel()
    return held / numel


def _mixed_groups(rank, world_size):
    """A plain parameter, a Replicate() DTensor and FSDP2 shards in two groups, bf16 with SR: every
    element ends bitwise as in the same optimizer over plain copies of the full parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))

    def build(shard):
        gen = torch.Generator().manual_seed(5)
        plain = nn.Parameter(torch.randn(6, 3, generator=gen).to(torch.bfloat16))
        replicated = nn.Parameter(torch.randn(5, generator=gen).to(torch.bfloat16))
        model = nn.Linear(11, 7, dtype=torch.bfloat16)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        if shard:
            replicated = nn.Parameter(distribute_tensor(replicated.detach(), mesh, [Replicate()]))
            fully_shard(model, mesh=mesh)
        params = [plain, replicated, *model.parameters()]
        opt = AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-2}], lr=3e-2,
                    generator=torch.Generator().manual_seed(6))
        return params, opt

    sharded, opt = build(True)
    plain, ref = build(False)
    for step in range(3):
        gen = torch.Generator().manual_seed(50 + step)
        for p, q in zip(sharded, plain):
            q.grad = (torch.randn(q.shape, generator=gen) * 1e-2).to(q.dtype)
            p.grad = _grad_like(p, q.grad)
        opt.step()
        ref.step()
    for p, q in zip(sharded, plain):
        assert torch.equal(_full(p).view(torch.int16), q.detach().view(torch.int16))
        assert torch.equal(_full(opt.state[p]["exp_avg"]).view(torch.int16), ref.state[q]["exp_avg"].view(torch.int16))


def _partial_raises(world_size):
    """A Partial() DTensor after a plain parameter: step raises naming it, nothing is updated."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world_size,))
    good = nn.Parameter(torch.ones(4))
    bad = nn.Parameter(DTensor.from_local(torch.ones(3), mesh, [Partial()]))
    good.grad = torch.full((4,), 0.5)
    bad.grad = DTensor.from_local(torch.full((3,), 0.5), mesh, [Partial()])
    opt = AdamW([("good", good), ("head.bad", bad)], lr=0.1)
    with pytest.raises(ValueError, match=r"parameter 'head.bad' .*Partial"):
        opt.step()
    assert torch.equal(good.detach(), torch.ones(4)) and len(opt.state) == 0


def _save_and_continue(world_size, tmp, param_dtype, state_dtype):
    """STEPS steps with a DCP checkpoint (model, optimizer, generator) after SAVE_AT; the snapshot."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _sharded(world_size, param_dtype, state_dtype)
    _train(model, opt, param_dtype, range(SAVE_AT))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp)
    if dist.get_rank() == 0:
        torch.save(opt.generator.get_state(), f"{tmp}/generator.pt")
    dist.barrier()
    _train(model, opt, param_dtype, range(SAVE_AT, STEPS))
    return _snapshot(model, opt)


def _load_and_continue(world_size, tmp, param_dtype, state_dtype):
    """A fresh FSDP2 model on this world size, loaded from the checkpoint; the continuation's snapshot."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = _sharded(world_size, param_dtype, state_dtype)
    with torch.no_grad():  # the loaded weights must replace these, not coincide with them
        for p in model.parameters():
            p.mul_(0.5)
    model_sd, optim_sd = get_state_dict(model, opt)  # (initialises the state with an lr=0 step)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=tmp)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    opt.generator.set_state(torch.load(f"{tmp}/generator.pt"))  # after the initialising step's draws
    _train(model, opt, param_dtype, range(SAVE_AT, STEPS))
    return _snapshot(model, opt)


def _plain_state_dicts_load(world_size):
    """optimizer.state_dict() of an unsharded run loads into a sharded optimizer (each rank keeps its
    slice), and a sharded optimizer's own state_dict() (DTensors) loads into a fresh one: the full
    moments are bitwise the saved ones."""
    dtype = torch.bfloat16
    plain = _model(dtype)
    plain_opt = _optimizer(plain, dtype)
    _train(plain, plain_opt, dtype, range(SAVE_AT))
    model, opt = _sharded(world_size, dtype, dtype)
    opt.load_state_dict(plain_opt.state_dict())
    again, again_opt = _sharded(world_size, dtype, dtype)
    again_opt.load_state_dict(opt.state_dict())
    for loaded, loaded_model in ((opt, model), (again_opt, again)):
        for p, q in zip(loaded_model.parameters(), plain.parameters()):
            for key in ("exp_avg", "exp_avg_sq"):
                assert isinstance(loaded.state[p][key], type(p)), key  # a DTensor like the parameter
                assert torch.equal(_full(loaded.state[p][key]).view(torch.int16),
                                   plain_opt.state[q][key].view(torch.int16)), key
            assert loaded.state[p]["step"].item() == SAVE_AT


def _as_bytes(result):
    """Tensors go back to the parent serialised (a queue would pass shared-memory handles that die
    with the rank's process)."""
    buffer = io.BytesIO()
    torch.save(result, buffer)
    return buffer.getvalue()


def _run(fn, world_size, *args):
    return [torch.load(io.BytesIO(b)) for b in run_group(fn, world_size, *args, timeout=240)]


def _on_ranks(rank, world_size, tmp_root, save):
    from torch.distributed.tensor import DTensor
    result = {"fp32_worst": _fp32_against_torch(world_size)}
    for param_dtype, state_dtype in CONFIGS:
        model, opt = _sharded(world_size, param_dtype, state_dtype)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        _train(model, opt, param_dtype, range(STEPS))
        result[(param_dtype, state_dtype)] = _snapshot(model, opt)
        if param_dtype != torch.float32:
            result["bytes", param_dtype] = _bytes_per_parameter(model, opt)
    _mixed_groups(rank, world_size)
    _partial_raises(world_size)
    _plain_state_dicts_load(world_size)
    for param_dtype, state_dtype in CONFIGS[:2]:
        tmp = f"{tmp_root}/{param_dtype}"
        run = _save_and_continue if save else _load_and_continue
        result["checkpoint", param_dtype] = run(world_size, tmp, param_dtype, state_dtype)
    return _as_bytes(result)


def _load_only(rank, world_size, tmp_root):
    return _as_bytes({("checkpoint", p): _load_and_continue(world_size, f"{tmp_root}/{p}", p, s)
                      for p, s in CONFIGS[:2]})


def _assert_same_bits(got, want, what):
    assert got.keys() == want.keys(), what
    for key in want:
        bits = torch.int32 if want[key].dtype == torch.float32 else torch.int16
        assert got[key].dtype == want[key].dtype, (what, key)
        assert torch.equal(got[key].view(bits), want[key].view(bits)), (what, key)


def test_fsdp2_on_2_then_1_and_3_ranks_bitwise_equals_unsharded(tmp_path):
    want = unsharded_runs()
    saved = _run(_on_ranks, 2, str(tmp_path), True)
    resumed = _run(_on_ranks, 3, str(tmp_path), False)
    resumed_on_one = _run(_load_only, 1, str(tmp_path))
    for world_size, results in ((2, saved), (3, resumed)):
        for rank, result in enumerate(results):
            print(f"  {world_size} ranks, rank {rank}: fp32 max relative difference to torch.optim.AdamW "
                  f"{result['fp32_worst']:.3g}")
            for config in CONFIGS:
                _assert_same_bits(result[config], want[config], (world_size, rank, config))
            for dtype in (torch.bfloat16, torch.float16):
                assert result["bytes", dtype] == 6.0, (world_size, rank, result["bytes", dtype])
    # the checkpoint: the uninterrupted 2-rank run equals the unsharded run, and so do the
    # continuations on 3 ranks and on 1 rank
    for param_dtype, state_dtype in CONFIGS[:2]:
        for results in (saved, resumed, resumed_on_one):
            for rank, result in enumerate(results):
                _assert_same_bits(result["checkpoint", param_dtype], want[(param_dtype, state_dtype)],
                                  ("checkpoint", len(results), rank, param_dtype))
