"""Logical axis names: `L(...)` and `BY_NAME` in annotations, resolved by
`jaxshard.axis_rules` (or flax's rules) exactly as flax linen resolves them."""

import dataclasses
import functools as ft
import pickle

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from jax import Array
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import jaxshard
from jaxshard import BY_NAME, Float, L
from jaxshard._annotations.logical import resolve
from jaxshard._config import normalise


LOGICAL = ["batch", "seq", "embed", "mlp", "heads", "kv", "vocab", "exp"]
MESH = ["dp", "fsdp", "tp", "sp", "ep"]

mesh_axes = st.one_of(
    st.none(),
    st.sampled_from(MESH),
    st.lists(st.sampled_from(MESH), min_size=1, max_size=3, unique=True).map(tuple),
)
rule_tables = st.lists(st.tuples(st.sampled_from(LOGICAL), mesh_axes), max_size=10)
logical_specs = st.lists(
    st.one_of(st.none(), st.sampled_from(LOGICAL), st.just(P.UNCONSTRAINED)),
    max_size=5,
).filter(lambda s: len({n for n in s if isinstance(n, str)}) == sum(
    isinstance(n, str) for n in s
))  # fmt: skip


@settings(max_examples=2000, deadline=None)
@given(rules=rule_tables, spec=logical_specs)
def test_resolution_is_flax_linens(rules, spec):
    ours, _ = resolve(tuple(spec), normalise(rules, unknown="replicated"))
    assert ours == nn.logical_to_mesh_axes(spec, rules)


def test_flax_semantics_written_out():
    rules = [("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z")]
    table = normalise(rules, unknown="replicated")
    # flax's docstring example: "features" finds X taken, "batch" keeps its first.
    spec, _ = resolve(("batch", "length", "heads", "features"), table)
    assert spec == P("X", None, "Y", None)
    # A rule to None assigns "unsharded", and later rules for that name are skipped.
    spec, _ = resolve(("batch",), normalise([("batch", None), ("batch", "X")]))
    assert spec == P(None)
    # Several mesh axes for one name, and a tuple of logical names on one dimension
    # (jaxshard's extension): the slots are resolved as flax would, then joined.
    table = normalise([("batch", ("dp", "fsdp")), ("seq", "sp"), ("embed", "fsdp")])
    assert resolve((("batch", "seq"), "embed"), table)[0] == P(
        ("dp", "fsdp", "sp"), None
    )
    with pytest.raises(jaxshard.AnnotationError, match="more than once"):
        resolve(("batch", "batch"), table)


# --- annotations --------------------------------------------------------------------


X = Float[Array, "batch seq embed", L("batch", None, "embed")]
Y = Float[Array, "batch seq embed", BY_NAME]
FSDP = [("batch", "fsdp"), ("embed", "fsdp"), ("mlp", "tp"), ("seq", None)]
FSDP_TP = [("batch", "fsdp"), ("embed", "tp"), ("mlp", "tp"), ("seq", None)]


def test_resolved_when_checked_not_when_written():
    assert repr(X) == "Float[Array, 'batch seq embed', L('batch', None, 'embed')]"
    with jaxshard.axis_rules(FSDP):
        assert jaxshard.partition_spec(X) == P("fsdp", None, None)  # fsdp taken
        assert jaxshard.partition_spec(Y) == P("fsdp", None, None)
        with jaxshard.axis_rules(FSDP_TP):  # the innermost wins
            assert jaxshard.partition_spec(X) == P("fsdp", None, "tp")
        assert jaxshard.partition_spec(X) == P("fsdp", None, None)
    with pytest.raises(jaxshard.AnnotationError, match="no axis rules are in force"):
        jaxshard.partition_spec(X)


def test_as_a_decorator():
    @jaxshard.axis_rules(FSDP_TP, name="fsdp_tp")
    def spec():
        return jaxshard.partition_spec(X)

    assert spec() == P("fsdp", None, "tp")
    with pytest.raises(jaxshard.AnnotationError):
        jaxshard.partition_spec(X)  # not in force outside the function


