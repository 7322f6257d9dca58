"""Sharding contracts on PyTorch tensors on torchax's 'jax' device: eagerly, inside
`torchax.compile` (of a function and of a module) and `torchax.interop.jax_jit`, in
value checks, strategies and `verify`."""

import os
import subprocess
import sys
from pathlib import Path

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from beartype import beartype
from helpers import hlo_ops
from hypothesis import given, settings
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import BFloat16, Bool, Float, Int, Num, Shaped, strategies as js


# The Python 3.11 leg of the test matrix installs torch 2.13 (CPU) and torchax, and
# sets this: there a missing torchax is a failure, not a skip.
if os.environ.get("JAXSHARD_REQUIRE_TORCHAX"):
    import torch
    import torchax
else:
    _reason = (
        "torchax is not installed: the torchax tests run in the Python 3.11 leg of "
        "`nox -s tests`, which installs torch==2.13.0 (CPU) and torchax"
    )
    torch = pytest.importorskip("torch", reason=_reason)
    torchax = pytest.importorskip("torchax", reason=_reason)
import torchax.interop  # noqa: E402


Tensor = torch.Tensor


@pytest.fixture(autouse=True)
def fresh_prng_key():
    """torchax threads its PRNG key through every compiled call, which commits it to
    that call's mesh: give each test an uncommitted one."""
    torchax.default_env().prng_key = jax.random.key(0)


def on(mesh, x, spec):
    """`x` as a torchax tensor laid out by `spec` on `mesh`."""
    array = jax.device_put(jnp.asarray(x), NamedSharding(mesh, spec))
    return torchax.default_env().j2t_iso(array)


def explicit(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(names))


def auto(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


X = Float[Tensor, "b d", P("dp", "tp")]


@jaxshard.jaxtyped(typechecker=beartype)
def scale(x: X) -> X:
    return x * 2


# --- eagerly ------------------------------------------------------------------------


DTYPES = [
    (Float, np.float32),
    (Float, np.float16),
    (BFloat16, jnp.bfloat16),
    (Int, np.int32),
    (Int, np.int8),
    (Bool, np.bool_),
    (Num, np.int64),
    (Shaped, np.float32),
]


@pytest.mark.parametrize("dtype,np_dtype", DTYPES)
def test_eager_every_dtype(dtype, np_dtype, mesh):
    annotation = dtype[Tensor, "b d", P("dp", "tp")]
    value = np.ones((8, 4), dtype=np.float32).astype(np_dtype)
    good = on(mesh, value, P("dp", "tp"))
    assert isinstance(good, torch.Tensor) and isinstance(good, annotation)
    assert not isinstance(on(mesh, value, P("tp", "dp")), annotation)
    assert not isinstance(on(mesh, value, P()), annotation)


def reasons(error: Exception) -> list[str]:
    """The reasons a ShardingError gives, without the function: its first line's,
    then any others under "Sharding:"."""
    text = str(error)
    more = text.split("Sharding:\n", 1)[1].splitlines() if "Sharding:\n" in text else []
    first = text.splitlines()[0].split("': ", 1)[1]
    return [first] + [x.split("': ", 1)[1] for x in more if x.startswith("- ")]


def test_eager_message_is_the_same_as_for_jax_arrays(mesh):
    array = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(None, "tp")))

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: Float[jax.Array, "b d", P("dp", "tp")]) -> None:
        pass

    with pytest.raises(jaxshard.ShardingError) as for_jax:
        f(array)
    with pytest.raises(jaxshard.ShardingError) as for_torch:
        scale(torchax.default_env().j2t_iso(array))
    assert reasons(for_torch.value) == reasons(for_jax.value)
    assert "P(None, 'tp')" in reasons(for_torch.value)[0]


def test_eager_compact_syntax(mesh):
    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: Float[Tensor, "[b/dp] [d/tp]"]) -> Float[Tensor, "b d"]:
        return x + 1

    with torchax.default_env():
        out = f(on(mesh, np.zeros((8, 4), np.float32), P("dp", "tp")))
        assert isinstance(out, torch.Tensor)
        with pytest.raises(jaxshard.ShardingError, match="expects P\\('dp', 'tp'\\)"):
            f(on(mesh, np.zeros((8, 4), np.float32), P(None, "tp")))


