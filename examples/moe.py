"""A mixture-of-experts decoder's train step, its expert parallelism checked contract by
contract, verified for the largest TPU v5p slice (8,960 chips) on a machine without a
TPU.

Each layer is attention then a DeepSeek-style MoE: a sigmoid router picks the top-k of
the routed experts for each token, a shared expert sees every token. The routed
experts are split over the mesh axis "ep"; the batch is split over every axis ("dp",
"fsdp" and "ep"); the weights are split over "fsdp" too (gathered before use), and
over "ep" where they belong to an expert. Inside `jax.shard_map` each device packs its
tokens into a fixed-capacity slot buffer per expert, an `all_to_all` over "ep" sends
each expert its slots, the experts run, and a second `all_to_all` brings the results
back to be combined. The annotations state the layout of every step: the router's
logits, the slot buffer before the exchange (`P(None, BATCH, None)`: every expert's
slots, for this device's tokens) and after it (`P("ep", ...)`: this device's experts,
with slots from every device of the "ep" group), the experts' weights and the
combined output. Inside the shard_map jaxshard checks the blocks against these global
types. Value checks there, under `jaxshard.checked`, say on which device the router's
probabilities stopped being finite, or how many tokens an expert's capacity dropped.

`jaxshard.verify` compiles the train step (forward, gradient, Adam update; layers
scanned, each remat'ed) and prints the report: each all-to-all at its line here,
the bytes it moves per device, the memory per chip. Then it shows a violation (an
expert weight whose hidden dimension is split over "ep", where its contract splits
the experts) and, on the CPUs at hand, a capacity too small for the tokens routed,
reported by device.

Run: `python examples/moe.py` (8 simulated CPU devices, a small model), or
`python examples/moe.py --topology v5p:16x20x28` (needs libtpu: `pip install
'jaxshard[tpu]'`) for DeepSeek-V3's shapes (61 layers, the first 3 dense, d 7168, 256
routed experts, top 8, one shared expert, expert hidden size 2048) on 8,960 chips:
"ep" 64 (DeepSeek-V3's expert parallelism), "fsdp" 28, "dp" 5. Attention is plain
multi-head attention here, not DeepSeek's MLA.
"""

import math
import os
import sys
from typing import Any, NamedTuple


# There is no TPU to run on: libtpu only compiles. JAX must not look for one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from beartype import beartype  # noqa: E402
from jax import Array  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxshard  # noqa: E402
from jaxshard import Float, Int  # noqa: E402


BATCH = ("dp", "fsdp", "ep")  # the batch is split over every axis
SLOTS = ("dp", "fsdp")  # at the experts, slots come from every device of the ep group

X = Float[Array, "batch seqlen d", P(BATCH, None, None)]  # the residual stream
Heads = Float[Array, "batch seqlen heads hd", P(BATCH, None, None, None)]
Logits = Float[Array, "batch seqlen experts", P(BATCH, None, None)]
Choice = Int[Array, "batch seqlen k", P(BATCH, None, None)]  # the top-k experts
Gates = Float[Array, "batch seqlen k", P(BATCH, None, None)]  # and their weights
# The slot buffer: `capacity` slots per expert for each device's tokens.
Outbound = Float[Array, "experts slots d", P(None, BATCH, None)]
Inbound = Float[Array, "experts slots d", P("ep", SLOTS, None)]
ExpertIn = Float[Array, "experts d f", P("ep", None, None)]  # as the experts see them
ExpertOut = Float[Array, "experts f d", P("ep", None, None)]


class Config(NamedTuple):
    """What the shapes do not say."""

    top_k: int
    capacity_factor: float  # slots per expert, over the tokens a fair share sends it
    route_scale: float = 2.5  # DeepSeek-V3 scales the routed experts' sum


