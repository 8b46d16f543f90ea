"""torch.compile of domain-parallel models (issue 40): what compiles gives eager's result, what cannot compile
fails with one named error, and what ranks declare alone is checked before a compiled step.

Each model is compiled with ``domainflow.compile(..., backend="aot_eager")`` (Dynamo and AOTAutograd, the graphs
run by the eager kernels: no Inductor C++ build in the test suite) on ShardTensor inputs and compared with the
same model run unsharded in eager mode: the forward and every parameter gradient (float64, 1e-9). Halo row
fetches, all-reduces and ring shifts are traced as functional collectives (``domainflow.comm.traced``); inputs
of two different per-rank layouts are both run (the layout is in the guard: a new one recompiles), and a
counting backend checks one graph per layout (a graph break would add one). A raw ``torch.compile`` is refused
by name; a parameter differing across ranks and a wrong per-rank layout raise their named errors on every rank
before the compiled step."""

from __future__ import annotations

import dataclasses
import functools
import typing

import pytest
import torch

import domainflow as df
from dist_pool import RankFailure, WorkerPool, rank_and_world
from domainflow.errors import CollectiveError, CompileUnsupportedError, ReplicaMismatchError, ShardingShapeError
from sharded_check import get_mesh

D = torch.float64
TOL = 1e-9


def _check(make_model, make_input, shard_dim, layouts, graphs=1, count=True, backend="aot_eager"):
    """Compile ``make_model()`` with ``domainflow.compile`` at this rank count; for each per-rank layout in
    ``layouts`` compare the compiled forward and parameter gradients with an unsharded eager run; then the
    count of Dynamo graphs: ``graphs`` per layout (each layout recompiles; a graph break would add one). The
    input's gradient is compared too: rows sent to another rank get theirs back only if that backward exchange
    runs on every rank."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    torch._dynamo.reset()
    model, ref = make_model(), make_model()
    compiled = df.compile(model, backend=backend)
    for i, sizes in enumerate(layouts):
        full = make_input(sum(sizes), i)
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        grad_in = full.is_floating_point()  # the input's gradient too: what a layer before this one would get
        full_in = full.clone().requires_grad_(grad_in)
        want = ref(full_in)
        (want ** 2).sum().backward()
        x = df.distribute_tensor(full, mesh, [df.Shard(shard_dim)], sharding_shapes={0: list(sizes)})
        x = x.detach().requires_grad_(grad_in)
        y = compiled(x)
        assert isinstance(y, df.ShardTensor)
        (y ** 2).sum().backward()
        assert torch.allclose(y.full_tensor(), want, atol=TOL, rtol=0), f"forward differs, layout {sizes}"
        if grad_in:
            assert torch.allclose(x.grad.full_tensor(), full_in.grad, atol=TOL, rtol=0), f"input gradient, {sizes}"
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert p.grad is not None, f"{name}: no gradient"
            assert type(p.grad) is torch.Tensor, f"{name}: gradient is a {type(p.grad).__name__}"
            assert torch.allclose(p.grad, q.grad, atol=TOL, rtol=0), f"{name}: gradient differs, layout {sizes}"
        for (name, b), c in zip(model.named_buffers(), ref.buffers()):  # (BatchNorm's running statistics)
            assert type(b) is torch.Tensor and torch.allclose(b, c, atol=TOL, rtol=0), f"{name} differs, {sizes}"
    if count:
        assert compiled.frames == graphs * len(layouts), (compiled.frames, len(layouts))
    return True


# -- models ---------------------------------------------------------------------------------------------------
def _conv_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.SiLU(),
                               torch.nn.Conv2d(4, 4, 3, padding=1)).to(D)


def _image(rows, i):
    return torch.randn(1, 3, rows, 6, dtype=D, generator=torch.Generator().manual_seed(10 + i))


def _conv(layouts):
    return _check(_conv_model, _image, 2, layouts)


@pytest.mark.parametrize("world,layouts", [(2, [(5, 4), (3, 7)]), (3, [(3, 4, 2)])])
def test_conv_net(dist, world, layouts):
    """Two Conv2d layers sharded along H: halo fetches forward, their gradients back, weight sums (3 ranks: a
    middle rank with two neighbours; one layout, graphs counted at 2 ranks)."""
    assert all(dist.run(world, _conv, layouts))


def _tel_model():
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).to(D)


def _sequence(rows, i):
    return torch.randn(1, rows, 8, dtype=D, generator=torch.Generator().manual_seed(20 + i))


def _tel():
    return _check(_tel_model, _sequence, 1, [(5, 6), (8, 2)])


def test_transformer_encoder_layer(dist):
    """nn.TransformerEncoderLayer with the sequence sharded: ring attention's shifts in the graph."""
    assert all(dist.run(2, _tel))


def _transolver_model():
    from domainflow.train.models import Transolver

    torch.manual_seed(0)
    return Transolver(3, 2, dim=8, layers=1, heads=2, slices=4).to(D)


def _points(rows, i):
    return torch.randn(1, rows, 3, dtype=D, generator=torch.Generator().manual_seed(30 + i))


def _transolver():
    return _check(_transolver_model, _points, 1, [(9, 6), (4, 12)])


def test_transolver(dist):
    """Transolver's physics attention: its slice sums are all-reduces in the graph."""
    assert all(dist.run(2, _transolver))