def test_by_name_leaves_unknown_and_literal_dimensions_unsharded():
    Z = Float[Array, "batch 3 other embed", BY_NAME]
    with jaxshard.axis_rules(FSDP_TP):
        assert jaxshard.partition_spec(Z) == P("fsdp", None, None, "tp")
        # Dimensions before a variadic one are named; none may come after it.
        assert jaxshard.partition_spec(Float[Array, "batch *rest", BY_NAME]) == P(
            "fsdp"
        )
    with pytest.raises(jaxshard.AnnotationError, match="after the variadic"):
        Float[Array, "*rest embed", BY_NAME]


def test_unknown_names():
    Z = Float[Array, "batch hidden", L("batch", "hidden")]
    with jaxshard.axis_rules(FSDP_TP, name="fsdp_tp"):
        with pytest.raises(jaxshard.AnnotationError) as caught:
            jaxshard.partition_spec(Z)
    message = str(caught.value)
    assert "'hidden'" in message and "'fsdp_tp'" in message
    assert "'batch', 'embed', 'mlp', 'seq'" in message  # the known names
    with jaxshard.axis_rules(FSDP_TP, unknown="replicated"):
        assert jaxshard.partition_spec(Z) == P("fsdp", None)


def test_bad_rules_and_specs():
    with pytest.raises(TypeError, match="takes a rule table"):
        jaxshard.axis_rules([("batch",)])
    with pytest.raises(TypeError, match="takes a rule table"):
        jaxshard.axis_rules([("batch", 3)])
    with pytest.raises(ValueError, match="`unknown` is"):
        jaxshard.axis_rules(FSDP, unknown="ignore")
    with pytest.raises(jaxshard.AnnotationError, match="logical axis names"):
        L("batch", 3)
    with pytest.raises(jaxshard.AnnotationError, match="has 3 entries"):
        Float[Array, "a b", L("a", "b", "c")]
    # No state left behind by the refusals.
    with pytest.raises(jaxshard.AnnotationError, match="no axis rules"):
        jaxshard.partition_spec(X)


def test_mappings_lists_and_maxtext_tables():
    maxtext = [["activation_batch", ["data", "fsdp"]], ["embed", "fsdp"], ["mlp", []]]
    table = normalise(maxtext)
    assert table.rules == (
        ("activation_batch", ("data", "fsdp")),
        ("embed", "fsdp"),
        ("mlp", ()),
    )
    assert normalise({"batch": "dp", "embed": None}).rules == (
        ("batch", "dp"),
        ("embed", None),
    )


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    """Rules as a code base keeps them in its config: a field per logical name."""

    batch: str | tuple | None = "fsdp"
    seq: str | None = None
    embed: str | None = "tp"
    mlp: str | tuple | None = ("tp",)


@dataclasses.dataclass(frozen=True)
class Config:
    layers: int = 2
    rules: ShardingRules = dataclasses.field(default_factory=ShardingRules)


def test_a_dataclass_of_rules():
    table = normalise(ShardingRules())
    assert table.rules == (
        ("batch", "fsdp"), ("seq", None), ("embed", "tp"), ("mlp", ("tp",)),
    )  # fmt: skip
    assert table.name == "ShardingRules"  # what messages call it
    with jaxshard.axis_rules(ShardingRules()):
        assert jaxshard.partition_spec(X) == P("fsdp", None, "tp")
    with pytest.raises(TypeError, match="takes a rule table") as caught:
        jaxshard.axis_rules(Config())  # the config, not its rules
    assert "whose 'layers' is 2" in str(caught.value)


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_rules_stated_once_at_an_entry_point(axis_types):
    """`axis_rules(lambda cfg: cfg.rules)` on the code base's entry points: each
    call runs under its own config's table, with no `with` at any caller, and a
    jitted step is traced again under another config's."""
    m = fsdp_tp(axis_types)

    @jaxshard.axis_rules(lambda cfg: cfg.rules)
    @ft.partial(jax.jit, static_argnames="cfg")
    @jaxshard.jaxtyped
    def forward(x: X, cfg: Config) -> X:
        return x * 2

    x = jax.device_put(jnp.ones((8, 4, 16)), NamedSharding(m, P("fsdp", None, "tp")))
    with jax.set_mesh(m):
        forward(x, Config())
        forward(x, cfg=Config())
        other = Config(rules=ShardingRules(embed=None))
        with pytest.raises(jaxshard.ShardingError, match="'ShardingRules'"):
            forward(x, other)
        assert jaxshard._config.current().rules is None  # nothing left behind
    with pytest.raises(TypeError, match="names 'config', which"):
        jaxshard.axis_rules(lambda config: config.rules)(layer)
    with pytest.raises(TypeError, match="decorates a function"):
        with jaxshard.axis_rules(lambda cfg: cfg.rules):
            pass