class Block(NamedTuple):
    """One layer's weights: split over "fsdp" on their model dimension, the routed
    experts over "ep" too."""

    ln1: Float[Array, "d", P(None)]
    wq: Float[Array, "d heads hd", P("fsdp", None, None)]
    wk: Float[Array, "d heads hd", P("fsdp", None, None)]
    wv: Float[Array, "d heads hd", P("fsdp", None, None)]
    wo: Float[Array, "heads hd d", P(None, None, "fsdp")]
    ln2: Float[Array, "d", P(None)]
    router: Float[Array, "d experts", P("fsdp", None)]
    w_gate: Float[Array, "experts d f", P("ep", "fsdp", None)]
    w_up: Float[Array, "experts d f", P("ep", "fsdp", None)]
    w_down: Float[Array, "experts f d", P("ep", None, "fsdp")]
    s_gate: Float[Array, "d f", P("fsdp", None)]  # the shared expert
    s_up: Float[Array, "d f", P("fsdp", None)]
    s_down: Float[Array, "f d", P(None, "fsdp")]


class Stack(NamedTuple):
    """Every layer's weights, stacked for `lax.scan`: `Block`'s fields, in order."""

    ln1: Float[Array, "layers d", P(None, None)]
    wq: Float[Array, "layers d heads hd", P(None, "fsdp", None, None)]
    wk: Float[Array, "layers d heads hd", P(None, "fsdp", None, None)]
    wv: Float[Array, "layers d heads hd", P(None, "fsdp", None, None)]
    wo: Float[Array, "layers heads hd d", P(None, None, None, "fsdp")]
    ln2: Float[Array, "layers d", P(None, None)]
    router: Float[Array, "layers d experts", P(None, "fsdp", None)]
    w_gate: Float[Array, "layers experts d f", P(None, "ep", "fsdp", None)]
    w_up: Float[Array, "layers experts d f", P(None, "ep", "fsdp", None)]
    w_down: Float[Array, "layers experts f d", P(None, "ep", None, "fsdp")]
    s_gate: Float[Array, "layers d f", P(None, "fsdp", None)]
    s_up: Float[Array, "layers d f", P(None, "fsdp", None)]
    s_down: Float[Array, "layers f d", P(None, None, "fsdp")]


class Dense(NamedTuple):
    """A dense layer's weights (DeepSeek-V3's first three): attention as `Block`'s,
    then a SwiGLU MLP split over "fsdp"."""

    ln1: Float[Array, "d", P(None)]
    wq: Float[Array, "d heads hd", P("fsdp", None, None)]
    wk: Float[Array, "d heads hd", P("fsdp", None, None)]
    wv: Float[Array, "d heads hd", P("fsdp", None, None)]
    wo: Float[Array, "heads hd d", P(None, None, "fsdp")]
    ln2: Float[Array, "d", P(None)]
    w_gate: Float[Array, "d dense_f", P("fsdp", None)]
    w_up: Float[Array, "d dense_f", P("fsdp", None)]
    w_down: Float[Array, "dense_f d", P(None, "fsdp")]


class DenseStack(NamedTuple):
    """The dense layers' weights, stacked: `Dense`'s fields, in order."""

    ln1: Float[Array, "dense_layers d", P(None, None)]
    wq: Float[Array, "dense_layers d heads hd", P(None, "fsdp", None, None)]
    wk: Float[Array, "dense_layers d heads hd", P(None, "fsdp", None, None)]
    wv: Float[Array, "dense_layers d heads hd", P(None, "fsdp", None, None)]
    wo: Float[Array, "dense_layers heads hd d", P(None, None, None, "fsdp")]
    ln2: Float[Array, "dense_layers d", P(None, None)]
    w_gate: Float[Array, "dense_layers d dense_f", P(None, "fsdp", None)]
    w_up: Float[Array, "dense_layers d dense_f", P(None, "fsdp", None)]
    w_down: Float[Array, "dense_layers dense_f d", P(None, None, "fsdp")]


class Params(NamedTuple):
    dense: DenseStack
    moe: Stack


