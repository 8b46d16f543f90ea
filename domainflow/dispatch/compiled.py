"""``domainflow.compile``: ``torch.compile`` for domain-parallel models, with eager's cross-rank checks.

A compiled graph runs its collectives as functional collectives (``comm.traced``): no pairing round, and no
pending cross-rank check (``tensor.consistency``) runs inside it. Eager mode checks there what each rank
declares alone: layouts given per rank (``from_local(..., sharding_shapes=mapping)``) and replicated
parameters (each recorded the first time it meets a ShardTensor). Under ``torch.compile`` the engine only
sees fake parameters, so neither would be checked and a wrong one gives a silently wrong result, or a
functional all-to-all with mismatched sizes. :func:`compile` returns a callable that, before every call and
outside any graph:

1. records the module's plain parameters and buffers not checked yet (each once, like eager; the mesh is the
   first ShardTensor argument's), and
2. runs every pending cross-rank check (one small all-reduce per mesh dim, only when something is pending):
   a disagreement raises ``ShardingShapeError`` / ``ReplicaMismatchError`` on every rank, before any traced
   collective runs,

then calls ``torch.compile(model, **kwargs)``'s result with ``comm.base.checked_compile`` set, which Dynamo
and AOTAutograd (tracing, and re-tracing on a recompile, inside that call in this thread) see: a trace of
ShardTensors, traced collectives or parameters meeting a ShardTensor without it is refused
(``comm.refuse_unchecked_compile``).

Ranks may still trace different graphs (a guard that fails on one rank only recompiles there alone; a rule
choosing by a rank's own sizes), whose functional collectives would then hang or meet different ones. So the
backend (inductor or aot_eager, through AOTAutograd) wraps every forward and backward graph in a
:class:`GraphCheck`: before the graph runs, one pairing round per mesh dim (the eager collectives' own,
``comm.check_compiled_graph``) compares a digest of its collectives across ranks, and on any difference every
rank raises the same CollectiveError ("the ranks compiled different graphs").
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import time

import torch

from domainflow import comm
from domainflow.comm import base as _base
from domainflow.errors import CollectiveError, CompileUnsupportedError
from domainflow.tensor import consistency as _consistency
from domainflow.tensor.shard_tensor import ShardTensor

_PARAMETER = torch.nn.Parameter
_TENSOR = torch.Tensor


BACKENDS = ("inductor", "aot_eager")


def compile(model_or_fn, *, backend="inductor", **torch_compile_kwargs):  # noqa: A001 (like torch.compile)
    """``torch.compile(model_or_fn, backend=backend, **torch_compile_kwargs)`` for models on ShardTensors: the
    returned callable checks, eagerly before every call, that the ranks agree on the layouts they declared alone
    and on the module's replicated parameters and buffers (each checked once, the first call it meets a
    ShardTensor argument), then runs the compiled function, whose every graph (forward and backward) first
    checks that every rank runs the same graph's collectives (one pairing round per graph call and mesh dim:
    :class:`GraphCheck`). ``model_or_fn``: an ``nn.Module``, a bound method of one, or a function (the modules
    it closes over, names as globals or takes as arguments are checked, and bare parameters met those ways;
    parameters it reaches otherwise, e.g. through a helper's globals, are not). ``backend``: ``"inductor"``
    (``mode``/``options`` as torch.compile's) or ``"aot_eager"``; others are refused (the check needs AOTAutograd's forward and backward graphs).
    Attributes of the compiled module are reachable on the result (``.parameters()``, ``.train()``);
    ``.frames`` counts the Dynamo graphs compiled (a recompile or a graph break adds one).
    """
    if not isinstance(backend, str) or backend not in BACKENDS:
        name = backend if isinstance(backend, str) else type(backend).__name__
        raise CompileUnsupportedError(f"backend {name!r}", (
            f"domainflow.compile supports backend='inductor' or 'aot_eager', not {name!r}: its check that every "
            f"rank runs the same compiled collectives needs AOTAutograd's graphs"))
    mode, options = torch_compile_kwargs.pop("mode", None), torch_compile_kwargs.pop("options", None)
    if backend != "inductor" and (mode is not None or options is not None):
        raise ValueError(f"domainflow.compile: mode and options apply to backend='inductor' only, not {backend!r}")
    if torch_compile_kwargs.get("dynamic"):
        raise CompileUnsupportedError("dynamic shapes", (
            "domainflow.compile compiles static shapes only (dynamic=True refused): each layout is in the guard "
            "and recompiles on every rank alike, while symbolic local sizes would make the ranks' graphs differ"))
    # static shapes: torch.compile's default (dynamic=None) makes a dim symbolic once its size changed, which a
    # rank decides alone from its own local sizes (ranks whose rows changed would trace a different graph)
    torch_compile_kwargs["dynamic"] = False
    # its own cache of graphs (torch.compile shares one per code object by default): a raw torch.compile of the
    # same model must not find, and run unchecked, a graph compiled here
    torch_compile_kwargs["isolate_recompiles"] = True
    _skip_engine_frames()
    checked = CheckedCompile(model_or_fn, None)
    be = _Backend(checked, backend, mode, options, torch_compile_kwargs.get("dynamic"))
    checked._compiled = torch.compile(model_or_fn, backend=be, **torch_compile_kwargs)
    return checked


# the engine's own code, which Dynamo must never trace symbolically: it runs while AOTAutograd traces (below
# __torch_dispatch__) or as Dynamo's fake-tensor run of an op in its graph. Where Dynamo would step into it (a
# torch.nn.functional function that calls handle_torch_function itself, e.g. F.max_pool2d, or eager code after
# a graph break calling into it), the call runs eagerly instead (a graph break): tracing it broke at the
# ShardTensor wrapper's construction, with a raw InternalTorchDynamoError.
_ENGINE_PACKAGES = ("domainflow.comm", "domainflow.dispatch", "domainflow.layout", "domainflow.ops",
                    "domainflow.tensor")
_skipped = []


def _skip_engine_frames() -> None:
    if not _skipped:
        from torch._dynamo import trace_rules

        for name in _ENGINE_PACKAGES:
            trace_rules.add(name)
        _skipped.append(True)


class CheckedCompile:
    """What :func:`compile` returns: the compiled callable, called after the cross-rank checks."""

    def __init__(self, original, compiled):
        self._original = original
        self._compiled = compiled
        self._mesh = None  # the mesh of the call running (graphs traced in it check over it)
        self.frames = 0
        owner = original if isinstance(original, torch.nn.Module) else getattr(original, "__self__", None)
        self._module = owner if isinstance(owner, torch.nn.Module) else None
        self.__wrapped__ = original

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._compiled, name)

    def __call__(self, *args, **kwargs):
        mesh = _first_mesh(args) or _first_mesh(tuple(kwargs.values()))
        self._mesh = mesh
        if mesh is not None:
            for m in _modules_reached(self._original, args, kwargs):
                if isinstance(m, torch.nn.Module):
                    _record_module(m, mesh)
                elif not getattr(m, "_domainflow_recorded", False):  # a parameter of no module reached
                    _consistency.record_parameter(m, mesh)
        if comm.pending_checks:
            _consistency.flush("a call compiled by domainflow.compile")
        state = _base.checked_compile
        outer = getattr(state, "on", False)
        state.on = True
        try:
            return _every_output_gets_a_gradient(self._compiled(*args, **kwargs))
        except Exception as e:
            if mesh is not None:
                # Dynamo may have decided alone on this rank, from the failure, to run the failed code eagerly
                # from now on (its other ranks compiled it): every rank forgets its compiled code and traces
                # afresh on the next call, so the ranks' graphs cannot drift apart after a failure
                torch._dynamo.reset()
            if mesh is not None and not isinstance(e, CollectiveError) and not getattr(e, _IN_GRAPH, False):
                _failed_round(mesh, e)
            refused = _refusal_in(e)
            if refused is not None and refused is not e:  # (Dynamo wraps it: raise it by name, one line)
                named = CompileUnsupportedError(refused.what, str(refused).splitlines()[0])
                named.op, named.exchange = refused.op, refused.exchange
                raise named from e
            raise
        finally:
            state.on = outer


def _every_output_gets_a_gradient(out):
    """A compiled call's outputs, with those that need a gradient passed through :class:`_ZeroGradients` when
    several do and one is a ShardTensor: the loss may leave some of them out."""
    if not torch.is_grad_enabled():
        return out
    wanting: dict = {}  # id -> output, in order (an output returned twice counts once)
    _outputs_wanting_gradients(out, wanting, 0)
    if len(wanting) < 2 or not any(type(t) is ShardTensor for t in wanting.values()):
        return out
    outs = list(wanting.values())
    swap = {id(o): n for o, n in zip(outs, _ZeroGradients.apply(*outs))}
    return _with_outputs(out, swap, 0)


def _outputs_wanting_gradients(out, found: dict, depth: int) -> None:
    """The tensors needing a gradient among ``out``: inside lists, tuples (named too), dicts and dataclasses, a few
    levels deep (as the call's arguments are searched, :func:`_first_mesh`)."""
    if isinstance(out, torch.Tensor):
        if out.requires_grad:
            found.setdefault(id(out), out)
    elif depth <= 3:
        for v in _children(out):
            _outputs_wanting_gradients(v, found, depth + 1)


def _children(out) -> tuple:
    """What a list, tuple, dict or dataclass instance holds (nothing for anything else)."""
    if isinstance(out, (list, tuple)):
        return tuple(out)
    if isinstance(out, dict):
        return tuple(out.values())
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return tuple(getattr(out, f.name, None) for f in dataclasses.fields(out))
    return ()


def _with_outputs(out, swap: dict, depth: int):
    """``out`` with each tensor whose id is in ``swap`` replaced by ``swap``'s value, containers rebuilt."""
    if isinstance(out, torch.Tensor):
        return swap.get(id(out), out)
    if depth > 3:
        return out
    if isinstance(out, tuple) and hasattr(out, "_fields"):  # a named tuple
        return type(out)(*(_with_outputs(v, swap, depth + 1) for v in out))
    if isinstance(out, (list, tuple)):
        return type(out)(_with_outputs(v, swap, depth + 1) for v in out)
    if isinstance(out, dict):
        rebuilt = {k: _with_outputs(v, swap, depth + 1) for k, v in out.items()}
        return rebuilt if type(out) is dict else type(out)(rebuilt)
    if dataclasses.is_dataclass(out) and not isinstance(out, type):
        return dataclasses.replace(out, **{f.name: _with_outputs(getattr(out, f.name), swap, depth + 1)
                                           for f in dataclasses.fields(out) if f.init})
    return out


class _ZeroGradients(torch.autograd.Function):
    """Identity on a call's outputs needing gradients whose backward gives each one left out of the loss a zero
    gradient, a ShardTensor's in its own layout: autograd would hand the compiled backward a plain zero tensor
    for it, which AOTAutograd refuses for a ShardTensor output (*we guessed its metadata incorrectly ... Expected
    a ShardTensor tangent but got a plain Tensor*, pytorch issue 172556). Every such output goes through it, so a
    loss of any one of them reaches it. Its outputs are detached aliases, not views, so they can still be changed
    in place as the compiled outputs could."""

    @staticmethod
    def forward(ctx, *outs):
        ctx.set_materialize_grads(False)
        ctx.layouts = [(o._spec, None, o._local.dtype, o._local.device) if type(o) is ShardTensor
                       else (None, o.shape, o.dtype, o.device) for o in outs]
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(g if g is not None else _zeros(*layout) for g, layout in zip(grads, ctx.layouts))


def _zeros(spec, shape, dtype, device) -> torch.Tensor:
    if spec is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return ShardTensor.from_spec(torch.zeros(spec.local_shape, dtype=dtype, device=device), spec)


_IN_GRAPH = "_domainflow_in_compiled_graph"  # set on an exception raised while a compiled graph ran
_FAILED = (0, 0, -1)  # the digest a rank that failed outside a graph sends (no graph has it)


def _refusal_in(e: BaseException):
    """The first CompileUnsupportedError in ``e``'s chain (causes and contexts), or None."""
    seen = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, CompileUnsupportedError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _failed_round(mesh, e: Exception) -> None:
    """This rank failed in a compiled call outside any graph's run (tracing or compiling, or eager code between
    graphs): its peers may wait in a graph check or an eager collective for it, so it joins one pairing round
    per mesh dim saying so. Where every rank failed alike, each then raises its own error; else every rank
    raises the same CollectiveError naming this failure (the cause here: ``e``), instead of the peers timing
    out."""
    first = (str(e).strip().splitlines() or [""])[0]
    what = f"{comm.FAILED_IN_COMPILED}: {type(e).__name__}: {first}"[:400]
    for d in range(mesh.ndim):
        n = comm.group_size(mesh, d)
        try:
            comm.check_compiled_graph(mesh, d, _FAILED, [0] * n, [0] * n, what)
        except CollectiveError as err:
            raise err from e


def _modules_reached(fn, args, kwargs) -> list:
    """The modules whose parameters a call of ``fn`` uses, as far as can be seen without tracing: ``fn`` itself,
    the owner of a bound method (or the modules among its attributes), the modules a function closes over or
    names as globals, and nn.Module arguments; and the bare ``nn.Parameter``s met the same ways (alone, or in a
    list or tuple), which eager checks as it meets them. (While tracing, the engine sees only fake parameters.)"""
    if isinstance(fn, functools.partial):  # the function's, and the modules bound as its arguments
        bound = (*fn.args, *fn.keywords.values())
        return _modules_reached(fn.func, (*bound, *args), kwargs)
    if isinstance(fn, torch.nn.Module):
        seen = [fn]
    else:
        seen = []
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            seen.append(owner)
        elif owner is not None and hasattr(owner, "__dict__"):
            seen += _modules_in(vars(owner).values())
        code = getattr(fn, "__code__", None)
        if code is not None:
            cells = []
            for cell in getattr(fn, "__closure__", None) or ():
                try:
                    cells.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    continue
            names = getattr(fn, "__globals__", {})
            seen += _modules_in([*cells, *(names.get(n) for n in code.co_names)])
    seen += _modules_in((*args, *kwargs.values()))
    return seen


def _modules_in(values) -> list:
    """The modules and bare parameters among ``values``, also one level inside lists and tuples."""
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out += [x for x in v if isinstance(x, torch.nn.Module) or type(x) is _PARAMETER]
        elif isinstance(v, torch.nn.Module) or type(v) is _PARAMETER:
            out.append(v)
    return out


def _record_module(module: torch.nn.Module, mesh) -> None:
    """Record the plain parameters and buffers of ``module`` not checked yet (no communication)."""
    for p in module.parameters():
        if type(p) is _PARAMETER and not getattr(p, "_domainflow_recorded", False):
            _consistency.record_parameter(p, mesh)
    for b in module.buffers():
        if type(b) is _TENSOR and not getattr(b, "_domainflow_recorded", False):
            _consistency.record_parameter(b, mesh)


def _first_mesh(args, depth: int = 0):
    """The mesh of the first ShardTensor among ``args``: inside lists, tuples (named too), dicts, dataclasses
    and the attributes of other objects (a batch class), a few levels deep."""
    for a in args:
        if type(a) is ShardTensor:
            return a._spec.mesh
        if isinstance(a, torch.Tensor) or depth > 3:
            continue
        inner = _children(a)
        if not inner and hasattr(a, "__dict__") and not isinstance(a, (type, torch.nn.Module)) and not callable(a):
            inner = tuple(vars(a).values())
        m = _first_mesh(inner, depth + 1)
        if m is not None:
            return m
    return None


# -- every rank runs the same compiled collectives, or every rank raises ---------------------------------------
# A compiled graph runs its collectives as functional collectives, without the pairing round of eager ones: two
# ranks whose graphs differ (a rule that branched on a rank's local size; a guard failing on one rank only, which
# recompiles there alone) would wait forever or meet different collectives. So every graph AOTAutograd hands to
# the compiler (forward and backward) is wrapped: before it runs, one pairing round per mesh dim carries a digest
# of its collectives (comm.check_compiled_graph), which meets another rank's graph check or eager collective.
_FUNCOL_NAMESPACES = ("_c10d_functional", "_c10d_functional_autograd", "c10d_functional")
_SPLITS = ("output_split_sizes", "input_split_sizes")
_MOD = (1 << 61) - 1  # sums of split sizes, weighted per all-to-all, kept in an int64


class _Backend:
    """The backend ``compile`` passes to torch.compile: ``backend`` (inductor or aot_eager), with each graph
    AOTAutograd produces wrapped in a :class:`GraphCheck` (the mesh: that of the call tracing it)."""

    def __init__(self, owner, backend, mode, options, dynamic):
        self.owner, self.backend = owner, backend
        self.config = {}
        if backend == "inductor" and (mode is not None or options is not None):
            self.config = torch._TorchCompileInductorWrapper(mode, options, dynamic).config

    def __call__(self, gm, example_inputs):
        self.owner.frames += 1
        mesh = self.owner._mesh
        if mesh is None and any(type(x) is ShardTensor for x in example_inputs):
            # no ShardTensor among the call's arguments where the wrapper looks (so neither the parameters nor
            # the ranks' graphs would be checked), yet the graph takes one: refused alike on every rank
            raise CompileUnsupportedError("ShardTensors the call's arguments do not hold", (
                "domainflow.compile finds the mesh from the ShardTensors among a call's arguments (also inside "
                "lists, tuples, dicts, dataclasses and an object's attributes), and this call passed none that it "
                "could find while its graph takes one: pass the ShardTensor inputs as arguments of the compiled "
                "call"))

        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner(graph, inputs, **kw):
                kind = "backward" if kw.get("is_backward") else "forward"
                check = GraphCheck.of(graph, mesh, kind)  # (before inductor's passes change the graph)
                out = compile_fx_inner(graph, inputs, **kw)
                return out if check is None else check.around(out)

            # no AOTAutograd cache: a hit would return compiled graphs without calling inner (unchecked)
            # no folding of uniform values in the joint graph: an exchange that sends and receives nothing on one
            # rank (an empty shard, a rank with no output row) gives a uniform (empty) value there, and folding
            # it into a constant removed that rank's collective only (its peers still ran theirs)
            patches = {**self.config, "joint_graph_constant_folding": False}
            with torch._functorch.config.patch(enable_autograd_cache=False):
                return compile_fx(gm, example_inputs, inner_compile=inner, config_patches=patches)
        from torch._dynamo.backends.common import aot_autograd
        from torch._dynamo.backends.debugging import boxed_nop
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        def checked(kind):
            def compiler(graph, inputs):
                check = GraphCheck.of(graph, mesh, kind)
                out = boxed_nop(graph, inputs)
                return out if check is None else check.around(out)
            return compiler

        # as torch's aot_eager backend
        return aot_autograd(fw_compiler=checked("forward"), bw_compiler=checked("backward"),
                            partition_fn=min_cut_rematerialization_partition,
                            keep_inference_input_mutations=True)(gm, example_inputs)


class GraphCheck:
    """What a compiled graph checks before it runs: one pairing round per mesh dim of the mesh it was traced
    with (comm.check_compiled_graph) carrying a digest of its collectives, in order: op, mesh dim, reduce op,
    dtype and the shapes every rank shares (an all-to-all's rows along its first dim are this rank's own); and
    weighted sums of its all-to-alls' split sizes, which must be each other's transpose across ranks. Graphs
    without collectives check too (another rank's graph may have some). ``around(compiled)``: the boxed callable
    (a list of arguments) that runs the check, then ``compiled``."""

    def __init__(self, mesh, kind, entries, splits):
        self.mesh, self.kind = mesh, kind
        self.rounds = []
        for d in range(mesh.ndim):
            if comm.group_size(mesh, d) == 1:
                continue
            words = []  # runs of the same collective as one "op ×k"
            for e in entries:
                if words and words[-1][0] == e[1]:
                    words[-1][1] += 1
                else:
                    words.append([e[1], 1])
            words = [w if k == 1 else f"{w} x{k}" for w, k in words]
            # a collective over another mesh dim in full; its shapes only where it runs over this dim: the ranks
            # of this dim's group hold blocks of other sizes along the other dims, so they legitimately differ
            key = repr([e[0] if e[2] == d else e[3] for e in entries]).encode()
            h = hashlib.sha256(key).digest()
            digest = (int.from_bytes(h[:8], "little") >> 2, int.from_bytes(h[8:16], "little") >> 2, len(entries))
            n = comm.group_size(mesh, d)
            sends, recvs = [0] * n, [0] * n
            for j, (dim, send, recv) in enumerate(splits):
                if dim != d or send is None:
                    continue
                w = (0x9E3779B97F4A7C15 * (j + 1)) % _MOD
                for k in range(n):
                    sends[k] = (sends[k] + w * send[k]) % _MOD
                    recvs[k] = (recvs[k] + w * recv[k]) % _MOD
            what = f"compiled {kind} graph with {len(entries)} collective(s)" + (": " + ", ".join(words) if words else "")
            self.rounds.append((d, digest, sends, recvs, what[:400]))

    @classmethod
    def of(cls, gm, mesh, kind):
        """The check of graph ``gm`` traced with ``mesh`` (None without a mesh: nothing to check with)."""
        if mesh is None:
            return None
        entries, splits = _collectives(gm, mesh)
        return cls(mesh, kind, entries, splits)

    def around(self, compiled):
        rounds, mesh = self.rounds, self.mesh
        op = f"a collective of a compiled {self.kind} graph"

        def run(args):
            for d, digest, sends, recvs, what in rounds:
                comm.check_compiled_graph(mesh, d, digest, sends, recvs, what)
            entered = time.time()
            try:
                return compiled(args)
            except Exception as e:  # (its peers may wait in this graph's collectives: no more rounds)
                # a peer that failed or stalled inside the graph leaves this rank's functional collective to
                # time out (or its closed connection fails it): named, with where the peers are, as eager's are
                named = (comm.collective_error(e, op, mesh, 0 if mesh.ndim == 1 else None, entered=entered,
                                               transport_only=True) if isinstance(e, RuntimeError) else None)
                if named is not None:
                    setattr(named, _IN_GRAPH, True)
                    raise named from e
                try:
                    setattr(e, _IN_GRAPH, True)
                except AttributeError:
                    pass
                raise

        run._boxed_call = True
        run.graph_check = self
        return run


def _graph_nodes(gm):
    yield from gm.graph.nodes
    for _, sub in gm.named_children():  # subgraphs of higher-order ops
        if isinstance(sub, torch.fx.GraphModule):
            yield from _graph_nodes(sub)


def _collectives(gm, mesh):
    """(entries, splits) of the functional collectives in ``gm``, in graph order: each entry (what every rank
    of its mesh dim must share, its words, its mesh dim, what every rank must share: the key without shapes);
    splits: (mesh dim, send sizes, recv sizes) per all-to-all (None, None where the
    sizes are not plain ints)."""
    dims = {}
    for d in range(mesh.ndim):
        dims[mesh.get_group(d).group_name] = d
    entries, splits = [], []
    for node in _graph_nodes(gm):
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) or \
                target.namespace not in _FUNCOL_NAMESPACES:
            continue
        name = target._schema.name.split("::")[-1]
        if name.startswith("wait_tensor"):
            continue
        bound = {}
        for i, a in enumerate(target._schema.arguments):
            if i < len(node.args):
                bound[a.name] = node.args[i]
            elif a.name in node.kwargs:
                bound[a.name] = node.kwargs[a.name]
        key, dim = [name], None
        loose = [name]  # the key without the shapes
        a2a = "all_to_all" in name
        for a_name, v in bound.items():
            if a_name in _SPLITS:
                continue
            if a_name == "group_name" or (a_name == "tag" and isinstance(v, str)):
                dim = dims.get(v)
                key.append(("dim", dim if dim is not None else f"group of {_group_size(v)}"))
                loose.append(key[-1])
            elif isinstance(v, torch.fx.Node) or isinstance(v, (list, tuple)) and v and \
                    all(isinstance(x, torch.fx.Node) for x in v):
                for x in (v if isinstance(v, (list, tuple)) else [v]):
                    val = x.meta.get("val")
                    if isinstance(val, torch.Tensor):
                        shape = tuple(str(s) for s in val.shape)
                        key.append((str(val.dtype), shape[1:] if a2a else shape))
                        loose.append(str(val.dtype))
                    else:
                        key.append("?")
                        loose.append("?")
            else:
                key.append((a_name, repr(v)))
                loose.append(key[-1])
        if a2a:
            recv, send = bound.get("output_split_sizes"), bound.get("input_split_sizes")
            ok = all(isinstance(x, (list, tuple)) and all(type(s) is int for s in x) for x in (send, recv))
            splits.append((dim, list(send) if ok else None, list(recv) if ok else None))
        words = name + (f" over mesh dim {dim}" if dim is not None else "")
        extra = [k[1] for k in key[1:] if isinstance(k, tuple) and k[0] == "reduce_op"]
        if extra:
            words += f" ({extra[0].strip(chr(39))})"
        entries.append((tuple(key), words, dim, tuple(loose)))
    return entries, splits


def _group_size(name):
    try:
        return torch.distributed.distributed_c10d._resolve_process_group(name).size()
    except Exception:  # noqa: BLE001
        return "?"
