"""A transformer whose weights and activations state their shardings, verified for TPU
pods on a machine without a TPU.

The mesh has three axes: "dp" (data parallel: the batch is split, weights are
replicated), "fsdp" (fully sharded data parallel: the batch is split and so are the
weights, which XLA gathers before each layer uses them) and "tp" (tensor parallel:
attention heads and MLP hidden units are split). `jaxshard.verify` compiles the model
for a 256-chip TPU v5e pod and a 64-chip TPU v5p slice with libtpu's compiler and
checks every annotation against the sharding XLA chose. The v5e pod's report is
checked against its golden snapshot, committed next to this file: a change that alters
a layout, adds a collective or grows the memory per device by more than 5% fails.
Then a block whose return annotation forgets that "fsdp" splits the batch too shows
what a violation looks like.

Run: `python examples/transformer.py` (needs libtpu: `pip install 'jaxshard[tpu]'`;
without it, 8 simulated CPU devices stand in for the pods, and no snapshot is
compared). The meshes have Auto axes, as most pod code uses; `--explicit` verifies the
same model on Explicit axes. After an intended change, `--update-snapshot` rewrites the
snapshot.
"""

import importlib.util
import os
import pathlib
import sys
from typing import Any, NamedTuple


# There is no TPU to run on: libtpu only compiles. JAX must not look for one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from beartype import beartype  # noqa: E402
from jax import Array  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard import Float  # noqa: E402


BATCH = ("dp", "fsdp")  # the batch is split over both data-parallel axes
X = Float[Array, "batch seqlen d", P(BATCH, None, None)]  # the residual stream
Heads = Float[Array, "batch seqlen heads hd", P(BATCH, None, "tp", None)]
Hidden = Float[Array, "batch seqlen hidden", P(BATCH, None, "tp")]
# The model's size; "batch", "seqlen" and "layers" are chosen when it is verified.
DIMS = {"d": 4096, "heads": 32, "hd": 128, "hidden": 16384}


class Block(NamedTuple):
    """One layer's weights: split over "tp" like the activations they make, and over
    "fsdp" on the other dimension, so that each device holds 1/(fsdp*tp) of them."""

    ln1: Float[Array, "d", P(None)]
    wq: Float[Array, "d heads hd", P("fsdp", "tp", None)]
    wk: Float[Array, "d heads hd", P("fsdp", "tp", None)]
    wv: Float[Array, "d heads hd", P("fsdp", "tp", None)]
    wo: Float[Array, "heads hd d", P("tp", None, "fsdp")]
    ln2: Float[Array, "d", P(None)]
    w1: Float[Array, "d hidden", P("fsdp", "tp")]
    w2: Float[Array, "hidden d", P("tp", "fsdp")]


class Stack(NamedTuple):
    """Every layer's weights, stacked along an unsplit leading axis for `lax.scan`
    (which compiles one layer however deep the model): `Block`'s fields, in order."""

    ln1: Float[Array, "layers d", P(None, None)]
    wq: Float[Array, "layers d heads hd", P(None, "fsdp", "tp", None)]
    wk: Float[Array, "layers d heads hd", P(None, "fsdp", "tp", None)]
    wv: Float[Array, "layers d heads hd", P(None, "fsdp", "tp", None)]
    wo: Float[Array, "layers heads hd d", P(None, "tp", None, "fsdp")]
    ln2: Float[Array, "layers d", P(None, None)]
    w1: Float[Array, "layers d hidden", P(None, "fsdp", "tp")]
    w2: Float[Array, "layers hidden d", P(None, "tp", "fsdp")]


# --- layouts ------------------------------------------------------------------------
# On Auto axes XLA chooses every intermediate layout, and `with_sharding_constraint`
# pins down the ones a model cares about. On Explicit axes a layout is part of each
# value's type: JAX wants the FSDP all-gather spelled out (`reshard`) and the layout of
# a contraction over a split dimension named (`out_sharding`). With these two helpers
# the model compiles on either.


def explicit() -> bool:
    return AxisType.Explicit in jax.sharding.get_abstract_mesh().axis_types


def einsum(subscripts: str, *operands: Array, out: Any) -> Array:
    """`jnp.einsum`, with its result laid out as the annotation `out` says."""
    spec = jaxshard.partition_spec(out)
    if explicit():
        return jnp.einsum(subscripts, *operands, out_sharding=spec)
    return jax.lax.with_sharding_constraint(jnp.einsum(subscripts, *operands), spec)


def gathered(w: Array, spec: P) -> Array:
    """The weight `w`, whole over "fsdp" (`spec` is its layout without "fsdp")."""
    return jax.sharding.reshard(w, spec) if explicit() else w


# --- the model ----------------------------------------------------------------------


def norm(x: Array, scale: Array) -> Array:
    x = x - x.mean(-1, keepdims=True)
    return x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * scale


