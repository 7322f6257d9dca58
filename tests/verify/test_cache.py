"""verify answered from a cache (`jaxshard.config(cache_dir=...)`): an unchanged
program's report comes back whole without compiling, in this process and in
another; any change to what decides it is a miss; entries are written whole, a
corrupt one is a miss with a warning, and the folder keeps to its size bound."""

import os
import subprocess
import sys
import textwrap

import jax
import pytest
from helpers import imported, jaxshard_command

import jaxshard
from jaxshard._verify import cache as _cache


MODEL = """
import jax
import jax.numpy as jnp
from beartype import beartype
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float


@jaxshard.jaxtyped(typechecker=beartype)
def layer(
    x: Float[Array, "b d", P("dp", None)], w: Float[Array, "d f", P(None, "tp")]
) -> Float[Array, "b f", {out}]:
    jaxshard.check_finite(x)  # on Auto axes, a custom-partitioned op
    return jnp.tanh(x @ w)
"""
DIMS = {"b": 16, "d": 8, "f": 32}


def model(folder, out='P("dp", "tp")', above=""):
    """The model's file written anew (as `cached_model`, one module name for every
    variant), and imported."""
    path = folder / "cached_model.py"
    path.write_text(above + MODEL.format(out=out))
    return imported(path, "cached_model")


def entries(folder) -> int:
    return sum(
        name.endswith(".report") for _, _, names in os.walk(folder) for name in names
    )


def verified(module, mesh, folder, **options):
    with jaxshard.config(cache_dir=str(folder)):
        return jaxshard.verify(module.layer, mesh=mesh, dims=DIMS, **options)


def test_an_unchanged_program_is_answered_from_the_cache(tmp_path, auto_mesh):
    folder, module = tmp_path / "cache", model(tmp_path)
    cold = verified(module, auto_mesh, folder)
    assert cold.compiled is not None and entries(folder) == 1
    warm = verified(module, auto_mesh, folder)
    assert warm.compiled is None  # nothing compiled
    assert warm.to_dict() == cold.to_dict() and warm.html() == cold.html()
    assert str(warm) == str(cold) and warm.fits == cold.fits
    assert [c.lineno for c in warm.collectives] == [c.lineno for c in cold.collectives]
    assert warm.mesh is auto_mesh and entries(folder) == 1


@pytest.mark.parametrize(
    "change",
    ["annotation", "line", "mesh", "budget", "rules", "version", "xla flags"],
)
def test_a_change_to_what_decides_the_report_is_a_miss(
    change, tmp_path, auto_mesh, monkeypatch
):
    folder = tmp_path / "cache"
    verified(model(tmp_path), auto_mesh, folder)
    mesh, options, module = auto_mesh, {}, model(tmp_path)
    if change == "annotation":  # on the same line: the program's text is the same
        module = model(tmp_path, out='P("dp", None)')
    elif change == "line":
        module = model(tmp_path, above="# a comment above moves every line\n")
    elif change == "mesh":
        mesh = jax.make_mesh((2, 4), ("dp", "tp"), axis_types=auto_mesh.axis_types)
    elif change == "budget":
        options = {"max_collectives": {"all-gather": 3}}
    elif change == "rules":
        options = {"rules": [("batch", "dp")]}
    elif change == "version":
        real = _cache._versions
        monkeypatch.setattr(_cache, "_versions", lambda: [*real(), "libtpu 9.9"])
    else:
        monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", "") + " --x")
    report = verified(module, mesh, folder, raise_on_error=False, **options)
    assert report.compiled is not None  # compiled: not the stored report
    assert entries(folder) == 2


def test_another_process_is_answered_from_the_cache(tmp_path):
    """Addresses and nonces in the lowered program (a probe's, a value check's
    custom partitioning's) differ from process to process: they are no part of the
    key."""
    model(tmp_path)
    script = tmp_path / "run.py"
    script.write_text(
        textwrap.dedent(f"""
        import jax, jaxshard, cached_model
        from jax.sharding import AxisType
        mesh = jax.make_mesh((4, 2), ("dp", "tp"), axis_types=(AxisType.Auto,) * 2)
        layer = jaxshard.checked(cached_model.layer)  # its value check compiled in
        report = jaxshard.verify(layer, mesh=mesh, dims={DIMS!r})
        print(report.compiled is None, len(report.rows) == 3)
        """)
    )
    env = {
        **os.environ,
        "JAXSHARD_CACHE_DIR": str(tmp_path / "cache"),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    }
    said = [
        subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for _ in range(2)
    ]
    assert said == [["False", "True"], ["True", "True"]]
    assert entries(tmp_path / "cache") == 1