def test_eager_shape_and_dtype_are_torch_s(mesh):
    good = on(mesh, np.zeros((8, 4), np.float32), P("dp", "tp"))
    with torchax.default_env():
        as_int = good.to(torch.int32)
    assert as_int.dtype == torch.int32
    with pytest.raises(jaxshard.TypeCheckError, match="dtype|Float"):
        scale(as_int)
    with pytest.raises(jaxshard.TypeCheckError):
        scale(on(mesh, np.zeros((8,), np.float32), P("dp")))


def test_views():
    """A slice is a `torchax.view.View`: its sharding is that of the array its
    `.jax()` computes."""
    mesh = auto((4, 2), ("dp", "tp"))  # JAX asks Explicit slices for a sharding
    t = on(mesh, np.arange(64, dtype=np.float32).reshape(16, 4), P("dp", "tp"))
    with torchax.default_env():
        view = t[:8]
    assert not isinstance(view, type(t))
    sharding = view.jax().sharding
    assert isinstance(sharding, NamedSharding)
    assert isinstance(view, Float[Tensor, "8 4", sharding.spec])
    other = P("tp", "dp")
    assert not sharding.is_equivalent_to(NamedSharding(mesh, other), 2)
    assert not isinstance(view, Float[Tensor, "8 4", other])
    assert not isinstance(view, Float[Tensor, "16 4", sharding.spec])


def test_cpu_tensor_says_how_to_move_it():
    with pytest.raises(jaxshard.ShardingError) as e:
        scale(torch.zeros(8, 4))
    message = str(e.value)
    assert "'cpu'" in message and "torchax's 'jax' device" in message
    assert "j2t_iso(jax.device_put(" in message and "apply_jax" in message


def test_cpu_tensor_without_spec_is_jaxtyping_s():
    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: Float[Tensor, "b d"]) -> Float[Tensor, "b d"]:
        return x

    f(torch.zeros(8, 4))


# --- compiled -----------------------------------------------------------------------


@jaxshard.jaxtyped(typechecker=beartype)
def scale_jax(x: Float[jax.Array, "b d", P("dp", "tp")]) -> Float[jax.Array, "b d"]:
    return x * 2


def violation(error: Exception) -> str:
    """What a ShardingError says of parameter 'x', without the function's name and
    with the annotation's array type as `T`."""
    # The line in full (when several failed, the first line names the likely cause
    # in short and each is listed); a single failure is the first line.
    lines = str(error).splitlines()
    listed = [x for x in lines[1:] if x.startswith("- ") and "parameter 'x'" in x]
    text = listed[0] if listed else lines[0]
    text = text[text.index("parameter 'x'") :]
    return text.replace("[Tensor,", "[T,").replace("[Array,", "[T,")


@pytest.mark.parametrize("compile", ["compile", "jax_jit"])
@pytest.mark.parametrize("make", [explicit, auto])
def test_inside_compiled_function(compile, make):
    """At trace time on Explicit axes, when XLA compiles on Auto axes; the message is
    the one a jax.Array gets under jax.jit."""
    mesh = make((4, 2), ("dp", "tp"))
    wrap = torchax.compile if compile == "compile" else torchax.interop.jax_jit
    traced = []

    def f(x: X) -> X:
        traced.append(type(x.jax()))
        return scale(x)

    good = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("dp", "tp")))
    bad = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P(None, "tp")))
    env = torchax.default_env()
    with jax.set_mesh(mesh):
        out = wrap(f)(env.j2t_iso(good))
        assert isinstance(out, torch.Tensor)
        np.testing.assert_array_equal(np.asarray(out.jax()), 2)
        assert out.jax().sharding.is_equivalent_to(good.sharding, 2)
        with pytest.raises(jaxshard.ShardingError) as for_torch:
            wrap(f)(env.j2t_iso(bad))
        with pytest.raises(jaxshard.ShardingError) as for_jax:
            jax.jit(scale_jax)(bad)
    assert all(issubclass(t, jax.core.Tracer) for t in traced) and len(traced) == 2
    assert violation(for_torch.value) == violation(for_jax.value)
    for error in (for_torch.value, for_jax.value):
        # On Auto axes found when XLA compiled; on Explicit ones at trace time, as
        # an eager call's.
        assert ("when XLA compiled" in str(error)) == (make is auto)


def test_one_compiled_function_on_explicit_then_auto_axes():
    """The same compiled function under an Explicit mesh, then under an Auto one with
    the same shapes and axis names: torchax's PRNG key, left on the Explicit mesh by
    the first call, sits beside the Auto arrays of the second, which JAX takes, with
    jaxshard's annotations as without them."""
    compiled = torchax.compile(scale)
    for make in (explicit, auto):
        mesh = make((4, 2), ("dp", "tp"))
        with jax.set_mesh(mesh):
            out = compiled(on(mesh, np.ones((8, 4), np.float32), P("dp", "tp")))
            assert out.jax().sharding.is_equivalent_to(
                NamedSharding(mesh, P("dp", "tp")), 2
            )
            with pytest.raises(jaxshard.ShardingError):
                compiled(on(mesh, np.ones((8, 4), np.float32), P(None, "tp")))