@jaxshard.jaxtyped(typechecker=beartype)
def project(x: X, w: Float[Array, "d heads hd", P("fsdp", "tp", None)]) -> Heads:
    return einsum("bsd,dhk->bshk", x, gathered(w, P(None, "tp", None)), out=Heads)


@jaxshard.jaxtyped(typechecker=beartype)
def attend(q: Heads, k: Heads, v: Heads) -> Heads:
    """Causal softmax attention, each device computing its own heads."""
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / jnp.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    return jnp.einsum("bhqs,bshk->bqhk", weights, v)


@jaxshard.jaxtyped(typechecker=beartype)
def attention(p: Block, x: X) -> X:
    h = norm(x, p.ln1)
    heads = attend(project(h, p.wq), project(h, p.wk), project(h, p.wv))
    wo = gathered(p.wo, P("tp", None, None))
    return x + einsum("bshk,hkd->bsd", heads, wo, out=X)  # a sum over "tp"


@jaxshard.jaxtyped(typechecker=beartype)
def mlp(p: Block, x: X) -> X:
    w1, w2 = gathered(p.w1, P(None, "tp")), gathered(p.w2, P("tp", None))
    h = jax.nn.gelu(einsum("bsd,dh->bsh", norm(x, p.ln2), w1, out=Hidden))
    return x + einsum("bsh,hd->bsd", h, w2, out=X)  # a sum over "tp"


@jaxshard.jaxtyped(typechecker=beartype)
def block(p: Block, x: X) -> X:
    return mlp(p, attention(p, x))


@jaxshard.jaxtyped(typechecker=beartype)
def model(params: Stack, x: X) -> X:
    def layer(x, weights):
        return block(Block(*weights), x), None

    x, _ = jax.lax.scan(layer, x, params)
    return x


# Someone forgot that "fsdp" splits the batch too. Code that trusted this annotation
# would gather the block's output over "fsdp", to no purpose.
@jaxshard.jaxtyped(typechecker=beartype)
def block_misannotated(
    p: Block, x: X
) -> Float[Array, "batch seqlen d", P("dp", None, None)]:
    return block(p, x)


# --- verifying ----------------------------------------------------------------------


POD = "v5e:16x16"


def meshes(axis_types: str) -> list[jax.sharding.Mesh]:
    """A 256-chip TPU v5e pod and a 64-chip TPU v5p slice, or simulated CPU devices."""
    if importlib.util.find_spec("libtpu") is None:
        print(
            "libtpu (XLA's TPU compiler) is not installed; `pip install "
            "'jaxshard[tpu]'` to compile for TPU pods on this machine. Meanwhile, 8 "
            "simulated CPU devices stand in for them.\n"
        )
        jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backends
        types = (AxisType.Explicit if axis_types == "explicit" else AxisType.Auto,) * 3
        return [jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"), axis_types=types)]
    return [
        jaxshard.tpu_mesh(POD, {"dp": 4, "fsdp": 8, "tp": 8}, axis_types=axis_types),
        jaxshard.tpu_mesh(
            "v5p:4x4x4", {"dp": 4, "fsdp": 4, "tp": 4}, axis_types=axis_types
        ),
    ]


def snapshot(mesh: jax.sharding.Mesh, axis_types: str) -> pathlib.Path | None:
    """The golden snapshot of the model's report on a TPU pod (none off TPUs)."""
    if mesh.devices.flat[0].platform != "tpu":
        return None
    name = f"transformer.{POD.replace(':', '-')}.{axis_types}.json"
    return pathlib.Path(__file__).with_name(name)


def main() -> int:
    axis_types = "explicit" if "--explicit" in sys.argv[1:] else "auto"
    update = "--update-snapshot" in sys.argv[1:]
    # 24 layers, 4.8 billion parameters in bfloat16; batches of 256 sequences of 2048.
    dims = {**DIMS, "batch": 256, "seqlen": 2048, "layers": 24}
    pod, *others = meshes(axis_types)
    golden = snapshot(pod, axis_types)
    for mesh in (pod, *others):
        # Raises jaxshard.ShardingError, listing every violation (and every
        # difference from the snapshot), if there is one.
        compare = mesh is pod and golden and golden.exists() and not update
        against = golden if compare else None
        report = jaxshard.verify(
            model, mesh=mesh, dims=dims, dtypes=jnp.bfloat16, against=against
        )
        print(report, end="\n\n")
        if against:
            print(f"As in the snapshot {against.name}.\n")
        elif mesh is pod and golden:
            report.save(golden)
            print(f"Snapshot written: {golden.name}.\n")

    report = jaxshard.verify(
        block_misannotated,
        mesh=pod,
        dims=dims,
        dtypes=jnp.bfloat16,
        raise_on_error=False,  # return the report, violations and all
    )
    print(report, end="\n\n")
    found = [((r.function or "").rsplit(".")[-1], r.name) for r in report.violations]
    if found != [("block_misannotated", "return")]:
        print(f"Expected one violation, in block_misannotated's return value: {found}")
        return 1
    print("The mis-annotated block was caught.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