def test_a_corrupt_entry_is_a_miss_with_a_warning(tmp_path, auto_mesh):
    folder, module = tmp_path / "cache", model(tmp_path)
    verified(module, auto_mesh, folder)
    (path,) = [os.path.join(r, n) for r, _, names in os.walk(folder) for n in names]
    with open(path, "r+b") as f:
        f.seek(40)
        f.write(b"\x00garbage\xff" * 8)
    with pytest.warns(UserWarning, match="cannot be read"):
        report = verified(module, auto_mesh, folder)
    assert report.compiled is not None and report.ok
    assert verified(module, auto_mesh, folder).compiled is None  # written anew


def test_a_write_that_fails_leaves_no_entry(tmp_path, auto_mesh, monkeypatch):
    """The entry is written beside its place and renamed into it: a crash while
    writing leaves nothing half written, and the verify itself goes on."""
    folder, module = tmp_path / "cache", model(tmp_path)

    def crash(*_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.warns(UserWarning, match="not stored in the cache"):
        assert verified(module, auto_mesh, folder).ok
    assert [n for _, _, names in os.walk(folder) for n in names] == []


def test_the_folder_keeps_to_its_bound(tmp_path, auto_mesh, monkeypatch):
    """One entry per distinct program; past the bound, the least recently used
    go first."""
    folder = tmp_path / "cache"
    verified(model(tmp_path), auto_mesh, folder)
    (first,) = [os.path.join(r, n) for r, _, names in os.walk(folder) for n in names]
    monkeypatch.setenv("JAXSHARD_CACHE_MAX_BYTES", str(os.path.getsize(first) + 10))
    verified(model(tmp_path, out="P()"), auto_mesh, folder, raise_on_error=False)
    assert entries(folder) == 1 and not os.path.exists(first)


def test_the_setting(tmp_path, monkeypatch):
    assert jaxshard.config.cache_dir is None
    with jaxshard.config(cache_dir=str(tmp_path)):
        assert jaxshard.config.cache_dir == str(tmp_path)
        with jaxshard.config(cache_dir=None):
            assert jaxshard.config.cache_dir is None
        assert jaxshard.config.cache_dir == str(tmp_path)
    assert jaxshard.config.cache_dir is None
    with pytest.raises(ValueError, match="a folder's path"):
        jaxshard.config(cache_dir=3)
    assert "cache_dir=None" in repr(jaxshard.config)


def test_the_command_line_and_the_plugin_use_it(tmp_path, pytester, monkeypatch):
    """`python -m jaxshard verify ... --cache-dir DIR` a second time compiles
    nothing; `pytest --jaxshard-cache-dir DIR` puts the tests' verifies in DIR."""
    model(tmp_path)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("JAXSHARD_CACHE_DIR", raising=False)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    command = ["verify", "cached_model:layer", "--mesh", "dp=4,tp=2"]
    command += ["--dim", "b=16", "--dim", "d=8", "--dim", "f=32"]
    command += ["--cache-dir", str(tmp_path / "cli")]
    for _ in range(2):
        code, _, err = jaxshard_command(tmp_path, *command)
        assert code == 0, err
    assert entries(tmp_path / "cli") == 1

    monkeypatch.delenv("XLA_FLAGS", raising=False)
    pytester.makepyfile(
        test_model=f"""
        import jax, jaxshard, cached_model

        def test_layer(mesh):
            mesh = mesh({{"dp": 4, "tp": 2}}, axis_types="auto")
            report = jaxshard.verify(cached_model.layer, mesh=mesh, dims={DIMS!r})
            assert jaxshard.config.cache_dir.endswith("plugin")
        """
    )
    for _ in range(2):
        result = pytester.runpytest_subprocess(
            "-p", "no:cacheprovider", "--jaxshard-devices", "8",
            "--jaxshard-cache-dir", "plugin",
        )  # fmt: skip
        result.assert_outcomes(passed=1)
    assert entries(pytester.path / "plugin") == 1


def test_a_tpu_program_whose_checks_are_compiled_out_is_found_at_once(
    tmp_path, tpu_topology, monkeypatch
):
    """On a TPU topology's Auto axes verify compiles a program with value checks,
    which XLA refuses, then one without: the report is kept under both lowerings'
    keys, so the next verify compiles nothing at all."""
    mesh = tpu_topology("v5e:2x2", {"dp": 2, "tp": 2})
    layer = jaxshard.checked(model(tmp_path).layer)
    folder = tmp_path / "cache"
    with jaxshard.config(cache_dir=str(folder)):
        first = jaxshard.verify(layer, mesh=mesh, dims=DIMS)
        assert any("compiled out" in note for note in first.notes)
        assert entries(folder) == 2
        compiles = []
        real = jax.stages.Lowered.compile
        monkeypatch.setattr(
            jax.stages.Lowered,
            "compile",
            lambda self, *a, **k: compiles.append(1) or real(self, *a, **k),
        )
        again = jaxshard.verify(layer, mesh=mesh, dims=DIMS)
    assert again.compiled is None and compiles == []
    assert again.to_dict() == first.to_dict()