def test_pickles():
    # (jax.Array itself does not pickle on every jax, so numpy's array type here.)
    for spec in (L("batch", None, "embed"), BY_NAME):
        ann = Float[np.ndarray, "batch seq embed", spec]
        back = pickle.loads(pickle.dumps(ann))
        assert repr(back) == repr(ann)
        with jaxshard.axis_rules(FSDP_TP):
            assert jaxshard.partition_spec(back) == P("fsdp", None, "tp")


def test_a_table_is_one_object_hashed_once():
    """Every `jax.jit` call hashes and compares the table in force (it is part of the
    cache key): equal tables are one object, whose hash survives pickling unstored
    (a string's hash differs between processes), and flax's table is normalised once
    while it stays in force."""
    from jaxshard._annotations.logical import active_rules

    table = normalise(FSDP_TP, name="fsdp_tp")
    assert normalise([list(rule) for rule in FSDP_TP], name="fsdp_tp") is table
    assert normalise(FSDP_TP) is not table  # not equal: unnamed
    back = pickle.loads(pickle.dumps(table))
    assert back == table and hash(back) == hash(table)
    assert "_hash" not in pickle.loads(pickle.dumps(table)).__getstate__()
    with nn.logical_axis_rules(FSDP_TP):
        first = active_rules()
        assert (
            first is active_rules() and first.source == "flax's nn.logical_axis_rules"
        )
        with nn.logical_axis_rules(FSDP):
            assert active_rules().rules == normalise(FSDP).rules
        assert active_rules() is first
    assert active_rules() is None


# --- checks ---------------------------------------------------------------------------


def layer(x: X) -> X:
    return x * 2


def fsdp_tp(axis_types: str = "explicit") -> jax.sharding.Mesh:
    kind = AxisType.Explicit if axis_types == "explicit" else AxisType.Auto
    return jax.make_mesh((4, 2), ("fsdp", "tp"), axis_types=(kind, kind))


@pytest.mark.parametrize("axis_types", ["explicit", "auto"])
def test_jit_is_traced_again_under_new_rules(axis_types):
    """The rules are part of jit's cache key: the second call is checked under the
    second table, not served from the first call's trace."""
    m = fsdp_tp(axis_types)
    step = jax.jit(jaxshard.jaxtyped(layer))
    with jax.set_mesh(m):
        x = jax.device_put(
            jnp.ones((8, 4, 16)), NamedSharding(m, P("fsdp", None, "tp"))
        )
        with jaxshard.axis_rules(FSDP_TP, name="fsdp_tp"):
            step(x)
        with jaxshard.axis_rules(FSDP, name="fsdp"):
            with pytest.raises(jaxshard.ShardingError) as caught:
                step(x)
        with jaxshard.axis_rules(FSDP_TP, name="fsdp_tp"):
            step(x)
    message = str(caught.value)
    # Both forms: the logical spec, the rules that applied, the resolved spec, and
    # the layout found.
    assert "L('batch', None, 'embed')" in message
    assert (
        "under the axis rules 'fsdp' (batch -> 'fsdp'; embed: 'fsdp' already taken)"
        in message
    )
    assert "expects P('fsdp', None, None) (float32[8@fsdp,4,16])" in message
    assert "sharded as P('fsdp', None, 'tp') (float32[8@fsdp,4,16@tp])" in message


