"""The behaviour jaxshard relies on in JAX's and jaxtyping's internals."""

import inspect
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import put
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import _jax_internals as internals


def test_probe_reports_the_propagated_sharding(auto_mesh):
    seen = []

    def f(x):
        y = jnp.sin(x)
        internals.bind_probe(y, lambda s, dims, t: seen.append((s.spec, dims)))
        return x  # y is dead code: the probe must survive anyway

    x = put((8, 4), auto_mesh, P("dp", "tp"))
    jaxpr = jax.make_jaxpr(f)(x)
    assert not jaxpr.effects
    jax.jit(f).lower(x).compile()
    assert seen == [(P("dp", "tp"), ())]


def test_probe_under_vmap_records_batch_dims(auto_mesh):
    seen = []

    def f(r):
        internals.bind_probe(r, lambda s, dims, t: seen.append(dims))
        return r

    x = put((8, 4, 2), auto_mesh, P("dp"))
    jax.jit(jax.vmap(jax.vmap(f, in_axes=1), in_axes=2)).lower(x).compile()
    assert [set(d) for d in seen] == [{1, 2}]


def test_probe_keeps_the_fast_path(auto_mesh):
    """No effect in the program: jit's C++ dispatch handles the second call."""
    f = jax.jit(lambda x: internals.bind_probe(x, lambda s, d, t: None) or x * 2)
    x = put((8, 4), auto_mesh, P("dp"))
    f(x)
    f(x)
    assert f._cache_size() == 1


@pytest.mark.parametrize("on_mesh", [False, True])
def test_probe_survives_partial_evaluation(on_mesh, auto_mesh):
    """grad of a scan body splits it into a forward and a backward pass with
    `pe.JaxprTrace`, which keeps only equations something uses (or with an effect):
    the probe's partial-eval rule keeps it in the forward pass, without an effect."""
    seen = []

    def body(c, _):
        y = jnp.sin(c)
        mesh = auto_mesh if on_mesh else None
        internals.bind_probe(y, lambda s, dims, t: seen.append(s.spec), mesh)
        return y, None

    def loss(x):
        return jax.lax.scan(body, x, None, length=2)[0].sum()

    x = put((8, 4), auto_mesh, P("dp", "tp"))
    with jax.set_mesh(auto_mesh):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(x)
        jax.jit(jax.grad(loss)).lower(x).compile()
    assert "jaxshard_sharding_probe" in str(jaxpr) and not jaxpr.effects
    assert seen and all(spec == P("dp", "tp") for spec in seen)


@pytest.mark.parametrize("on_mesh", [False, True])
def test_probe_linearizes_by_its_own_rule_and_lowers_inline(on_mesh, auto_mesh):
    """Under grad the probe's linearize rule binds it once on the primal (JAX's
    fallback would trace its JVP into a jaxpr per probe); its lowering is inline,
    not a function of its own."""
    from jax._src.interpreters import ad as ad_internal

    prim = internals.mesh_probe_p if on_mesh else internals.probe_p
    assert prim in ad_internal.primitive_linearizations
    seen = []

    def loss(x):
        y = jnp.sin(x)
        mesh = auto_mesh if on_mesh else None
        internals.bind_probe(y, lambda s, dims, t: seen.append(s.spec), mesh)
        return (y * y).sum()

    x = put((8, 4), auto_mesh, P("dp", "tp"))
    with jax.set_mesh(auto_mesh):
        jaxpr = jax.make_jaxpr(jax.grad(loss))(x)
        lowered = jax.jit(jax.grad(loss)).lower(x)
        lowered.compile()
    assert str(jaxpr).count("jaxshard_sharding_probe") == 1
    assert lowered.as_text().count("func.func") == 1  # main alone
    assert seen == [P("dp", "tp")]


def test_probe_on_a_mesh_needs_no_device_assignment(auto_mesh):
    """The probe given its mesh is not one of the primitives for which JAX hands
    the device assignment to the lowering (and refuses inputs whose meshes differ in
    their axis types only); the other is, as inspect_sharding."""
    from jax._src import dispatch

    assert internals.probe_p in dispatch.prim_requires_devices_during_lowering
    assert internals.mesh_probe_p not in dispatch.prim_requires_devices_during_lowering
    seen = []

    def f(x):
        internals.bind_probe(x, lambda s, d, t: seen.append(s), auto_mesh)
        return x * 2

    with jax.set_mesh(auto_mesh):
        jax.jit(f).lower(put((8, 4), auto_mesh, P("tp"))).compile()
    (sharding,) = seen
    assert sharding.mesh.shape == auto_mesh.shape and sharding.spec == P("tp")