class State(NamedTuple):
    """The weights and Adam's moments, laid out alike."""

    params: Params
    mu: Params
    nu: Params
    step: Int[Array, "", P()]


def constrain(x: Array, annotation) -> Array:
    return jax.lax.with_sharding_constraint(x, jaxshard.partition_spec(annotation))


# --- attention ----------------------------------------------------------------------


def norm(x: Array, scale: Array) -> Array:
    x32 = x.astype(jnp.float32)
    rms = jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + 1e-6)
    return (x32 * rms).astype(x.dtype) * scale


@jaxshard.jaxtyped(typechecker=beartype)
def attention(p, x: X) -> X:
    """Causal softmax attention, each device computing its own sequences (`p`: a
    `Block` or a `Dense`, whose contracts `moe_layer` and `dense_layer` check)."""
    h = norm(x, p.ln1)
    q, k, v = (constrain(jnp.einsum("bsd,dhk->bshk", h, w), Heads) for w in p[1:4])
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k) / math.sqrt(q.shape[-1])
    causal = jnp.tril(jnp.ones(scores.shape[-2:], dtype=bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
    heads = jnp.einsum("bhqs,bshk->bqhk", weights.astype(v.dtype), v)
    return x + constrain(jnp.einsum("bshk,hkd->bsd", heads, p.wo), X)


# --- the mixture of experts, per device inside shard_map ------------------------------
# Every annotation below states the global array; the values are the blocks one
# device holds, and jaxshard checks them against the global type.


@jaxshard.jaxtyped(typechecker=beartype)
def route(
    x: X, router: Float[Array, "d experts", P(None, None)], cfg: Config
) -> tuple[Logits, Gates, Choice]:
    """DeepSeek-V3's router: sigmoid scores, the top-k experts, their scores
    normalised to sum to one (then scaled)."""
    logits = jnp.einsum("bsd,de->bse", x, router).astype(jnp.float32)
    probs = jax.nn.sigmoid(logits)
    jaxshard.check_finite(probs, name="router probabilities")
    weights, chosen = jax.lax.top_k(probs, cfg.top_k)
    weights = weights / weights.sum(-1, keepdims=True) * cfg.route_scale
    return logits, weights, chosen


def slots(chosen: Array, experts: int, capacity: int) -> tuple[Array, Array]:
    """Each (token, choice)'s slot in its expert's buffer, in token order, and whether
    it got one (an expert takes `capacity` tokens from each device)."""
    onehot = jax.nn.one_hot(chosen.reshape(-1), experts, dtype=jnp.int32)
    slot = ((jnp.cumsum(onehot, axis=0) - 1) * onehot).sum(-1)
    return slot, slot < capacity


@jaxshard.jaxtyped(typechecker=beartype)
def dispatch(
    x: X, chosen: Choice, experts: int, capacity: int
) -> tuple[Outbound, Array, Array]:
    """This device's tokens, copied into their experts' slots: a block of
    `capacity` slots for every routed expert. Also each (token, choice)'s slot and
    whether it got one, for `combine`."""
    b, s, d = x.shape
    slot, kept = slots(chosen, experts, capacity)
    dropped = (~kept).sum()
    jaxshard.check(dropped == 0, "{dropped} tokens dropped", dropped=dropped)
    tokens = jnp.repeat(x.reshape(b * s, d), chosen.shape[-1], axis=0)
    buffer = jnp.zeros((experts, capacity, d), x.dtype)
    return buffer.at[chosen.reshape(-1), slot].add(tokens, mode="drop"), slot, kept


@jaxshard.jaxtyped(typechecker=beartype)
def experts_ffn(
    h: Inbound, w_gate: ExpertIn, w_up: ExpertIn, w_down: ExpertOut
) -> Inbound:
    """Each local expert's SwiGLU over the slots it was sent."""
    gate = jnp.einsum("ecd,edf->ecf", h, w_gate)
    up = jnp.einsum("ecd,edf->ecf", h, w_up)
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(gate) * up, w_down)


@jaxshard.jaxtyped(typechecker=beartype)
def combine(
    out: Outbound, chosen: Choice, weights: Gates, slot: Array, kept: Array
) -> X:
    """Each token's experts' results, weighted by the router (a dropped choice adds
    nothing)."""
    b, s, k = chosen.shape
    got = out.at[chosen.reshape(-1), slot].get(mode="fill", fill_value=0)
    w = (weights.reshape(-1) * kept).astype(out.dtype)
    return (got * w[:, None]).reshape(b, s, k, -1).sum(2)


def moe_local(
    x: Array,
    router: Array,
    w_gate: Array,
    w_up: Array,
    w_down: Array,
    cfg: Config,
) -> Array:
    """The routed experts, as one device runs them: route, dispatch, exchange, run,
    exchange back, combine."""
    b, s, _ = x.shape
    n_experts = router.shape[-1]
    capacity = math.ceil(b * s * cfg.top_k / n_experts * cfg.capacity_factor)
    _, weights, chosen = route(x, router, cfg)
    outbound, slot, kept = dispatch(x, chosen, n_experts, capacity)
    # Expert e's slots from every device of the ep group, side by side.
    inbound = jax.lax.all_to_all(outbound, "ep", 0, 1, tiled=True)
    done = experts_ffn(inbound, w_gate, w_up, w_down)
    back = jax.lax.all_to_all(done, "ep", 1, 0, tiled=True)
    return combine(back, chosen, weights, slot, kept)


@jaxshard.jaxtyped(typechecker=beartype)
def moe(p: Block, x: X, cfg: Config) -> X:
    """The MoE layer: the routed experts through shard_map, plus the shared expert."""
    h = norm(x, p.ln2)
    expert = P("ep", None, None)
    routed = jax.shard_map(
        lambda *a: moe_local(*a, cfg),  # type: ignore[call-arg]
        in_specs=(P(BATCH, None, None), P(None, None), expert, expert, expert),
        out_specs=P(BATCH, None, None),
    )(h, p.router, p.w_gate, p.w_up, p.w_down)
    shared = jax.nn.silu(h @ p.s_gate) * (h @ p.s_up) @ p.s_down
    return x + constrain(routed + shared, X)


@jaxshard.jaxtyped(typechecker=beartype)
def moe_layer(p: Block, x: X, cfg: Config) -> X:
    return moe(p, attention(p, x), cfg)


@jaxshard.jaxtyped(typechecker=beartype)
def dense_layer(p: Dense, x: X) -> X:
    x = attention(p, x)
    h = norm(x, p.ln2)
    return x + constrain(jax.nn.silu(h @ p.w_gate) * (h @ p.w_up) @ p.w_down, X)


@jaxshard.jaxtyped(typechecker=beartype)
def model(params: Params, x: X, cfg: Config) -> X:
    # Each layer keeps its input only; the rest is recomputed for the gradients.
    @jax.checkpoint
    def dense(x, weights):
        return dense_layer(Dense(*weights), x), None

    @jax.checkpoint
    def sparse(x, weights):
        return moe_layer(Block(*weights), x, cfg), None

    x, _ = jax.lax.scan(dense, x, params.dense)
    x, _ = jax.lax.scan(sparse, x, params.moe)
    return x


@jaxshard.jaxtyped(typechecker=beartype)
def train_step(
    state: State, x: X, y: X, cfg: Config
) -> tuple[State, Float[Array, "", P()]]:
    """One step of Adam on the squared distance from `y`."""

    def loss_fn(params):
        out = model(params, x, cfg).astype(jnp.float32)
        return jnp.mean((out - y.astype(jnp.float32)) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    step = state.step + 1
    b1, b2, lr, eps = 0.9, 0.95, 2.2e-4, 1e-8
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, state.mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, state.nu, grads)
    t = step.astype(jnp.float32)

    def update(w, m, v):
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        return (w - lr * m_hat / (jnp.sqrt(v_hat) + eps)).astype(w.dtype)

    params = jax.tree.map(update, state.params, mu, nu)
    return State(params, mu, nu, step), loss


# --- verifying ----------------------------------------------------------------------

# DeepSeek-V3: 61 layers (3 dense, of hidden size 18432), d 7168, 128 heads of 128,
# 256 routed experts (top 8) and one shared, each of hidden size 2048; batches of
# 8,960 sequences of 4,096 tokens.
FULL: dict[str, Any] = {
    "dims": {
        "dense_layers": 3,
        "layers": 58,
        "d": 7168,
        "heads": 128,
        "hd": 128,
        "experts": 256,
        "f": 2048,
        "dense_f": 18432,
        "batch": 8960,
        "seqlen": 4096,
    },
    "cfg": Config(top_k=8, capacity_factor=1.25),
    "mesh": {"dp": 5, "fsdp": 28, "ep": 64},
}
SMALL: dict[str, Any] = {
    "dims": {
        "dense_layers": 1,
        "layers": 2,
        "d": 64,
        "heads": 4,
        "hd": 16,
        "experts": 8,
        "f": 32,
        "dense_f": 128,
        "batch": 16,
        "seqlen": 16,
    },
    "cfg": Config(top_k=2, capacity_factor=2.0),
    "mesh": {"dp": 2, "fsdp": 2, "ep": 2},
}


def cpu_mesh(shape: dict[str, int]) -> jax.sharding.Mesh:
    return jax.make_mesh(
        tuple(shape.values()),
        tuple(shape),
        axis_types=(jax.sharding.AxisType.Auto,) * len(shape),
    )


def verify(mesh, setup, **kwargs) -> "jaxshard.Report":
    return jaxshard.verify(
        train_step,
        mesh=mesh,
        dims=setup["dims"],
        dtypes=jnp.bfloat16,
        values={"cfg": setup["cfg"]},
        **kwargs,
    )


def slot_bytes(setup, devices: int, width: int = 2) -> int:
    """What each all-to-all moves per device per layer, as the shapes imply it: every
    expert's slots for this device's tokens (tokens x top-k x capacity factor, rounded
    up per expert), of d numbers of `width` bytes (bfloat16; XLA's CPU compiler moves
    them as float32); (ep - 1)/ep of them leave the device."""
    dims, cfg = setup["dims"], setup["cfg"]
    tokens = dims["batch"] * dims["seqlen"] // devices
    capacity = math.ceil(tokens * cfg.top_k / dims["experts"] * cfg.capacity_factor)
    return dims["experts"] * capacity * dims["d"] * width


def misplaced_expert(mesh, setup) -> "jaxshard.Report":
    """One MoE layer whose w_gate splits its hidden dimension over "ep", as tensor
    parallelism would, where its contract splits the experts: the shard_map would
    all-to-all it into place, silently, every step."""
    block, *_ = jaxshard.abstract_args(
        moe, mesh, setup["dims"], jnp.bfloat16, values={"cfg": setup["cfg"]}
    )
    w = block.w_gate
    swapped = jax.sharding.NamedSharding(mesh, P(None, "fsdp", "ep"))
    block = block._replace(
        w_gate=jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=swapped)
    )
    return jaxshard.verify(
        moe,
        mesh=mesh,
        dims=setup["dims"],
        dtypes=jnp.bfloat16,
        values={"p": block, "cfg": setup["cfg"]},
        raise_on_error=False,
    )