@jaxshard.jaxtyped(typechecker=beartype)
def up(
    x: Float[Tensor, "[b/dp] d"], w: Float[Tensor, "[h/tp] d"]
) -> Float[Tensor, "[b/dp] [h/tp]"]:
    return torch.relu(torch.nn.functional.linear(x, w))


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 16, bias=False)
        self.down = torch.nn.Linear(16, 4)

    @jaxshard.jaxtyped(typechecker=beartype)
    def forward(
        self, x: Float[Tensor, "b d", P("dp", None)]
    ) -> Float[Tensor, "b d", P("dp", None)]:
        return self.down(up(x, self.up.weight))


def placed(mesh, up_spec=P("tp", None)) -> MLP:
    """An MLP on the 'jax' device, its first weight laid out by `up_spec`."""
    with torchax.default_env():
        model = MLP().to("jax")
        model.up.weight.apply_jax_(jax.device_put, NamedSharding(mesh, up_spec))
    return model


def test_compiled_module():
    """Torch ops contract over sharded dimensions, which an Explicit mesh refuses
    without an output sharding: an Auto mesh, where XLA chooses."""
    mesh = auto((4, 2), ("dp", "tp"))
    with torchax.default_env(), jax.set_mesh(mesh):
        compiled = torchax.compile(placed(mesh))
        out = compiled(on(mesh, np.ones((8, 4), np.float32), P("dp", None)))
        assert tuple(out.shape) == (8, 4)
        with pytest.raises(jaxshard.ShardingError, match=r"P\('dp', None\)"):
            compiled(on(mesh, np.ones((8, 4), np.float32), P(None, "dp")))
        wrong = torchax.compile(placed(mesh, P(None, "tp")))
        with pytest.raises(jaxshard.ShardingError, match="parameter 'w'") as e:
            wrong(on(mesh, np.ones((8, 4), np.float32), P("dp", None)))
    assert "when XLA compiled" in str(e.value)


def test_compiled_module_explicit():
    mesh = explicit((4, 2), ("dp", "tp"))

    class Scale(torch.nn.Module):
        @jaxshard.jaxtyped(typechecker=beartype)
        def forward(self, x: X) -> X:
            return x * 2

    with torchax.default_env(), jax.set_mesh(mesh):
        compiled = torchax.compile(Scale())
        out = compiled(on(mesh, np.ones((8, 4), np.float32), P("dp", "tp")))
        np.testing.assert_array_equal(np.asarray(out.jax()), 2)
        with pytest.raises(jaxshard.ShardingError, match="at trace time|P\\(None"):
            compiled(on(mesh, np.ones((8, 4), np.float32), P(None, "tp")))


def test_compiled_program_is_unchanged(mesh):
    def plain(x):
        return x * 2

    with jax.set_mesh(mesh):
        x = on(mesh, np.ones((8, 4), np.float32), P("dp", "tp")).jax()
        texts = [
            jax.jit(torchax.interop.jax_view(f)).lower(x).compile().as_text()
            for f in (plain, scale)
        ]
    assert hlo_ops(texts[0]) == hlo_ops(texts[1])


def test_shardings_feed_jax_jit():
    mesh = auto((4, 2), ("dp", "tp"))

    @jaxshard.jaxtyped(typechecker=beartype)
    def f(x: X) -> Float[Tensor, "b d", P(None, "dp")]:
        return x + 1

    ins, out = jaxshard.shardings(f, mesh)
    jitted = torchax.interop.jax_jit(
        f, kwargs_for_jax_jit={"in_shardings": ins, "out_shardings": out}
    )
    with jax.set_mesh(mesh):
        y = jitted(on(mesh, np.ones((8, 4), np.float32), P("dp", "tp")))
        np.testing.assert_array_equal(np.asarray(y.jax()), 2)
    assert y.jax().sharding.is_equivalent_to(NamedSharding(mesh, P(None, "dp")), 2)
    unjitted = torchax.interop.jax_jit(f)
    with jax.set_mesh(mesh), pytest.raises(jaxshard.ShardingError, match="return"):
        unjitted(on(mesh, np.ones((8, 4), np.float32), P("dp", "tp")))


