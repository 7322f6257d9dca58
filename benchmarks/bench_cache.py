"""What does a verify of an unchanged program cost, answered from jaxshard's cache?

The program is the transformer of `examples/transformer.py` (24 layers, scanned) on a
16-chip TPU v5e slice (`v5e:4x4`, mesh dp=2 x fsdp=2 x tp=4, Auto axes), compiled
by libtpu on this CPU-only machine. Each verify runs in a fresh process of its own
(nothing of an earlier one in memory), and the time is that of the
`jaxshard.verify` call alone (the process's start and imports are the same either
way). Each round, in a fresh folder:

- cold: a verify with `JAXSHARD_CACHE_DIR` set to an empty folder: it compiles,
    and stores its report;
- cached: the same verify again, answered from the folder;
- jax cache: for comparison, JAX's own persistent compilation cache
    (`JAX_COMPILATION_CACHE_DIR`, every compile kept) filled by a first process,
    then a verify that compiles through it, without jaxshard's cache;
- plain, and plain from jax cache: the same model jitted and compiled with
    jaxshard's checks off (no probe in the program), with an empty JAX cache and
    with the one a first process filled: whether JAX's cache serves a TPU compile
    on this machine at all.

The table gives the medians, and the median over rounds of each ratio to the cold
verify (target for the cached one: 0.10). Run: `python benchmarks/bench_cache.py`
(`--quick` for a smoke test). Without libtpu, 8 simulated CPU devices stand in.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from statistics import median


HERE = pathlib.Path(__file__).resolve().parent
QUICK = "--quick" in sys.argv[1:]
ROUNDS = 1 if QUICK else 5
LAYERS = 2 if QUICK else 24


def child(plain: bool) -> None:
    """One verify (or with `plain`, a compile with checks off), in this process:
    prints its seconds and whether it compiled."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    tpu = importlib.util.find_spec("libtpu") is not None
    if not tpu:
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax
    import jax.numpy as jnp

    import jaxshard

    sys.path.insert(0, str(HERE.parent / "examples"))
    import transformer

    if tpu:
        mesh = jaxshard.tpu_mesh("v5e:4x4", {"dp": 2, "fsdp": 2, "tp": 4})
    else:
        mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"))
    dims = {**transformer.DIMS, "batch": 64, "seqlen": 2048, "layers": LAYERS}
    if plain:
        args = jaxshard.abstract_args(transformer.model, mesh, dims, jnp.bfloat16)
        start = time.perf_counter()
        with jax.set_mesh(mesh), jaxshard.config(sharding="off", checks="off"):
            jax.jit(transformer.model).lower(*args).compile()
        print(json.dumps({"seconds": time.perf_counter() - start, "cached": False}))
        return
    start = time.perf_counter()
    report = jaxshard.verify(
        transformer.model, mesh=mesh, dims=dims, dtypes=jnp.bfloat16
    )
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "cached": report.compiled is None}))


def run(env: dict, plain: bool = False) -> dict:
    argv = [sys.executable, __file__, "--child"] + (["--quick"] if QUICK else [])
    argv += ["--plain"] if plain else []
    done = subprocess.run(
        argv, env={**os.environ, **env}, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def one_round() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        ours = {"JAXSHARD_CACHE_DIR": os.path.join(folder, "jaxshard")}
        cold, cached = run(ours), run(ours)
        assert not cold["cached"] and cached["cached"], (cold, cached)
        theirs = {
            "JAX_COMPILATION_CACHE_DIR": os.path.join(folder, "jax"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
        }
        run(theirs)  # fills JAX's cache
        jax_cached = run(theirs)
        theirs["JAX_COMPILATION_CACHE_DIR"] += "-plain"
        plain, plain_cached = run(theirs, True), run(theirs, True)
    return {
        "cold": cold["seconds"],
        "cached": cached["seconds"],
        "jax cache": jax_cached["seconds"],
        "plain": plain["seconds"],
        "plain, jax cache": plain_cached["seconds"],
    }


def main() -> int:
    where = "v5e:4x4 (16 chips)"
    if importlib.util.find_spec("libtpu") is None:
        where = "8 simulated CPU devices (no libtpu)"
    rounds = [one_round() for _ in range(ROUNDS)]
    print(
        f"verify of examples/transformer.py ({LAYERS} layers) on {where}, "
        f"{ROUNDS} rounds, each verify in a fresh process:"
    )
    print(f"{'':18}{'median':>10}{'vs cold':>10}{'target':>10}")
    for name in rounds[0]:
        seconds = median(r[name] for r in rounds)
        ratio = median(r[name] / r["cold"] for r in rounds)
        target = "0.10" if name == "cached" else ""
        print(f"{name:18}{seconds:>9.3f}s{ratio:>10.3f}{target:>10}")
    ratio = median(r["cached"] / r["cold"] for r in rounds)
    return 0 if QUICK or ratio <= 0.10 else 1


if __name__ == "__main__":
    if "--child" in sys.argv[1:]:
        child("--plain" in sys.argv[1:])
    else:
        sys.exit(main())