def layout(annotation, mesh) -> jax.sharding.NamedSharding:
    spec = jaxshard.partition_spec(annotation) or P()
    return jax.sharding.NamedSharding(mesh, spec)


def routed_unevenly(mesh, dims) -> tuple[Block, Array, Array]:
    """A layer's weights whose router sends a token to the experts its two largest
    model dimensions (of the first `experts`) name; tokens that spread over the
    experts evenly; and the same tokens but for the sixth device's (dp 1, fsdp 0,
    ep 1 on the small mesh), which all pick experts 0 and 1."""
    keys = iter(jax.random.split(jax.random.key(0), len(Block._fields)))
    weights = {}
    for name, annotation in Block.__annotations__.items():
        shape = tuple(dims[d] for d in annotation.dim_str.split())
        weights[name] = jax.random.normal(next(keys), shape) * 0.02
    weights["ln2"] = jnp.ones(dims["d"])
    weights["router"] = jnp.eye(dims["d"], dims["experts"]) * 4
    block = Block(
        **{
            k: jax.device_put(v, layout(Block.__annotations__[k], mesh))
            for k, v in weights.items()
        }
    )
    b, s, d, e = dims["batch"], dims["seqlen"], dims["d"], dims["experts"]
    t = jnp.arange(b * s).reshape(b, s)
    even = jax.nn.one_hot(t % e, d) + jax.nn.one_hot((t + 1) % e, d)
    per_device = b // mesh.size
    crowded = even.at[5 * per_device : 6 * per_device].set(
        jax.nn.one_hot(0, d) + jax.nn.one_hot(1, d)
    )
    return (
        block,
        jax.device_put(even, layout(X, mesh)),
        jax.device_put(crowded, layout(X, mesh)),
    )