def test_checked_call_finds_jaxtyping_frames():
    import beartype
    import jaxtyping

    seen = []

    @jaxtyping.jaxtyped(typechecker=beartype.beartype)
    def f(x: int, y: int = 3):
        seen.append(internals.checked_call())
        return x

    f(1)
    call = seen[0]
    assert call.function.endswith("test_checked_call_finds_jaxtyping_frames.<locals>.f")
    # Where it is defined (its first line), for the report's violations.
    assert call.function.source == (__file__, f.__wrapped__.__code__.co_firstlineno)
    assert internals.function_name(len).source is None
    assert call.arguments == {"x": 1, "y": 3}
    assert call.hints == {"x": int, "y": int, "return": inspect.Signature.empty}
    assert not call.returned
    assert internals.checked_call() is None

    class Recording(type):
        def __instancecheck__(cls, obj):
            seen.append(internals.checked_call())
            return True

    class Anything(metaclass=Recording):
        pass

    @jaxtyping.jaxtyped(typechecker=beartype.beartype)
    def g(x: Anything) -> Anything:
        return x

    seen.clear()
    g(5)
    params, result = seen[0], seen[-1]
    assert not params.returned and result.returned and result.out == 5
    assert result.hints == {"x": Anything, "return": Anything}


def test_context_mesh(explicit_mesh, auto_mesh):
    import warnings

    assert internals.context_mesh() is None
    with jax.set_mesh(explicit_mesh):
        assert internals.context_mesh() is explicit_mesh
        seen = []
        jax.jit(lambda x: seen.append(internals.context_mesh()) or x)(1.0)
        assert seen == [explicit_mesh]  # inside jit too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with auto_mesh:
            assert internals.context_mesh() == auto_mesh


def test_dim_memo_roundtrip():
    import jaxtyping

    with jaxtyping.jaxtyped("context"):
        snap = internals.save_dim_memo()
        assert isinstance(jnp.ones(3), jaxtyping.Float[jax.Array, "n"])
        internals.restore_dim_memo(snap)
        assert isinstance(jnp.ones(4), jaxtyping.Float[jax.Array, "n"])


def test_simple_dims_and_bind_dims_are_jaxtypings_shape_check():
    """jaxshard's fast shape check reads jaxtyping's dimension objects and binds in
    the table of the jaxtyped call in progress, as jaxtyping's own check does."""
    import jaxtyping

    def dims(text):
        return internals.simple_dims(jaxtyping.Float[jax.Array, text])

    assert dims("a 4 _") == (("a", None), (None, 4), (None, None))
    variadic = internals.VariadicDims
    assert dims("2 *a b") == variadic(((None, 2),), "a", (("b", None),))
    assert dims("... b") == dims("*_ b") == variadic((), None, (("b", None),))
    for text in ("#a", "a+1", "?a", "#4", "#*a", "?*a", "*a #b"):
        assert dims(text) is None, text
    with jaxtyping.jaxtyped("context"):
        assert internals.bind_dims(dims("a 4"), (3, 4))
        assert not internals.bind_dims(dims("b a"), (2, 5))  # `a` is 3
        assert isinstance(jnp.ones(2), jaxtyping.Float[jax.Array, "b"])  # b unbound
        assert not isinstance(jnp.ones(5), jaxtyping.Float[jax.Array, "a"])
        assert not internals.bind_dims(dims("a 4"), (3, 5))
        assert not internals.bind_dims(dims("a"), (3, 1))  # the rank
        assert internals.bind_dims(dims("*v a"), (1, 2, 3))  # *v is (1, 2)
        assert not internals.bind_dims(dims("*v"), (1, 3))
        assert not internals.bind_dims(dims("c *v"), (9, 1, 2, 3))  # c unbound after
        assert isinstance(jnp.ones(5), jaxtyping.Float[jax.Array, "c"])  # c unbound
        assert internals.bind_dims(dims("... 4"), (4,))
        assert not internals.bind_dims(dims("*w 2 2"), (2,))  # too few dimensions
    assert internals.bind_dims(dims("a"), (7,))  # no call in progress: no table