class _Scaled(torch.nn.Module):
    """Plain (replicated) parameters met by a sharded tensor in pointwise ops: their gradients are sums over
    the sharded rows, which the reduce-to-plain gradient hook of the eager engine completes (traced into the
    backward graph as an all-reduce)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(1, 3, 1, 1, dtype=D))
        self.v = torch.nn.Parameter(torch.randn(6, dtype=D))

    def forward(self, x):
        return torch.sin(x * self.w) + x * self.v


def _scaled_model():
    torch.manual_seed(0)
    return _Scaled()


def _scaled():
    return _check(_scaled_model, _image, 2, [(5, 4), (2, 6)])


def test_plain_parameter_gradients(dist):
    assert all(dist.run(2, _scaled))


# -- ranks whose local sizes differ trace the same graph (the rules decide on the global layout) ---------------
class _SelfAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attn(x, x, x, need_weights=False)[0]


def _mha_model():
    torch.manual_seed(0)
    return _SelfAttention().to(D)


def _bn_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.BatchNorm2d(3), torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4),
                               torch.nn.SiLU()).to(D)


_EMPTY_SHARD = {2: [(0, 9), (5, 4)], 3: [(4, 0, 5), (0, 9, 2)]}
_SECOND_LAYOUT = {2: [(5, 4), (5, 6), (3, 7)], 3: [(3, 4, 2), (3, 5, 2), (5, 1, 4)]}


def _rank_local(model, backend):
    world = rank_and_world()[1]
    if model == "mha":
        return _check(_mha_model, _sequence, 1, _EMPTY_SHARD[world], backend=backend)
    make = _bn_model if model == "bn" else _conv_model
    return _check(make, _image, 2, _SECOND_LAYOUT[world], backend=backend)


# Inductor builds C++ for each graph (15-50 s a case with a cold cache): in `make test` the Inductor path is the
# pending-sum case's (test_compiled_ops_along_the_sharded_dim); these with -m slow (make test TEST_MARKERS=)
_SLOW = pytest.mark.slow


@pytest.mark.parametrize("model,world,backend", [
    *[(m, w, "aot_eager") for m in ("mha", "bn", "conv") for w in (2, 3)],
    *[pytest.param(m, w, "inductor", marks=_SLOW) for m in ("mha", "bn", "conv") for w in (2, 3)]])
def test_rank_local_sizes_trace_one_graph(dist, model, world, backend):
    """nn.MultiheadAttention with one rank's shard of the sequence empty, and BatchNorm2d / Conv2d nets at a
    first and then a second uneven layout: every rank traces the same graph (compiled: the graph check passes;
    before, the ranks' graphs differed and hung or failed on one rank), and the result is eager's."""
    assert all(dist.run(world, _rank_local, model, backend, timeout=400))


# -- ops along the sharded dim that run eagerly in a compiled model (a graph break), or a pending-sum output --
class _AlongSharded(torch.nn.Module):
    """``op`` of the input scaled per channel by a parameter (whose gradient is compared)."""

    def __init__(self, op):
        super().__init__()
        self.op = op
        self.w = torch.nn.Parameter(torch.randn(1, 3, 1, 1, dtype=D))

    def forward(self, x):
        import torch.nn.functional as F

        x = x * self.w
        if self.op == "partial":  # a sum along the sharded dim: a pending sum (Partial) returned
            return x.sum(dim=2)
        if self.op in ("reflect", "circular"):
            return F.pad(x, (1, 1, 2, 2), mode=self.op)
        if self.op == "avgpool":
            return F.avg_pool2d(x, 2)
        if self.op == "valid conv":  # no padding: each output row needs the next input row, fetched one way only
            return F.conv2d(x, self.w.reshape(3, 1, 1, 1).expand(3, 1, 2, 1), groups=3)
        if self.op == "two pools":  # the same rows fetched twice
            return F.max_pool2d(x, 2) + F.avg_pool2d(x, 2)
        if self.op == "interpolate":  # not a power-of-two factor: the general path (taps on the fetched rows)
            return F.interpolate(x, scale_factor=1.5, mode="bilinear") * 2
        return F.max_pool2d(x, 2) * 2  # an op after it: a graph break at the pool would make a second graph


def _along_sharded(op, backend):
    def make():
        torch.manual_seed(0)
        return _AlongSharded(op)

    # one graph per layout: every op here compiles whole (partial's backward coercion is no graph)
    return _check(make, _image, 2, [(5, 4), (3, 6)], count=op != "partial", backend=backend)


@pytest.mark.parametrize("op,backend", [("partial", "aot_eager"), ("partial", "inductor"), ("reflect", "aot_eager"),
                                        ("circular", "aot_eager"), ("maxpool", "aot_eager"), ("avgpool", "aot_eager"),
                                        ("valid conv", "aot_eager"), ("interpolate", "aot_eager")])
def test_compiled_ops_along_the_sharded_dim(dist, op, backend):
    """A compiled output that is a pending sum, then backward (its gradient arrives replicated and is coerced to
    the layout the compiled backward was traced with; before: AOTAutograd's 'guessed its metadata incorrectly'),
    F.pad reflect and circular (the wrap-around rows are a halo row fetch, in the graph), and pooling and a conv
    without padding, whose rows travel one way only at these layouts: eager's forward and the parameter's and the
    input's gradients, in one graph per layout. Before: the input's rows sent to the other rank got no gradient
    back (the sending rank never joined the backward exchange, which met its next collective instead), and
    F.max_pool2d broke the graph (its padding check read a tensor's value); F.interpolate by 1.5 failed the trace
    (its taps, cached as tensors made under Dynamo's fake mode, met AOTAutograd's: "Mixing fake modes")."""
    assert all(dist.run(2, _along_sharded, op, backend, timeout=300))


class _OneConv(torch.nn.Module):
    """One convolution: with stride 2 (kernel 3, padding 1), a rank holding only rows between output centres has
    no output row; kernel 1, stride 2, padding 1: output row o reads input row 2 o - 1, so row 0 is read by no
    window (its gradient is zero)."""

    def __init__(self, kernel, stride, padding):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(3, 2, kernel, stride=stride, padding=padding).to(D)

    def forward(self, x):
        return torch.tanh(self.conv(x))


class _TwoConvs(torch.nn.Module):
    """Two convolutions of one input: two halo fetches of the same rows, ``kernels`` wide (the same size: the same
    rows fetched twice, parameters of one shape)."""

    def __init__(self, kernels=(3, 5)):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Conv2d(3, 2, kernels[0], padding=kernels[0] // 2).to(D)
        self.b = torch.nn.Conv2d(3, 2, kernels[1], padding=kernels[1] // 2).to(D)

    def forward(self, x):
        return self.a(x) + self.b(x)


def _rank_with_nothing_to_trade(case):
    rank, world = rank_and_world()
    if case == "no rows, no gradient":  # the rank holding 1 row has no output row: its windows need no rows
        mesh = get_mesh((world,))
        torch._dynamo.reset()
        full = _image(10, 0)
        x = df.distribute_tensor(full, mesh, [df.Shard(2)], sharding_shapes={0: [9, 1]})
        fn = df.compile(lambda x: torch.nn.functional.avg_pool2d(x, (2, 1)) * 2, backend="aot_eager")
        with torch.no_grad():
            y = fn(x)
        assert torch.allclose(y.full_tensor(), torch.nn.functional.avg_pool2d(full, (2, 1)) * 2, atol=TOL, rtol=0)
        return True
    if case == "two fetches, an empty rank":  # the empty rank's two all-to-alls are identical calls
        return _check(_TwoConvs, _image, 2, [(0, 12)] if world == 2 else [(0, 6, 6), (6, 0, 6)])
    if case == "the same rows twice":  # identical fetches (and parameter gradients) on some ranks only
        layouts = [(5, 7)] if world == 2 else [(0, 6, 6), (6, 6, 0)]

        def pools():
            torch.manual_seed(0)
            return _AlongSharded("two pools")

        return _check(functools.partial(_TwoConvs, (3, 3)), _image, 2, layouts) and _check(pools, _image, 2, layouts)
    if case == "only padding rows":  # rank 0's one row is read by no window (k 1, stride 2, padding 1)
        return _check(functools.partial(_OneConv, 1, 2, 1), _image, 2, [(1, 9)])
    if case == "stride 2, a rank with no output row":  # that rank's exchanges send and receive nothing
        return _check(functools.partial(_OneConv, 3, 2, 1), _image, 2, [(9, 1)] if world == 2 else [(7, 1, 2)],
                      backend="inductor")
    # 2 x 2 mesh, H and W sharded: the ranks of one mesh dim hold blocks of other sizes along the other dim
    mesh = get_mesh((2, 2))
    torch._dynamo.reset()
    full = torch.randn(1, 3, 6, 4, dtype=D, generator=torch.Generator().manual_seed(3))
    x = df.distribute_tensor(full, mesh, [df.Shard(2), df.Shard(3)], sharding_shapes={0: [3, 3], 1: [3, 1]})
    x = x.detach().requires_grad_()
    full_in = full.clone().requires_grad_()
    fn = df.compile(lambda x: torch.nn.functional.max_pool2d(x, 2) * 2, backend="aot_eager")
    y = fn(x)
    (y ** 2).sum().backward()
    want = torch.nn.functional.max_pool2d(full_in, 2) * 2
    (want ** 2).sum().backward()
    assert torch.allclose(y.full_tensor(), want, atol=TOL, rtol=0)
    assert torch.allclose(x.grad.full_tensor(), full_in.grad, atol=TOL, rtol=0)
    assert fn.frames == 1, fn.frames
    return True


@pytest.mark.parametrize("case,world", [("no rows, no gradient", 2), ("only padding rows", 2),
                                        ("two fetches, an empty rank", 2),
                                        ("two fetches, an empty rank", 3), ("the same rows twice", 2),
                                        ("the same rows twice", 3), ("2-D mesh", 4),
                                        pytest.param("stride 2, a rank with no output row", 2, marks=pytest.mark.slow),
                                        pytest.param("stride 2, a rank with no output row", 3, marks=pytest.mark.slow)])
def test_ranks_with_little_to_trade_compile(dist, case, world):
    """Halo fetches where some rank trades nothing or its sizes differ from its group's, found by review: a rank
    with no output row traced without gradient (before: ``torch.cat`` of nothing, a CollectiveError on every
    rank); collectives identical on some ranks only (AOTAutograd's CSE merged them there, so those ranks had
    fewer collectives than their peers: an empty rank's two fetches, the same rows fetched twice by two
    same-size convolutions or by max and average pooling of one input on the ranks that send rows, two
    same-shape layers' zero parameter gradients on an empty rank; every traced exchange and all-reduce is now
    kept apart from CSE); with Inductor, a stride-2 convolution where
    one rank has no output row (Inductor folded that rank's empty exchanges into constants: "the ranks compiled
    different graphs" before; slow: Inductor's C++ builds); a rank whose block holds only padding rows (its
    chunk was left out of the graph: x.grad None on that rank only, where eager gives zeros); max pooling on a
    2 x 2 mesh (the
    graph check compared the shapes of the other mesh dim's exchanges, which differ across the ranks of a
    group). Eager's forward and gradients in one graph."""
    assert all(dist.run(world, _rank_with_nothing_to_trade, case, timeout=300))


_REFUSED = {"cumsum": "cumsum", "flip": "flip", "roll": "roll"}


def _refused_along_sharded(case):
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    torch._dynamo.reset()
    full = _image(9, 0)
    x = df.distribute_tensor(full, mesh, [df.Shard(2)], sharding_shapes={0: [5, 4]})
    fn = {"cumsum": lambda x: torch.cumsum(x * 2, 2), "flip": lambda x: torch.flip(x * 2, [2]),
          "roll": lambda x: torch.roll(x * 2, 1, 2)}[case]
    with pytest.raises(CompileUnsupportedError) as info:
        df.compile(fn, backend="aot_eager")(x)
    assert type(info.value) is CompileUnsupportedError
    # the ranks still agree afterwards, and the op runs eagerly
    assert torch.allclose(fn(x).full_tensor(), fn(full), atol=TOL, rtol=0)
    return str(info.value)


@pytest.mark.parametrize("case", sorted(_REFUSED))
def test_refused_ops_along_the_sharded_dim_are_named(dist, case):
    """cumsum, flip and roll along the sharded dim need exchanges that do not compile: one line
    naming the op and the fix, the same on every rank (not Dynamo's wrapper of it)."""
    said = dist.run(2, _refused_along_sharded, case, timeout=200)
    assert said[0] == said[1], said
    s = said[0]
    assert "\n" not in s, s
    assert s.startswith(f"domainflow cannot trace {_REFUSED[case]} on a sharded tensor ("), s
    assert "under torch.compile" in s and "torch.compiler.disable" in s, s


# -- what does not compile: one named error -------------------------------------------------------------------
def _unrouted():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    g = torch.Generator().manual_seed(3)
    x = df.distribute_tensor(torch.randn(9, 3, dtype=D, generator=g), mesh, [df.Shard(0)], sharding_shapes={0: [4, 5]})
    idx = df.distribute_tensor(torch.tensor([0, 8, 2, 5, 7]), mesh, [df.Shard(0)], sharding_shapes={0: [2, 3]})
    found = []
    for fn, args in [(lambda x, idx: torch.sin(x)[idx], (x, idx)),  # a gather by global row index
                     (lambda x: torch.sin(x).full_tensor(), (x,))]:  # an all-gather
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            df.compile(fn, backend="aot_eager")(*args)
        chain, e = [], info.value
        while e is not None:
            chain.append(e)
            e = e.__cause__ or e.__context__
        named = [c for c in chain if isinstance(c, CompileUnsupportedError)]
        assert named, f"no CompileUnsupportedError in {[type(c).__name__ for c in chain]}: {info.value}"
        assert "torch.compiler.disable" in str(named[0]) and "under torch.compile" in str(named[0])
        assert "domainflow cannot trace" in str(info.value)  # the top-level message quotes it
        found.append(str(named[0]).split(" under ")[0])
    assert "gather by global row index" in found[0] and "all_gather" in found[1], found
    # the same model runs eagerly once compile is out of the way
    torch._dynamo.reset()
    assert torch.equal(torch.sin(x)[idx].full_tensor(), torch.sin(x.full_tensor())[idx.full_tensor()])
    return True


def test_unrouted_exchange_is_named(dist):
    """A gather by global index and a full_tensor() inside the compiled region raise CompileUnsupportedError
    (in the exception chain, quoted in Dynamo's message) instead of running eagerly on fake tensors."""
    assert all(dist.run(2, _unrouted))


def _knn():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    pts = torch.randn(14, 3, dtype=D, generator=torch.Generator().manual_seed(4))
    x = df.distribute_tensor(pts, mesh, [df.Shard(0)], sharding_shapes={0: [5, 9]})
    torch._dynamo.reset()
    got = df.compile(lambda p: df.knn(p, 3), backend="aot_eager")(x)
    want = df.knn(x, 3)
    return all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(got, want))


def test_knn_runs_eagerly(dist):
    """domainflow.knn is torch.compiler.disable'd: a compiled caller gets eager's neighbours (a graph break)."""
    assert all(dist.run(2, _knn))


# -- what domainflow.compile checks, and a raw torch.compile refused -----------------------------------------
def _chain(e):
    out = []
    while e is not None:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _raw_compile_refused():
    """Raw torch.compile of a domain-parallel model fails by name, also when domainflow.compile compiled the
    same model before (a new layout re-traces outside the wrapper; the same layout must not reuse its graph)."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    model = _conv_model()
    torch._dynamo.reset()
    said = []
    for i, sizes in enumerate([(5, 4), (3, 7), (3, 7), (5, 4)]):
        x = df.distribute_tensor(_image(sum(sizes), 0), mesh, [df.Shard(2)], sharding_shapes={0: list(sizes)})
        if i == 1:
            df.compile(model, backend="aot_eager")(x)  # checked: compiles and runs
            continue
        with pytest.raises(Exception) as info:
            torch.compile(model, backend="aot_eager")(x)
        named = [c for c in _chain(info.value) if isinstance(c, CompileUnsupportedError)]
        assert named, f"no CompileUnsupportedError in {[type(c).__name__ for c in _chain(info.value)]}"
        said.append(str(named[0]))
    return said


def test_raw_torch_compile_is_refused(dist):
    """torch.compile on ShardTensors without domainflow.compile raises CompileUnsupportedError on every rank
    (its graphs would run with no cross-rank check of parameters or declared layouts)."""
    for said in dist.run(2, _raw_compile_refused):
        assert len(said) == 3
        for s in said:  # (Dynamo appends the user code's frames to the exception it re-raises)
            assert s.splitlines()[0] == ("compile domain-parallel models with domainflow.compile(model), which "
                                         "checks parameters and layouts across ranks before each call"), s


class _Batch(typing.NamedTuple):
    x: torch.Tensor


@dataclasses.dataclass
class _BatchData:
    x: torch.Tensor


class _Attrs:
    def __init__(self, x):
        self.x = x


class _FromBatch(torch.nn.Module):
    """The conv net on ``batch.x``: the ShardTensor inside a named tuple, a dataclass or a plain object."""

    def __init__(self):
        super().__init__()
        self.net = _conv_model()

    def forward(self, batch):
        return self.net(batch.x)


def _step(model, x):
    return model(x)


def _perturbed_parameter():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    x = df.distribute_tensor(_image(9, 0), mesh, [df.Shard(2)], sharding_shapes={0: [5, 4]})
    torch._dynamo.reset()
    said = []
    # (a parameter is checked once, the first call that meets it: a new model for each way of calling)
    for how in ("module", "closure", "partial", "named tuple", "dataclass", "object"):
        model = _FromBatch() if how in ("named tuple", "dataclass", "object") else _conv_model()
        if rank == 1:
            with torch.no_grad():
                (model.net if isinstance(model, _FromBatch) else model)[2].bias[1] += 1e-6
        arg = x
        if how == "module":
            compiled = df.compile(model, backend="aot_eager")
        elif how == "closure":  # a function closing over a module
            compiled = df.compile(lambda x: model(x), backend="aot_eager")
        elif how == "partial":  # the module bound as an argument
            compiled = df.compile(functools.partial(_step, model), backend="aot_eager")
        else:  # the input inside a batch (before: no mesh found, so nothing checked and a wrong result)
            compiled = df.compile(model, backend="aot_eager")
            arg = {"named tuple": _Batch, "dataclass": _BatchData, "object": _Attrs}[how](x)
        with pytest.raises(ReplicaMismatchError) as info:
            compiled(arg)
        said.append(str(info.value).replace("_FromBatch.net.", "Sequential."))
    # a bare nn.Parameter of no module, closed over, in a list closed over, or passed (before: not checked, and
    # each rank computed with its own value)
    for how in ("closure", "list", "argument"):
        weight = torch.nn.Parameter(torch.ones(4, 3, 1, 1, dtype=torch.float64))
        if rank == 1:
            with torch.no_grad():
                weight[0, 0] += 1e-6
        if how == "closure":
            compiled = df.compile(lambda x: torch.nn.functional.conv2d(x, weight), backend="aot_eager")
            call = (x,)
        elif how == "list":
            held = [weight]
            compiled = df.compile(lambda x: torch.nn.functional.conv2d(x, held[0]), backend="aot_eager")
            call = (x,)
        else:
            compiled = df.compile(torch.nn.functional.conv2d, backend="aot_eager")
            call = (x, weight)
        with pytest.raises(ReplicaMismatchError) as info:
            compiled(*call)
        said.append(str(info.value))
    return said


def _hidden_input():
    """A ShardTensor the wrapper cannot find among the call's arguments (a closure's): refused by name on every
    rank, not compiled unchecked."""
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    torch._dynamo.reset()
    model = _conv_model()
    x = df.distribute_tensor(_image(9, 0), mesh, [df.Shard(2)], sharding_shapes={0: [5, 4]})
    with pytest.raises(CompileUnsupportedError) as info:
        df.compile(lambda: model(x), backend="aot_eager")()
    return str(info.value)


def test_a_shardtensor_the_wrapper_cannot_find_is_refused(dist):
    said = dist.run(2, _hidden_input, timeout=60)
    assert said[0] == said[1] and len(said[0].splitlines()) == 1, said
    assert "pass the ShardTensor inputs as arguments of the compiled call" in said[0], said[0]


class _FailsOnceAfterABreak(torch.nn.Module):
    """The conv net, a graph break, then rank 1 raises on the second call only (its own code)."""

    def __init__(self):
        super().__init__()
        self.net, self.calls = _conv_model(), 0

    def forward(self, x):
        y = self.net[0](x)
        torch._dynamo.graph_break()
        self.calls += 1
        if self.calls == 2 and rank_and_world()[0] == 1:
            raise ValueError("boom on rank 1")
        return self.net[2](self.net[1](y))


def _recovers_after_a_failure():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    torch._dynamo.reset()
    model, ref = _FailsOnceAfterABreak(), _conv_model()
    compiled = df.compile(model, backend="aot_eager")
    x = df.distribute_tensor(_image(9, 0), mesh, [df.Shard(2)], sharding_shapes={0: [5, 4]})
    said = []
    for _ in range(3):
        try:
            y = compiled(x)
            said.append(bool(torch.allclose(y.full_tensor(), ref(_image(9, 0)), atol=TOL, rtol=0)))
        except CollectiveError as e:
            said.append(str(e).split(":", 1)[1].splitlines()[0])
    return said


def test_the_ranks_trace_afresh_after_a_failure_on_one_rank(dist):
    """Rank 1 fails once after a graph break: Dynamo there then ran that code eagerly for good while rank 0 kept
    its graph, so every later call waited in a graph check on one rank and an eager halo exchange on the other
    until the timeout. Now every rank forgets its compiled code after a failure, and the next call is exact."""
    said = dist.run(2, _recovers_after_a_failure, timeout=120)
    assert said[0] == said[1], said
    assert said[0][0] is True and said[0][2] is True, said
    assert said[0][1].startswith(" rank 1 failed in a call compiled by domainflow.compile: ValueError: boom on rank 1"), said


def test_parameter_differing_across_ranks_is_named(dist):
    """domainflow.compile checks the module's replicated parameters across ranks before the call (under
    torch.compile the engine sees fake ones only): the replica error on every rank, no compiled step."""
    said = dist.run(2, _perturbed_parameter, timeout=60)
    assert said[0] == said[1] and len(said[0]) == 9
    for s in said[0][:6]:
        assert "'Sequential.2.bias'" in s and "rank(s) [1]" in s, s
    for s in said[0][6:]:  # bare parameters, each a module's of none
        assert "a parameter (shape (4, 3, 1, 1), torch.float64): rank(s) [1]" in s, s


class _FieldAndLoss(torch.nn.Module):
    """Three outputs needing gradients, returned as a dict: the field, a scalar of it and a plain scalar of a
    parameter (a regulariser)."""

    def __init__(self):
        super().__init__()
        self.net = _conv_model()

    def forward(self, x):
        y = self.net(x)
        return {"field": y, "energy": (y ** 2).mean(), "penalty": (self.net[0].weight ** 2).sum()}


@dataclasses.dataclass
class _Outputs:
    field: torch.Tensor
    energy: torch.Tensor
    penalty: torch.Tensor


class _FieldAndLossData(_FieldAndLoss):
    """The same outputs as a dataclass."""

    def forward(self, x):
        return _Outputs(**super().forward(x))


_LOSSES = {"energy": lambda o: o["energy"], "field": lambda o: o["field"].sum(),
           "both": lambda o: o["energy"] + o["field"].sum(), "penalty": lambda o: o["penalty"]}


def _outputs_left_out_of_the_loss():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    torch._dynamo.reset()
    full = _image(9, 0)
    said = []
    for kind in ("dict", "dataclass"):
        for loss_of, loss in _LOSSES.items():
            model = _FieldAndLoss() if kind == "dict" else _FieldAndLossData()
            compiled = df.compile(model, backend="aot_eager")
            x = df.distribute_tensor(full, mesh, [df.Shard(2)], sharding_shapes={0: [5, 4]}).requires_grad_()
            out = compiled(x)
            loss(out if kind == "dict" else vars(out)).backward()
            ref, xr = _FieldAndLoss(), full.clone().requires_grad_()
            loss(ref(xr)).backward()
            grads = [[t.grad if t.grad is not None else torch.zeros_like(t) for t in m.parameters()]
                     for m in (model, ref)]  # (the loss of the regulariser alone leaves some None here or there)
            same = all(torch.allclose(a, b, atol=TOL, rtol=0) for a, b in zip(*grads))
            xg = x.grad.full_tensor() if x.grad is not None else torch.zeros_like(xr)
            xrg = xr.grad if xr.grad is not None else torch.zeros_like(xr)
            said.append((kind, loss_of, same and torch.allclose(xg, xrg, atol=TOL, rtol=0)))
    # the outputs can still be changed in place, as the compiled call's own could (before the fix too)
    out = df.compile(_FieldAndLoss(), backend="aot_eager")(df.distribute_tensor(full, mesh, [df.Shard(2)]))
    out["field"].mul_(2)
    return said


def test_an_output_left_out_of_the_loss_gets_a_zero_gradient(dist):
    """A compiled model returning a field, a scalar of it and a plain regulariser, the loss taking some of them:
    autograd handed the compiled backward a plain zero tensor for a ShardTensor left out, and torch failed with
    *we guessed its metadata incorrectly ... Expected a ShardTensor tangent but got a plain Tensor* (pytorch
    issue 172556). Now such an output gets zeros in its own layout (also when the loss takes only the plain
    output, and for outputs in a dataclass): parameter and input gradients as the unsharded model's."""
    said = dist.run(2, _outputs_left_out_of_the_loss, timeout=120)
    assert said[0] == said[1] == [(k, loss, True) for k in ("dict", "dataclass") for loss in _LOSSES], said