def test_eager_and_flax_rules():
    m = fsdp_tp()
    checked = jaxshard.jaxtyped(layer)
    with jax.set_mesh(m):
        x = jax.device_put(
            jnp.ones((8, 4, 16)), NamedSharding(m, P("fsdp", None, "tp"))
        )
        with nn.logical_axis_rules(FSDP_TP):  # flax's own rules apply
            checked(x)
        with nn.logical_axis_rules(FSDP):
            with pytest.raises(jaxshard.ShardingError, match="nn.logical_axis_rules"):
                checked(x)
            with jaxshard.axis_rules(FSDP_TP):  # jaxshard's win over flax's
                checked(x)


def test_flax_rules_leave_a_name_they_do_not_mention_unsharded():
    """Under flax's own rules, a logical name no rule mentions is unsharded, as
    flax lays it out (`logical_to_mesh_axes`); under jaxshard's, an error by
    default."""
    spec = Float[Array, "embed kv", L("embed", "kv")]
    with nn.logical_axis_rules(FSDP):
        assert jaxshard.partition_spec(spec) == P("fsdp", None)
        with jaxshard.axis_rules(FSDP):
            with pytest.raises(jaxshard.AnnotationError, match="'kv'"):
                jaxshard.partition_spec(spec)


def test_a_wrong_rule_is_named():
    m = fsdp_tp()
    checked = jaxshard.jaxtyped(layer)
    with jax.set_mesh(m):
        x = jax.device_put(
            jnp.ones((8, 4, 16)), NamedSharding(m, P("fsdp", None, "tp"))
        )
        with jaxshard.axis_rules([("batch", "fsdp"), ("embed", "model")], name="typo"):
            with pytest.raises(jaxshard.ShardingError) as caught:
                checked(x)
    message = str(caught.value)
    assert "names mesh axis 'model'" in message and "embed -> 'model'" in message


# --- everywhere specs go ------------------------------------------------------------


def test_shardings_abstract_args_and_verify_take_rules():
    m = fsdp_tp("auto")
    ins, out = jaxshard.shardings(layer, m, rules=FSDP_TP)
    assert ins[0].spec == P("fsdp", None, "tp") and out.spec == P("fsdp", None, "tp")
    (x,) = jaxshard.abstract_args(
        layer, m, {"batch": 8, "seq": 4, "embed": 16}, rules=FSDP
    )
    assert x.sharding.spec == P("fsdp", None, None)
    report = jaxshard.verify(
        layer, mesh=m, dims={"batch": 8, "seq": 4, "embed": 16}, rules=FSDP_TP
    )
    assert report.ok and report.rows[0].expected == P("fsdp", None, "tp")
    assert report.rows[0].annotation == repr(X)
    with pytest.raises(jaxshard.AnnotationError, match="no axis rules"):
        jaxshard.shardings(layer, m)  # nothing left in force by the calls above


def test_shard_map_reads_the_rules_at_each_call():
    m = fsdp_tp("explicit")

    @jaxshard.shard_map(mesh=m)
    def local(
        x: Float[Array, "batch embed", BY_NAME],
    ) -> Float[Array, "batch embed", BY_NAME]:
        return x * 2

    with jax.set_mesh(m):
        with jaxshard.axis_rules(FSDP_TP):
            x = jax.device_put(jnp.ones((8, 4)), NamedSharding(m, P("fsdp", "tp")))
            assert local(x).sharding.spec == P("fsdp", "tp")
        with jaxshard.axis_rules(FSDP):
            x = jax.device_put(jnp.ones((8, 4)), NamedSharding(m, P("fsdp")))
            assert local(x).sharding.spec == P("fsdp", None)
    fixed = jaxshard.shard_map(local.__wrapped__, mesh=m, rules=FSDP)
    with jax.set_mesh(m):
        assert fixed(x).sharding.spec == P("fsdp", None)


def test_strategies_take_rules():
    from hypothesis import find

    from jaxshard import strategies as js

    m = fsdp_tp("explicit")
    drawn = find(js.arrays(X, m, rules=FSDP_TP), lambda a: True)
    assert drawn.sharding.spec == P("fsdp", None, "tp")
    from hypothesis.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="no axis rules"):
        js.arrays(X, m)