def test_jax_extend_names_are_jax_extends():
    """`Primitive`, `find_top_trace`, `set_current_trace` and MLIR's `ir` come from
    where `jax.extend` finds them, so that `import jaxshard` does not import all of
    `jax.extend` (Pallas included)."""
    import jax.extend.core
    from jax.extend.mlir import ir

    from jaxshard._jax_internals import primitives, shard_map, traces

    assert primitives.Primitive is jax.extend.core.Primitive
    assert primitives.ir.DictAttr is ir.DictAttr
    for module in (traces, shard_map):
        assert module.find_top_trace is jax.extend.core.find_top_trace
        assert module.set_current_trace is jax.extend.core.set_current_trace
    code = (
        "import sys, jaxshard; "
        "print(any(m.startswith('jax.extend') for m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "False"


PERSISTENT_CACHE = textwrap.dedent(
    """
    import sys
    import beartype, jax, jax.numpy as jnp
    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from jax import Array
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    import jaxshard
    from jaxshard import Float
    mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
    @jaxshard.jaxtyped(typechecker=beartype.beartype)
    def f(x: Float[Array, "b d", P("dp")]):
        return x * 2
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(sys.argv[2] or None)))
    for _ in range(3):  # the same program again, after dropping the in-memory caches
        try:
            jax.jit(f)(x)
            print("passed")
        except jaxshard.ShardingError:
            print("raised")
        jax.clear_caches()
    """
)


def test_persistent_cache_never_skips_a_check(tmp_path):
    """A program compiled (and cached) by one process is checked again by the next."""

    def run(axis):
        result = subprocess.run(
            [sys.executable, "-c", PERSISTENT_CACHE, str(tmp_path), axis],
            capture_output=True,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
        )
        assert result.returncode == 0, result.stderr
        (outcome,) = set(result.stdout.split())
        return outcome

    assert [run("tp"), run("tp"), run("dp"), run("tp")] == [
        "raised",
        "raised",
        "passed",
        "raised",
    ]
    assert any(p.name.startswith("jit_f") for p in tmp_path.iterdir())


@pytest.mark.parametrize("event", ["/jax/core/compile/backend_compile_duration"])
def test_compile_event_is_reported_on_the_compiling_thread(event, auto_mesh):
    import threading

    seen = []

    def listener(name, duration, **kwargs):
        if name == event:
            seen.append(threading.get_ident())

    x = put((8, 4), auto_mesh, P("dp"))  # made first: `jnp.ones` may compile too
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        jax.jit(lambda x: x + 1).lower(x).compile()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert seen == [threading.get_ident()]


def test_compiling_call_is_the_users_call_of_a_jit_wrapper():
    # During a backend compile, the jit call being compiled; through eqx.filter_jit
    # and nnx.jit, the user's own call of them (equinox 0.13, flax 0.12).
    import equinox as eqx
    from flax import nnx

    seen = []

    def listener(name, duration, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            seen.append(internals.compiling_call())

    def forward(params, x):
        return x * params["w"].sum()

    params, x = {"w": jnp.ones(2)}, jnp.ones(3)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        for jit in (jax.jit, eqx.filter_jit, nnx.jit):
            jit(forward)(params, x)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    calls = [c for c in seen if c is not None and c[0] is forward]
    assert len(calls) == 3
    for function, args, kwargs in calls:
        assert args[0] is params and args[1] is x and kwargs == {}


def test_ref_contents():
    from jaxshard._jax_internals import ref_contents, set_ref_contents

    ref = jax.new_ref(jnp.zeros(3))
    assert isinstance(ref_contents(ref), jax.Array)
    set_ref_contents(ref, jnp.arange(3.0))  # uncommitted: committed like the Ref's
    np.testing.assert_array_equal(ref[...], [0.0, 1.0, 2.0])
    ref[...] = jnp.ones(3)
    np.testing.assert_array_equal(ref_contents(ref), [1.0, 1.0, 1.0])


def test_jit_parameters(auto_mesh):
    import functools as ft

    from jax.sharding import NamedSharding

    @ft.partial(jax.jit, static_argnums=1, donate_argnames="x")
    def f(x, n, *, scale=1.0):
        return x * n * scale

    assert internals.jit_parameters(f) == {
        "fun": f.__wrapped__,
        "static_argnums": (1,),
        "static_argnames": ("n",),
        "donate_argnums": (0,),
        "donate_argnames": ("x",),
    }
    assert internals.jit_parameters(f.__wrapped__) is None
    assert internals.jit_parameters(lambda x: x) is None
    dp, rep = NamedSharding(auto_mesh, P("dp")), NamedSharding(auto_mesh, P())
    g = jax.jit(lambda a, b: (a, b), in_shardings=(dp, None), out_shardings=(rep, dp))
    params = internals.jit_parameters(g)
    assert params["in_shardings"] == (dp, None)
    assert params["out_shardings"] == (rep, dp)
    h = jax.jit(lambda a: {"y": a}, in_shardings=dp, out_shardings={"y": None})
    params = internals.jit_parameters(h)
    assert params["in_shardings"] == dp
    assert params["out_shardings"] == {"y": None}
    options = {"xla_cpu_enable_fast_math": True}
    k = jax.jit(lambda a: a, keep_unused=True, compiler_options=options)
    params = internals.jit_parameters(k)
    assert params["keep_unused"] is True and params["compiler_options"] == options
    # Layouts go back into the shardings they came in with; `device` is kept.
    from jax.experimental.layout import Format, Layout

    laid = Format(Layout(major_to_minor=(0, 1)), dp)
    params = internals.jit_parameters(
        jax.jit(lambda a, b: a + b, in_shardings=(laid, dp), out_shardings=laid)
    )
    assert params["in_shardings"] == (laid, dp) and params["out_shardings"] == laid
    params = internals.jit_parameters(
        jax.jit(lambda a: a, in_shardings=Format(Layout.AUTO))
    )
    assert params["in_shardings"] == Format(Layout.AUTO)
    with pytest.warns(DeprecationWarning, match="backend and device"):
        d = jax.jit(lambda a: a, device=jax.devices()[1])
    assert internals.jit_parameters(d)["device"] == jax.devices()[1]


def test_untested_jax_warns_at_import():
    """An untested jax gets one warning at import naming the tested range; a tested
    one gets none (warnings are errors in this suite)."""
    script = (
        "import jax; jax.__version_info__ = (0, 13, 0); jax.__version__ = '0.13.0'; "
        "import jaxshard"
    )
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    assert result.returncode == 0, result.stderr
    assert "UntestedVersionWarning" in result.stderr
    assert "jax 0.13.0 is installed" in result.stderr
    assert "jax>=0.10.2,<0.13" in result.stderr
    with pytest.warns(jaxshard.UntestedVersionWarning, match="jax 0.10.1 is installed"):
        internals._warn_if_untested("0.10.1")
    with pytest.warns(jaxshard.UntestedVersionWarning):
        internals._warn_if_untested("0.13.0.dev20261101")
    for tested in ("0.10.2", "0.11.0", "0.11.2", "0.12.0", "0.12.0.1", jax.__version__):
        internals._warn_if_untested(tested)


def test_traces_and_refs_in_them():
    """`in_trace`, `current_trace`, `new_ref_in` and `new_ref_outside_traces`, on the
    public `jax.extend.core` and `jax.core.eval_context`."""
    assert not internals.in_trace()
    seen = {}

    def f(x):
        seen["traced"] = internals.in_trace()
        outer = internals.current_trace()
        seen["outside"] = internals.new_ref_outside_traces(np.zeros(()))

        def body(carry, _):
            ref = internals.new_ref_in(outer, 0.0)  # in the jit trace, not scan's
            seen["inner"] = internals.current_trace() is not outer
            ref[...] = carry
            return carry + 1, ref[...]

        return jax.lax.scan(body, x, length=3)

    carry, ys = jax.jit(f)(1.0)
    assert seen["traced"] and seen["inner"]
    assert not isinstance(seen["outside"], jax.core.Tracer)
    assert isinstance(seen["outside"], jax.Ref)
    np.testing.assert_array_equal(ys, [1.0, 2.0, 3.0])


def test_varying_axes(explicit_mesh):
    seen = []

    def body(x, y):
        seen.append((internals.varying_axes(x), internals.varying_axes(y)))
        return x

    x = put((8, 4), explicit_mesh, P("dp", "tp"))
    y = put((8, 4), explicit_mesh, P())
    jax.shard_map(
        body, mesh=explicit_mesh, in_specs=(P("dp", "tp"), P()), out_specs=P("dp", "tp")
    )(x, y)
    assert seen == [({"dp", "tp"}, set())]
    assert internals.varying_axes(jnp.ones(3)) == set()


def test_jaxtyping_array_metaclass():
    """jaxshard's annotations extend these two methods of jaxtyping's metaclass."""
    import jaxtyping

    cls = jaxtyping.Float[jax.Array, "n"]
    assert type(cls) is internals.ArrayMeta
    assert internals.ArrayMeta.__instancecheck_str__(cls, jnp.ones(3)) == ""
    assert internals.ArrayMeta.__instancecheck_str__(cls, jnp.ones(3, int)) != ""
    assert internals.ArrayMeta._check_shape(cls, jnp.ones(3), {}, {}, {}) == ""
    assert internals.ArrayMeta._check_shape(cls, jnp.ones((3, 2)), {}, {}, {}) != ""


def test_dce_keeps_the_probe_and_discharge_writes_the_state():
    """Both rule signatures changed in these releases (DCE in 0.12, discharge in
    0.11): a checked scan's state survives DCE and is written by discharge."""
    import jaxshard

    @jaxshard.checked
    @jax.jit
    def f(x):
        def body(c, xi):
            jaxshard.check(xi > 0, "x is {xi}", xi=xi)
            return c, None

        jax.lax.scan(body, 0, x)
        return x

    f(jnp.ones(3))
    with pytest.raises(jaxshard.CheckError, match="x is -2.0"):
        f(jnp.array([1.0, -2.0, 3.0]))


def test_in_linen_init():
    """flax linen's module stack says which module runs, and its public
    `is_initializing` whether under init."""
    import flax.linen as nn

    seen = []

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            seen.append(internals.in_linen_init())
            return nn.Dense(2)(x)

    variables = Layer().init(jax.random.key(0), jnp.ones((1, 2)))
    jax.eval_shape(Layer().init, jax.random.key(0), jnp.ones((1, 2)))
    Layer().apply(variables, jnp.ones((1, 2)))
    assert seen == [True, True, False] and not internals.in_linen_init()


def test_shard_map_outputs_adds_an_output_to_any_shard_map(explicit_mesh):
    """While in force, every shard_map body traced (here one made before) runs
    through the hook; what it adds leaves the shard_map with out_spec P() and
    reaches `done` outside, under jit and eagerly (jitted first). A hook that adds
    nothing leaves the program as it is, and nothing stays installed, even after an
    error."""
    mapped = jax.shard_map(
        lambda x: x * 2, mesh=explicit_mesh, in_specs=P("dp"), out_specs=P("dp")
    )
    x = jax.device_put(jnp.arange(8.0), jax.NamedSharding(explicit_mesh, P("dp")))
    seen = []

    def counting(body):
        return body(), {"devices": jax.lax.psum(1, "dp")}, seen.append

    with internals.shard_map_outputs(counting):
        y, devices = jax.jit(lambda x: (mapped(x), seen[-1]["devices"]))(x)
        eager = mapped(x)
    # Eagerly, `done` runs inside the jit the shard_map is run under.
    assert int(devices) == 4 and len(seen) == 2
    np.testing.assert_array_equal(y, eager)
    np.testing.assert_array_equal(eager, np.arange(8.0) * 2)
    before = str(jax.make_jaxpr(mapped)(x))
    with pytest.raises(ZeroDivisionError):
        with internals.shard_map_outputs(lambda body: (body(), None, None)):
            assert str(jax.make_jaxpr(mapped)(x)) == before
            1 / 0
    assert "bind_with_trace" not in vars(internals.shard_map_p)


def test_jax_leaves_registered_files_out_of_its_tracebacks():
    """`register_exclusion`: JAX leaves jaxshard's frames (registered at import) out
    of the traceback of an error raised under `jax.jit`, and the frames of the
    module where it calls compile listeners (`jax.monitoring`'s)."""
    from jax._src import traceback_util

    package = os.path.dirname(os.path.abspath(jaxshard.__file__))
    listener = jax.monitoring.record_event_duration_secs
    monitoring = os.path.abspath(sys.modules[listener.__module__].__file__)
    assert not traceback_util.include_filename(os.path.join(package, "_errors.py"))
    assert not traceback_util.include_filename(monitoring)
    assert traceback_util.include_filename(__file__)


def test_jax_rebuilds_a_registered_dataclass_from_its_own_modules():
    """`called_by_jax`: JAX's tree functions call a registered dataclass's
    `__init__` from jax's own modules; the user's call is the user's."""
    import dataclasses

    seen = []

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Pair:
        a: object

        def __init__(self, a):
            seen.append(internals.called_by_jax())
            self.a = a

    pair = Pair(1)
    jax.tree.map(lambda x: x, pair)
    jax.tree_util.tree_unflatten(jax.tree.structure(pair), [2])
    assert seen == [False, True, True]