class _ReadsAValue(torch.nn.Module):
    """A forward that reads a value of its field with ``float`` (a graph break), as a progress print might."""

    def __init__(self, detach):
        super().__init__()
        self.net, self.detach = _conv_model(), detach

    def forward(self, x):
        y = self.net(x)
        level = float((y.detach() if self.detach else y).mean())
        return y * (1.0 + 0.0 * level)


def _value_used_past_a_graph_break():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    said = []
    for detach in (False, True):
        torch._dynamo.reset()
        model = _ReadsAValue(detach)
        x = df.distribute_tensor(_image(9, 0), mesh, [df.Shard(2)], sharding_shapes={0: [5, 4]})
        try:
            (df.compile(model, backend="aot_eager")(x) ** 2).mean().backward()
        except CompileUnsupportedError as e:
            said.append(str(e))
            continue
        ref = _ReadsAValue(detach)
        (ref(_image(9, 0)) ** 2).mean().backward()
        said.append(all(torch.allclose(p.grad, q.grad, atol=TOL, rtol=0)
                        for p, q in zip(model.parameters(), ref.parameters())))
    return said


def test_a_value_used_past_a_graph_break_without_its_gradient_is_named(dist):
    """``float(y.mean())`` in a compiled forward: the first graph hands ``y.mean()`` on with no gradient, and the
    backward failed with torch's *we guessed its metadata incorrectly ... Expected a ShardTensor tangent but got
    a plain Tensor* (pytorch issue 172556). Now one line says what and the fix; with the fix (``.detach()``) the
    gradients are the unsharded model's."""
    said = dist.run(2, _value_used_past_a_graph_break, timeout=120)
    assert said[0] == said[1], said
    assert said[0][0].startswith("a compiled model passed a value that needs a gradient across a graph break"), said
    assert ".detach() it where it is used" in said[0][0] and "\n" not in said[0][0], said
    assert said[0][1] is True, said