def test_equinox_module_fields():
    import equinox as eqx

    class Layer(eqx.Module):
        w: Float[Array, "embed mlp", BY_NAME]

    m = fsdp_tp("explicit")
    with jax.set_mesh(m), jaxshard.axis_rules(FSDP_TP):
        good = Layer(jax.device_put(jnp.ones((8, 4)), NamedSharding(m, P("tp"))))
        jaxshard.check_tree(good)
        bad = Layer(jax.device_put(jnp.ones((8, 4)), NamedSharding(m, P())))
        with pytest.raises(
            jaxshard.ShardingError,
            match=r"Layer\.w.*embed -> 'tp'; mlp: 'tp' already taken",
        ):
            jaxshard.check_tree(bad)


MODEL = """
from jax import Array
from jaxshard import BY_NAME, Float

RULES = [("batch", "fsdp"), ("embed", "tp")]
WRONG = [("batch", "fsdp"), ("embed", "model")]

X = Float[Array, "batch embed", BY_NAME]

def layer(x: X) -> X:
    return x * 2
"""


def test_cli_rules(tmp_path):
    import os
    import subprocess
    import sys

    (tmp_path / "model.py").write_text(MODEL)

    def run(*args):
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        out = subprocess.run(
            [sys.executable, "-m", "jaxshard", "verify", "model:layer", "--mesh",
             "fsdp=4,tp=2", "--dim", "batch=8", "--dim", "embed=4", *args],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        return out.returncode, out.stdout, out.stderr

    code, out, err = run("--rules", "model:RULES")
    assert code == 0, err
    assert "P('fsdp', 'tp')" in out
    code, out, err = run("--rules", "model:WRONG")  # the inputs cannot be placed
    assert code == 2 and "mesh axis 'model'" in err and "embed -> 'model'" in err
    code, out, err = run()
    assert code == 2 and "no axis rules" in err
    code, out, err = run("--rules", "model:X")
    assert code == 2 and "--rules model:X" in err and "takes a rule table" in err


def test_plugin_default_rules(pytester, monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    pytester.makepyfile(
        model=MODEL,
        test_it="""
import jaxshard
from jax.sharding import PartitionSpec as P
from model import layer

def test_rules():
    ann = layer.__annotations__["x"]
    assert jaxshard.partition_spec(ann) == P("fsdp", "tp")
""",
    )
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--jaxshard-rules", "model:RULES"
    )
    result.assert_outcomes(passed=1)
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--jaxshard-rules", "model:nothing"
    )
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--jaxshard-rules model:nothing*no attribute*"])
    pytester.makepyfile(rules="def table():\n    raise KeyError('mlp')\n")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--jaxshard-rules", "rules:table"
    )
    assert result.ret != 0  # a usage error, in one line
    result.stderr.fnmatch_lines(
        ["*--jaxshard-rules rules:table: calling rules:table() raised KeyError*"]
    )
    assert "Traceback" not in result.stderr.str()


def test_sharding_off_reads_no_logical_spec(explicit_mesh, auto_mesh):
    """With the sharding side off, a logical annotation is not resolved anywhere:
    no rules need to be in force, eagerly, in jit, in eval_shape or in shard_map."""

    @jaxshard.jaxtyped
    def f(x: Float[Array, "b d", L("batch", None)]) -> Float[Array, "b d", L("batch")]:
        return x * 2

    x = jnp.ones((8, 4))
    with jaxshard.config(sharding="off"):
        assert f(x).shape == jax.jit(f)(x).shape == jax.eval_shape(f, x).shape
        for m in (explicit_mesh, auto_mesh):
            mapped = jax.shard_map(f, mesh=m, in_specs=P("dp"), out_specs=P("dp"))
            placed = jax.device_put(x, NamedSharding(m, P("dp")))
            assert jax.jit(mapped)(placed).shape == (8, 4)
    with pytest.raises(jaxshard.ShardingError, match="no axis rules are in force"):
        jax.jit(f)(x)