# --- value checks -------------------------------------------------------------------


def test_checks_on_torchax_tensors(mesh):
    def f(x):
        jaxshard.check(x.sum() > 0, "sum {s} not positive", s=x.sum())
        jaxshard.check_finite(x, "x")
        jaxshard.check_range(x, lo=0.0)
        return x * 2

    step = jaxshard.checked(torchax.compile(f))
    with jax.set_mesh(mesh):
        step(on(mesh, np.ones((8, 4), np.float32), P("dp", "tp")))
        bad = np.ones((8, 4), np.float32)
        bad[3, 1] = np.nan
        with pytest.raises(jaxshard.CheckError) as e:
            step(on(mesh, bad, P("dp", "tp")))
    message = str(e.value)
    assert message.startswith("3 checks failed in f:")
    assert (
        "sum 0.0 not positive" not in message and "first at element [3, 1]" in message
    )


def test_check_refuses_a_cpu_tensor():
    with pytest.raises(TypeError, match="'jax' device"):
        jaxshard.check_finite(torch.zeros(3))


# --- strategies ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [Float, Int, Bool, BFloat16, Num, Shaped])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_strategies_draw_sharded_tensors(dtype, data):
    mesh = data.draw(js.meshes())
    spec = data.draw(js.partition_specs(2, mesh))
    annotation = dtype[Tensor, "b d", spec]
    t = data.draw(js.arrays(annotation, mesh))
    assert isinstance(t, torch.Tensor) and isinstance(t, annotation)
    assert t.jax().sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)


# --- verify -------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["cpu", "tpu"])
def test_verify_compiled_module(where):
    """The forward's contracts, with the weights as abstract inputs laid out as they
    are: on the CPU mesh they live on, or on a TPU pod's mesh of the same axes."""
    mesh = auto((4, 2), ("dp", "tp"))
    target = (
        mesh if where == "cpu" else jaxshard.tpu_mesh("v5e:2x4", {"dp": 4, "tp": 2})
    )
    compiled = torchax.compile(placed(mesh))
    report = jaxshard.verify(compiled, mesh=target, dims={"b": 64, "d": 4})
    assert report.ok and report.function == "MLP.forward"
    weight = report.inputs["self['up.weight']"]
    assert weight.shape == (16, 4) and weight.sharding.spec == P("tp", None)
    assert report.inputs["self['down.bias']"].sharding.spec == P()
    assert {r.function for r in report.rows} >= {"MLP.forward", "up"}
    wrong = torchax.compile(placed(mesh, P(None, "tp")))
    with pytest.raises(jaxshard.ShardingError, match="up, parameter 'w'"):
        jaxshard.verify(wrong, mesh=target, dims={"b": 64, "d": 4})
    # The weights count towards the sharding budgets.
    report = jaxshard.verify(
        compiled,
        mesh=target,
        dims={"b": 64, "d": 4},
        max_replicated_bytes=0,
        raise_on_error=False,
    )
    assert "down.weight" in str(report.violations)


def test_verify_names_a_weight_on_axes_the_mesh_lacks():
    mesh = auto((4, 2), ("dp", "tp"))
    compiled = torchax.compile(placed(mesh))
    other = auto((8,), ("dp",))
    with pytest.raises(jaxshard.ModelError, match="'up.weight'.*\\['tp'\\]"):
        jaxshard.verify(compiled, mesh=other, dims={"b": 8, "d": 4})


# --- cost ---------------------------------------------------------------------------


def test_import_jaxshard_imports_no_torch():
    code = (
        "import sys, jaxshard; print('torch' in sys.modules, 'torchax' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "False"]


# --- docs ---------------------------------------------------------------------------


def test_the_docs_program_runs(tmp_path):
    """docs/torchax.md's program, which `nox -s docs` (without torch) does not run:
    it passes, then raises at the line that says so."""
    root = Path(__file__).parent.parent
    text = (root / "docs" / "torchax.md").read_text()
    marker = "tests/test_torchax.py runs it -->\n```python\n"
    code = text.split(marker, 1)[1].split("```", 1)[0]
    script = tmp_path / "block.py"
    script.write_text(code)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env
    )
    last = [x for x in run.stderr.splitlines() if x.startswith("jaxshard.")][-1:]
    assert run.returncode and last, run.stderr[-2000:]
    assert last[0].startswith("jaxshard.ShardingError:")
    assert "gelu(y)" in run.stderr and "gelu(x)" not in run.stderr