def _wrong_declared_layout():
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    model = _conv_model()
    full = _image(9, 0)
    local = full[:, :, :5] if rank == 0 else full[:, :, 5:]
    sizes = [5, 4] if rank == 0 else [3, 4]  # rank 1 is wrong about rank 0's rows
    x = df.ShardTensor.from_local(local, mesh, [df.Shard(2)], sharding_shapes={0: sizes})
    torch._dynamo.reset()
    with pytest.raises(ShardingShapeError) as info:
        df.compile(model, backend="aot_eager")(x)
    return str(info.value)


def test_wrong_declared_layout_is_named(dist):
    """A layout declared per rank (from_local with a sharding_shapes mapping) wrong on one rank: the layout
    error on every rank, before the compiled step's all-to-alls run with mismatched sizes."""
    said = dist.run(2, _wrong_declared_layout, timeout=40)
    assert said[0] == said[1]
    assert "ShardTensor.from_local" in said[0] and "[5, 4]" in said[0] and "[3, 4]" in said[0], said[0]


# -- every rank's compiled graph runs the same collectives, or every rank raises ------------------------------
def _one_round_per_graph():
    """Per compiled step, one graph check for the forward graph and one for the backward; the forward call
    (after the first: no pending layout or parameter check) runs exactly one small all-gather, the round."""
    from domainflow import comm
    from domainflow.comm import collectives

    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    torch._dynamo.reset()
    compiled = df.compile(_conv_model(), backend="aot_eager")
    x = df.distribute_tensor(_image(9, 0), mesh, [df.Shard(2)], sharding_shapes={0: [3, 3, 3][:world] if world == 3
                                                                                 else [5, 4]})
    gathers, real = [], collectives._all_gather_single

    def counting(out, inp, group=None):
        gathers.append(out.numel())
        return real(out, inp, group=group)

    seen = []
    for step in range(3):
        comm.stats.reset()
        collectives._all_gather_single = counting
        try:
            y = compiled(x)
        finally:
            collectives._all_gather_single = real
        forward = comm.stats.calls["compiled graph check"]
        (y ** 2).sum().backward()
        seen.append((forward, comm.stats.calls["compiled graph check"], list(gathers)))
        gathers.clear()
    # every pairing round's fixed size (the same for any collective, so that it pairs with any): header + room
    return seen, world * (8 * len(collectives.Header("compiled graph", world, 0).values)
                          + collectives.inline_bytes(world))