def main() -> int:
    args = sys.argv[1:]
    topology = args[args.index("--topology") + 1] if "--topology" in args else None
    if topology:
        setup = FULL
        mesh = jaxshard.tpu_mesh(topology, setup["mesh"])
    else:
        setup = SMALL
        jax.config.update("jax_num_cpu_devices", 8)  # before JAX starts its backends
        mesh = cpu_mesh(setup["mesh"])
    # Raises jaxshard.ShardingError, listing every violation, if there is one.
    report = verify(mesh, setup)
    print(report, end="\n\n")
    if topology and not report.fits:  # (verify fails on it too: a budget)
        print("The step does not fit in one chip's HBM.")
        return 1

    width = 2 if topology else 4  # the CPU compiler's all-to-alls are in float32
    implied = slot_bytes(setup, mesh.size, width)
    a2a = [c for c in report.collectives if c.kind == "all-to-all"]
    print(f"Each all-to-all moves {implied:,} bytes per device per layer (the slots):")
    for line in sorted({c.lineno for c in a2a if c.lineno is not None}):
        here = [c for c in a2a if c.lineno == line]
        moved = ", ".join(sorted({f"{c.bytes:,} bytes over {c.axes}" for c in here}))
        print(f"  line {line}: {len(here)} (forward, remat, backward): {moved}")
    if not a2a or any(c.bytes != implied or c.lineno is None for c in a2a):
        print("Not what the shapes imply, or not located in this file.")
        return 1

    report = misplaced_expert(mesh, setup)
    print("", report, sep="\n", end="\n\n")
    found = [((r.function or "").rsplit(".")[-1], r.name) for r in report.violations]
    if found != [("moe", "p.w_gate")]:
        print(f"Expected one violation, in the misplaced w_gate: {found}")
        return 1
    print("The misplaced expert weight was caught.")
    if topology:
        return 0

    # Run the layer on the CPUs, its capacity a fair share: the crowded device drops.
    cfg = setup["cfg"]._replace(capacity_factor=1.0)
    layer = jaxshard.checked(jax.jit(lambda p, x: moe(p, x, cfg)))
    block, even, crowded = routed_unevenly(mesh, setup["dims"])
    with jax.set_mesh(mesh):
        layer(block, even)  # every token gets a slot
        try:
            layer(block, crowded)
        except jaxshard.CheckError as e:
            print(f"\n{e}")
            return 0
    print("The dropped tokens went unreported.")
    return 1


if __name__ == "__main__":
    sys.exit(main())