@pytest.mark.parametrize("world", [2, 3])
def test_graph_check_costs_one_round_per_graph(dist, world):
    for seen, round_bytes in dist.run(world, _one_round_per_graph):
        for i, (forward, total, gathers) in enumerate(seen):
            assert (forward, total) == (1, 2), seen
            if i:  # the first call also ran the pending layout and parameter checks
                assert gathers == [round_bytes], (seen, round_bytes)


def _divergent(case):
    """Each rank compiles its own function: graphs whose collectives differ (``ops``), the same collectives
    with split sizes that do not match (``splits``: a halo of 1 row on rank 0, of 2 rows on the others), or a
    compiled graph on rank 0 meeting an eager all-gather on the others (``eager``)."""
    import torch.nn.functional as F

    from domainflow.errors import CollectiveError

    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    w3, w5 = torch.randn(4, 3, 3, 3, dtype=D, generator=g), torch.randn(4, 3, 5, 5, dtype=D, generator=g)
    x = df.distribute_tensor(_image(12, 0), mesh, [df.Shard(2)], sharding_shapes={0: [12 // world] * world})

    def conv3(x):
        return F.conv2d(x, w3, padding=1)

    def conv5(x):
        return F.conv2d(x, w5, padding=2)

    def pointwise(x):
        return torch.sin(x) * 2

    with pytest.raises(CollectiveError) as info:
        if rank == 0:
            df.compile(conv3, backend="aot_eager")(x)
        elif case == "eager":
            x.full_tensor()
        else:
            df.compile(conv5 if case == "splits" else pointwise, backend="aot_eager")(x)
    # the process group is still usable: the ranks agree again
    y = df.compile(conv3, backend="aot_eager")(x)
    assert torch.allclose(y.full_tensor(), F.conv2d(x.full_tensor(), w3, padding=1), atol=TOL, rtol=0)
    return str(info.value)


@pytest.mark.parametrize("world,case", [(2, "ops"), (3, "ops"), (2, "splits"), (3, "splits"), (2, "eager")])
def test_ranks_compiled_different_graphs_is_named(dist, world, case):
    """A rank whose compiled graph differs from the others' (different collectives, or split sizes that do not
    match) raises the same CollectiveError on every rank before any functional collective runs, instead of a
    hang or a mismatched all-to-all; so does one meeting another rank's eager collective."""
    said = dist.run(world, _divergent, case, timeout=120)
    bodies = {s.split(":", 1)[1] for s in said}
    assert len(bodies) == 1, said  # the same words on every rank (after "rank r:")
    s = said[0]
    assert "the ranks compiled different graphs" in s and "Nothing was exchanged" in s, s
    assert "torch.compiler.disable" in s, s
    if case == "ops":
        assert "rank 0: compiled forward graph with 1 collective(s): all_to_all_single over mesh dim 0" in s, s
        assert "compiled forward graph with 0 collective(s)" in s, s
    elif case == "splits":
        assert "split sizes do not match" in s, s
    else:
        assert "rank 1: all_gather" in s, s


def test_other_backends_are_refused():
    """Only inductor and aot_eager: the graph check wraps AOTAutograd's forward and backward compilers."""
    from torch._dynamo.testing import CompileCounterWithBackend

    for backend in ("eager", "cudagraphs", CompileCounterWithBackend("aot_eager")):
        with pytest.raises(CompileUnsupportedError) as info:
            df.compile(torch.nn.Linear(2, 2), backend=backend)
        assert "supports backend='inductor' or 'aot_eager'" in str(info.value), info.value


def _fails_on_one_rank():
    """Rank 1's compiled call raises before its graph runs (here its own code; a trace failing on one rank
    alike), while rank 0 reaches its graph check: both raise the CollectiveError naming rank 1's error at
    once, instead of rank 0 timing out in the check. Then every rank failing alike: each raises its own."""
    import torch.nn.functional as F

    from domainflow.errors import CollectiveError

    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    torch._dynamo.reset()
    w3 = torch.randn(4, 3, 3, 3, dtype=D, generator=torch.Generator().manual_seed(5))
    x = df.distribute_tensor(_image(12, 0), mesh, [df.Shard(2)], sharding_shapes={0: [12 // world] * world})

    def conv(x):
        if rank == 1:
            raise ValueError("boom on rank 1")
        return F.conv2d(x, w3, padding=1)

    def all_fail(x):
        raise KeyError(f"rank {rank}")

    with pytest.raises(CollectiveError) as info:
        df.compile(conv, backend="aot_eager")(x)
    with pytest.raises(KeyError) as mine:
        df.compile(all_fail, backend="aot_eager")(x)
    assert str(mine.value) == repr(f"rank {rank}")
    return str(info.value)


def test_failure_on_one_rank_is_named_on_every_rank(dist):
    said = dist.run(2, _fails_on_one_rank, timeout=120)
    assert said[0].split(":", 1)[1] == said[1].split(":", 1)[1], said
    assert "rank 1: failed in a call compiled by domainflow.compile: ValueError: boom on rank 1" in said[0], said[0]
    assert "rank 0: compiled forward graph with 1 collective(s)" in said[0], said[0]


def _fails_inside_its_graph():
    """Rank 1 fails while its compiled graph runs (an index out of range, known only from the data), after the
    graph's first halo exchange and before its second; rank 0 waits in that second exchange."""
    import os

    import torch.nn.functional as F

    os.environ["DOMAINFLOW_STALL_WAIT_S"] = "1"  # rank 0: 4 s timeout + 1 s waiting for reports
    rank, world = rank_and_world()
    mesh = get_mesh((world,))
    torch._dynamo.reset()
    w3 = torch.randn(4, 3, 3, 3, dtype=D, generator=torch.Generator().manual_seed(5))
    w4 = torch.randn(4, 4, 3, 3, dtype=D, generator=torch.Generator().manual_seed(6))
    table = torch.ones(3, dtype=D)
    x = df.distribute_tensor(_image(12, 0), mesh, [df.Shard(2)], sharding_shapes={0: [6, 6]})

    def two_convs(x, index):
        y = F.conv2d(x, w3, padding=1)
        return F.conv2d(y * table.index_select(0, index).sum(), w4, padding=1)

    compiled = df.compile(two_convs, backend="aot_eager")
    compiled(x, torch.tensor([0]))  # traced and run on every rank alike (tracing may take one rank longer)
    torch.distributed.barrier()
    return compiled(x, torch.tensor([0 if rank == 0 else 7]))  # the same graph, no retrace


def test_a_rank_failing_inside_a_compiled_graph_is_named_by_its_peers():
    """A rank that fails while its compiled graph runs leaves its peers in the graph's functional collectives:
    they raised Gloo's raw *Timed out waiting 4000ms for send operation to complete*. Now the peers raise a
    CollectiveError naming the compiled graph and the failing rank as the likely culprit; the failing rank raises
    its own error."""
    with WorkerPool(2, timeout=90, pg_timeout=4, grace=20) as pool:
        with pytest.raises(RankFailure) as info:
            pool.run(_fails_inside_its_graph)
    msg = str(info.value)
    assert "rank 1 raised IndexError" in msg and "index out of range" in msg, msg
    assert "rank 0 raised CollectiveError" in msg, msg
    assert "rank 0: a collective of a compiled forward graph over mesh dim" in msg, msg
    assert "Likely culprit: rank(s) [1]" in msg, msg
