"""`jaxshard.annotate`'s writer: contracts written into source files in the styles of
real models, as a diff that `patch -p1` and `git apply` take and as the files
written, their formatting kept outside the lines changed, and nothing written twice."""

import ast
import contextlib
import difflib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import uuid

import jax
import pytest
from helpers import put
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard._annotate.contracts import Contract, Import, imports_for
from jaxshard._annotate.write import diff, patch, write


NEEDS = imports_for({"Float", "Array", "P"})
ACT = 'Float[Array, "batch seq d", P("dp", None, None)]'
JAXTYPED = "@jaxshard.jaxtyped(typechecker=beartype)"


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path, monkeypatch):
    """The diff names files relative to the working directory: make it `tmp_path`."""
    monkeypatch.chdir(tmp_path)


def source(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def put_file(folder, name: str, text: str | bytes) -> str:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


def contract(path, qualname, params, returns=None, *, imports=NEEDS):
    """The contract of the `def` of `qualname` in `path`, its line found by name."""
    name = qualname.split(".")[-1]
    lines = pathlib.Path(path).read_text("utf-8-sig").splitlines()
    lineno = next(i for i, line in enumerate(lines, 1) if f"def {name}(" in line)
    return Contract(path, qualname, lineno, params, returns, imports)


def applied(tmp_path, found) -> dict[str, bytes]:
    """Each changed file as `patch -p1` and `git apply` make it from the diff, in
    fresh copies of the files as they were."""
    text = found.diff()
    out = {}
    if not found.changes:
        assert text == ""
        return out
    for tool in (["patch", "-p1", "--quiet"], ["git", "apply", "-"]):
        where = tmp_path / f"applied-{tool[0]}-{uuid.uuid4().hex[:6]}"
        where.mkdir()
        for change in found.changes:
            put_file(where, os.path.relpath(change.path), change.before.encode())
        if tool[0] == "git":
            subprocess.run(["git", "init", "-q"], cwd=where, check=True)
        run = subprocess.run(tool, cwd=where, input=text.encode(), capture_output=True)
        assert run.returncode == 0, run.stderr.decode() + run.stdout.decode()
        for change in found.changes:
            got = (where / os.path.relpath(change.path)).read_bytes()
            assert out.setdefault(change.path, got) == got
    return out


def written(tmp_path, contracts) -> dict[str, str]:
    """Writes `contracts`, checking on the way that the diff applied by `patch` and
    `git apply` gives the files written, that they compile, and that a second run
    changes nothing; returns the files written."""
    found = patch(contracts)
    by_tools = applied(tmp_path, found)
    assert sorted(write(contracts)) == sorted(c.path for c in found.changes)
    texts = {}
    for path, made in by_tools.items():
        assert pathlib.Path(path).read_bytes() == made
        texts[path] = made.decode("utf-8")
        compile(made, path, "exec")
    again = patch(contracts)
    assert again.changes == () and again.diff() == ""
    assert again.kept == found.kept  # what was written says what the contract says
    return texts


def removed_lines(before: str, after: str) -> list[str]:
    lines = difflib.ndiff(before.splitlines(True), after.splitlines(True))
    return [line[2:] for line in lines if line.startswith("- ")]


def load(path: str):
    name = f"written_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # while it runs: dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


NNX = source('''
    """A block of an NNX model."""

    import jax
    from flax import nnx


    class Block(nnx.Module):
        """A residual MLP."""

        def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs):
            self.up = nnx.Linear(d, hidden, rngs=rngs)
            self.down = nnx.Linear(hidden, d, rngs=rngs)

        def __call__(self, x, mask=None):
            h = jax.nn.gelu(self.up(x))  # the hidden layer
            return x + self.down(h)
''')


def test_an_nnx_modules_call_is_annotated_wrapped_and_checked(tmp_path):
    path = put_file(tmp_path, "model/nnx_block.py", NNX)
    params = {"self": ACT, "x": ACT, "mask": ACT}
    found = patch([contract(path, "Block.__call__", params, ACT)])
    assert found.diff().startswith(
        "--- a/model/nnx_block.py\n+++ b/model/nnx_block.py\n"
    )
    [text] = written(tmp_path, [contract(path, "Block.__call__", params, ACT)]).values()
    assert text == source('''
        """A block of an NNX model."""

        import jax
        from flax import nnx
        import jaxshard
        from beartype import beartype
        from jax import Array
        from jax.sharding import PartitionSpec as P
        from jaxshard import Float


        class Block(nnx.Module):
            """A residual MLP."""

            def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs):
                self.up = nnx.Linear(d, hidden, rngs=rngs)
                self.down = nnx.Linear(hidden, d, rngs=rngs)

            @jaxshard.jaxtyped(typechecker=beartype)
            def __call__(
                self,
                x: Float[Array, "batch seq d", P("dp", None, None)],
                mask: Float[Array, "batch seq d", P("dp", None, None)] | None = None,
            ) -> Float[Array, "batch seq d", P("dp", None, None)]:
                h = jax.nn.gelu(self.up(x))  # the hidden layer
                return x + self.down(h)
    ''')
    assert max(len(line) for line in text.splitlines()) <= 88
    # `self` is never annotated, and the report says so.
    [missing] = found.missing
    assert missing.name == "self" and "never annotated" in str(missing)
    assert str(missing).startswith("model/nnx_block.py:14: Block.__call__: ")
    # Every line removed is the one signature changed.
    assert removed_lines(NNX, text) == ["    def __call__(self, x, mask=None):\n"]
    module = load(path)
    assert module.Block.__call__.__wrapped__.__annotations__["x"] is not None


LINEN = source("""
    import flax.linen as nn
    import jax.numpy as jnp


    class Mlp(nn.Module):
        hidden: int

        @nn.compact
        def __call__(self, x):
            return nn.Dense(x.shape[-1])(nn.relu(nn.Dense(self.hidden)(x)))
""")


def test_a_linen_compact_call_gets_jaxtyped_directly_above_its_def(tmp_path):
    path = put_file(tmp_path, "linen_mlp.py", LINEN)
    spec = 'Float[Array, "b", P("dp")]'
    [text] = written(
        tmp_path, [contract(path, "Mlp.__call__", {"x": spec}, spec)]
    ).values()
    lines = text.splitlines()
    at = lines.index("    @nn.compact")
    assert lines[at + 1] == f"    {JAXTYPED}"
    assert lines[at + 2] == f"    def __call__(self, x: {spec}) -> {spec}:"
    assert removed_lines(LINEN, text) == ["    def __call__(self, x):\n"]
    load(path)  # imports: every name the annotations use is bound


JIT = source("""
    from functools import partial

    import jax
    import jax.numpy as jnp


    @partial(jax.jit, static_argnames=("n",))
    def repeat(x, *, n):
        for _ in range(n):
            x = jnp.tanh(x)
        return x


    @jax.jit
    @jaxshard.jaxtyped(typechecker=beartype)
    def done(x):
        return x
""")


def test_jitted_functions_keep_their_decorators_first(tmp_path):
    path = put_file(tmp_path, "jitted.py", JIT)
    spec = 'Float[Array, "b", P("dp")]'
    contracts = [
        contract(path, "repeat", {"x": spec, "n": "int"}, spec),
        contract(path, "done", {"x": spec}),
    ]
    [text] = written(tmp_path, contracts).values()
    assert (
        source(f"""
        @partial(jax.jit, static_argnames=("n",))
        {JAXTYPED}
        def repeat(x: {spec}, *, n: int) -> {spec}:
    """)
        in text
    )
    # A function checked already gets no second decorator; imports are made once.
    assert text.count(JAXTYPED) == 2
    assert text.count("import jaxshard\n") == 1
    assert text.count("import beartype\n") == 1
    load(path)  # the decorator `done` had is now imported too
    assert (
        source(f"""
        @jax.jit
        {JAXTYPED}
        def done(x: {spec}):
    """)
        in text
    )


WEIGHTS = source('''
    """A model whose weights are a dataclass, and its layers functions."""
    from __future__ import annotations

    import dataclasses

    import jax
    from jax import Array


    @dataclasses.dataclass
    class Weights:
        w: Array
        b: Array


    def dense(p: Weights, x, scale=1.0):
        return scale * (x @ p.w + p.b)


    def model(p: Weights, x):
        return dense(p, x)
''')


def test_module_level_functions_of_a_dataclass_weights_model(tmp_path):
    path = put_file(tmp_path, "weights.py", WEIGHTS)
    spec = 'Float[Array, "b d", P("dp", None)]'
    contracts = [
        contract(path, "dense", {"p": "Weights", "x": spec}, spec),
        contract(path, "model", {"x": spec}, spec),
    ]
    found = patch(contracts)
    assert found.kept == ()  # `p: Weights` is what the contract says
    [text] = written(tmp_path, contracts).values()
    # `Array` was imported from jax already, and `from __future__` stays first.
    assert text.count("import Array") == 1
    assert text.splitlines()[1] == "from __future__ import annotations"
    # Too long for a line: one parameter a line, as ruff writes it.
    assert (
        source(f"""
        {JAXTYPED}
        def dense(
            p: Weights,
            x: {spec},
            scale=1.0,
        ) -> {spec}:
            return scale * (x @ p.w + p.b)
    """)
        in text
    )
    assert max(map(len, text.splitlines())) <= 88
    assert text.count(JAXTYPED) == 2
    assert load(path).dense.__wrapped__.__annotations__["p"] == "Weights"


def fields(path, qualname, params, *, imports=NEEDS):
    """The contract of the fields of the class `qualname` in `path`."""
    name = qualname.split(".")[-1]
    lines = pathlib.Path(path).read_text("utf-8").splitlines()
    lineno = next(i for i, line in enumerate(lines, 1) if f"class {name}" in line)
    return Contract(path, qualname, lineno, params, None, imports, kind="class")


LAYERS = source("""
    import dataclasses
    from typing import NamedTuple, Optional

    import jax
    import jax.numpy as jnp


    class Mlp(NamedTuple):
        up: jax.Array  # hidden units
        down: "jnp.ndarray"
        bias: jax.Array | None = None
        gate: Optional[jax.Array] = None


    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Layer:
        scale: jax.Array
        mlp: Mlp
        norm: Float[Array, "d"]

        def __call__(self, x: jax.Array) -> jax.Array:
            return x * self.scale
""")


def test_fields_are_written_where_they_say_only_an_array(tmp_path):
    """A NamedTuple's and a registered dataclass's fields, and a method's
    parameter: `jax.Array`, `"jnp.ndarray"`, `jax.Array | None` and
    `Optional[jax.Array]` become the contract (or `None`), in place (a comment
    stays); a field with a jaxtyping annotation is kept and said; a field the class
    does not declare is said."""
    path = put_file(tmp_path, "layers.py", LAYERS)
    up = 'Float[Array, "d h", P(None, "tp")]'
    down = 'Float[Array, "h d", P("tp", None)]'
    scale = 'Float[Array, "d", P(None)]'
    contracts = [
        fields(path, "Mlp", {"up": up, "down": down, "bias": scale, "gate": scale}),
        fields(path, "Layer", {"scale": scale, "norm": scale, "gone": scale}),
        contract(path, "Layer.__call__", {"x": ACT}, ACT),
    ]
    found = patch(contracts)
    [kept] = found.kept
    assert str(kept).endswith(
        "Layer: field 'norm' keeps its annotation Float[Array, \"d\"]; annotate saw "
        + scale
    )
    [missing] = found.missing
    assert "Layer: field 'gone' is not declared in its class's body" in str(missing)
    [text] = written(tmp_path, contracts).values()
    assert f"    up: {up}  # hidden units\n    down: {down}\n" in text
    assert f"    bias: {scale} | None = None\n    gate: {scale} | None = None" in text
    assert f"    scale: {scale}\n    mlp: Mlp\n" in text
    assert f"        x: {ACT},\n    ) -> {ACT}:" in text
    assert text.count(JAXTYPED) == 1  # on the method; classes get no decorator
    assert "from jax.sharding import PartitionSpec as P" in text


def test_an_existing_jaxtyping_import_and_from_imports_are_reused(tmp_path):
    text = source("""
        import jax
        from jax.sharding import NamedSharding
        from jaxshard import Int
        from jaxtyping import Array, Float


        def embed(tokens, table: Float[Array, "v d"]):
            return table[tokens]
    """)
    path = put_file(tmp_path, "embed.py", text)
    tokens = 'Int[Array, "b s", P("dp", None)]'
    table = 'Float[Array, "v d", P(None, "tp")]'
    needs = imports_for({"Int", "Float", "Array", "P"})
    found = patch(
        [contract(path, "embed", {"tokens": tokens, "table": table}, imports=needs)]
    )
    # The annotation there says no layout: it is kept, and said.
    [kept] = found.kept
    assert kept.name == "table" and kept.existing == 'Float[Array, "v d"]'
    assert "embed: parameter 'table' keeps its annotation" in str(kept)
    [out] = written(
        tmp_path, [contract(path, "embed", {"tokens": tokens}, imports=needs)]
    ).values()
    # P joins the from-import of its module; jaxtyping's `Array` is not jax's
    # import, so the new annotation names jax's qualified.
    assert "from jax.sharding import NamedSharding, PartitionSpec as P\n" in out
    assert "from jaxshard import Int\n" in out
    assert 'def embed(tokens: Int[jax.Array, "b s", P("dp", None)], table: ' in out
    # `import jaxshard` and `from beartype import beartype`, for the decorator.
    assert out.count("import") == text.count("import") + 2
    assert removed_lines(text, out) == [
        "from jax.sharding import NamedSharding\n",
        'def embed(tokens, table: Float[Array, "v d"]):\n',
    ]


def test_a_name_bound_to_something_else_is_written_qualified(tmp_path):
    text = source('''
        """P is the parameters here."""

        import jax.numpy as jnp

        P = {"w": jnp.ones((4, 4))}


        def apply(x):
            return x @ P["w"]
    ''')
    path = put_file(tmp_path, "params.py", text)
    spec = 'Float[Array, "b d", P("dp", None)]'
    [out] = written(tmp_path, [contract(path, "apply", {"x": spec}, spec)]).values()
    qualified = 'Float[Array, "b d", jax.sharding.PartitionSpec("dp", None)]'
    assert f"def apply(\n    x: {qualified},\n) -> {qualified}:\n" in out
    assert "import jax.sharding\n" in out and " as P" not in out
    assert 'P = {"w": jnp.ones((4, 4))}' in out


def test_a_name_that_cannot_be_made_is_reported_not_written(tmp_path):
    text = source("""
        jax = "not jax"
        P = "not P"


        def f(x):
            return x
    """)
    path = put_file(tmp_path, "clash.py", text)
    found = patch([contract(path, "f", {"x": 'Float[Array, "b", P("dp")]'})])
    [missing] = found.missing
    assert missing.name == "x"
    assert "cannot write `P` (jax.sharding.PartitionSpec)" in missing.reason
    assert "binds `P` and `jax` to other things" in missing.reason
    assert found.changes == ()  # nothing annotated: no decorator, no import


def test_functions_not_found_are_reported_with_the_reason(tmp_path):
    text = source("""
        import sys

        if sys.platform == "win32":
            def f(x):
                return x
        else:
            def f(x):
                return -x


        async def fetch(x):
            return x


        def outer(x):
            def inner(y):
                return y
            return inner(x)
    """)
    path = put_file(tmp_path, "several.py", text)
    spec = 'Float[Array, "b"]'
    contracts = [
        Contract(path, "f", 7, {"x": spec}, None, NEEDS),  # the second def of f
        Contract(path, "f", 2, {"x": spec}, None, NEEDS),
        contract(path, "fetch", {"x": spec}),
        contract(path, "outer.<locals>.inner", {"y": spec}),
        Contract(path, "gone", 1, {"x": spec}, None, NEEDS),
        Contract(str(tmp_path / "absent.py"), "f", 1, {"x": spec}),
        contract(path, "outer", {"x": spec, "z": spec, "y": "$"}),
    ]
    found = patch(contracts)
    reasons = {
        (m.contract.qualname, m.contract.lineno, m.name): m.reason
        for m in found.missing
    }
    assert reasons == {
        (
            "f",
            2,
            None,
        ): "several.py defines it 2 times (lines 4, 7), and none at line 2",
        ("fetch", 11, None): "it is an async def, left as it is",
        ("outer.<locals>.inner", 16, None): (
            "it is defined inside another function, whose annotations are not "
            "written (only functions of modules and methods of classes are)"
        ),
        ("gone", 1, None): "several.py has no def of that name",
        ("f", 1, None): "its file cannot be read (No such file or directory)",
        ("outer", 15, "z"): "it has no parameter 'z'",
        ("outer", 15, "y"): "it has no parameter 'y'",
    }
    [out] = written(tmp_path, contracts).values()
    assert f"    {JAXTYPED}\n    def f(x: {spec}):\n        return -x" in out
    assert out.count(JAXTYPED) == 2  # the second f, and outer
    assert "async def fetch(x):" in out and "def inner(y):" in out


KINDS = source("""
    # Copyright 2026 The Authors.

    def f(a, b, /, c, *, d=None, **kw):
        return a


    class Outer:
        class Inner:
            @staticmethod
            def g(x, y):  # a comment
                return x

            @classmethod
            def h(cls, x,
                  y,  # why y
                  ):
                return x
""")


def test_every_kind_of_parameter_and_method(tmp_path):
    path = put_file(tmp_path, "kinds.py", KINDS)
    s = 'Shaped[Array, "batch seq d", P("dp", None, None)]'
    needs = imports_for({"Shaped", "Array", "P"})
    contracts = [
        contract(path, "f", dict.fromkeys("abcd", s) | {"kw": s}, s, imports=needs),
        contract(path, "Outer.Inner.g", {"x": s, "y": s}, imports=needs),
        contract(path, "Outer.Inner.h", {"cls": s, "x": s, "y": "int"}, imports=needs),
    ]
    found = patch(contracts)
    assert [(m.contract.qualname, m.name) for m in found.missing] == [
        ("f", "kw"),
        ("Outer.Inner.h", "cls"),
    ]
    [out] = written(tmp_path, contracts).values()
    assert out == source(f"""
        # Copyright 2026 The Authors.

        import jaxshard
        from beartype import beartype
        from jax import Array
        from jax.sharding import PartitionSpec as P
        from jaxshard import Shaped


        {JAXTYPED}
        def f(
            a: {s},
            b: {s},
            /,
            c: {s},
            *,
            d: {s} | None = None,
            **kw,
        ) -> {s}:
            return a


        class Outer:
            class Inner:
                @staticmethod
                {JAXTYPED}
                def g(
                    x: {s},
                    y: {s},
                ):  # a comment
                    return x

                @classmethod
                {JAXTYPED}
                def h(cls, x: {s},
                      y: int,  # why y
                      ):
                    return x
    """)  # a signature with comments in it keeps its layout


def test_the_first_imports_of_a_module_come_after_its_docstring(tmp_path):
    path = put_file(
        tmp_path, "doc.py", '"""Only a docstring."""\ndef k(x):\n    return x\n'
    )
    [out] = written(tmp_path, [Contract(path, "k", 2, {"x": "int"})]).values()
    assert out == source(f'''
        """Only a docstring."""

        import jaxshard
        from beartype import beartype


        {JAXTYPED}
        def k(x: int):
            return x
    ''')


def test_a_file_that_does_not_parse_is_reported(tmp_path):
    path = put_file(tmp_path, "broken.py", "def f(x):\n  return (\n")
    found = patch([Contract(path, "f", 1, {"x": "int"})])
    [missing] = found.missing
    assert missing.reason.startswith("its file does not parse")
    assert found.changes == ()


def test_a_parameter_annotation_that_is_not_python_is_reported(tmp_path):
    path = put_file(tmp_path, "bad.py", "def f(x, y):\n    return x\n")
    found = patch([Contract(path, "f", 1, {"x": "Float[", "y": "int"})])
    [missing] = found.missing
    assert missing.name == "x" and "'Float[' is not a Python expression" in str(missing)
    [change] = found.changes
    assert f"{JAXTYPED}\ndef f(x, y: int):\n" in change.after


def test_crlf_line_endings_a_byte_order_mark_and_tabs_are_kept(tmp_path):
    text = (
        '\ufeff"""Windows-made, tab-indented."""\r\n'
        "import jax\r\n"
        "\r\n"
        "\r\n"
        "class Attention:\r\n"
        "\tdef __call__(self, queries, keys, values, bias):\r\n"
        "\t\treturn queries  # \tthe queries\r\n"
    )
    path = put_file(tmp_path, "windows.py", text.encode("utf-8"))
    spec = 'Float[Array, "batch seq heads hd", P("dp", None, "tp", None)]'
    names = ("queries", "keys", "values", "bias")
    contracts = [contract(path, "Attention.__call__", dict.fromkeys(names, spec), spec)]
    [out] = written(tmp_path, contracts).values()
    assert out.startswith('\ufeff"""Windows-made, tab-indented."""\r\nimport jax\r\n')
    assert "\n" not in out.replace("\r\n", "")
    assert (
        f"\t{JAXTYPED}\r\n\tdef __call__(\r\n\t\tself,\r\n\t\tqueries: {spec},\r\n"
        in out
    )
    assert f"\t\tbias: {spec},\r\n\t) -> {spec}:\r\n" in out
    assert "\t\treturn queries  # \tthe queries\r\n" in out
    load(path)


def test_the_written_contract_holds_and_catches_a_wrong_layout(tmp_path, explicit_mesh):
    text = source("""
        import jax.numpy as jnp


        def dense(x, w):
            return jnp.tanh(x @ w)
    """)
    path = put_file(tmp_path, "dense.py", text)
    contracts = [
        contract(
            path,
            "dense",
            {
                "x": 'Float[Array, "batch d", P("dp", None)]',
                "w": 'Float[Array, "d h", P(None, "tp")]',
            },
            'Float[Array, "batch h", P("dp", "tp")]',
        )
    ]
    written(tmp_path, contracts)
    dense = load(path).dense
    with jax.set_mesh(explicit_mesh):
        x = put((8, 4), explicit_mesh, P("dp", None))
        w = put((4, 6), explicit_mesh, P(None, "tp"))
        assert dense(x, w).shape == (8, 6)
        with pytest.raises(jaxshard.ShardingError, match="'w'"):
            dense(x, put((4, 6), explicit_mesh, P("tp", None)))


def test_a_merged_import_longer_than_a_line_is_wrapped(tmp_path):
    text = source("""
        from jaxshard import BFloat16, Bool, Complex, Float16, Float32, Float64, Int8


        def f(x):
            return x
    """)
    path = put_file(tmp_path, "many.py", text)
    needs = imports_for({"Float", "Array", "UInt32"})
    found = contract(
        path, "f", {"x": 'UInt32[Array, "n"]'}, 'Float[Array, "n"]', imports=needs
    )
    [out] = written(tmp_path, [found]).values()
    assert (
        source("""
        from jaxshard import (
            BFloat16,
            Bool,
            Complex,
            Float16,
            Float32,
            Float64,
            Int8,
            Float,
            UInt32,
        )
    """)
        in out
    )
    assert max(map(len, out.splitlines())) <= 88


def test_diff_and_write_take_contracts_directly(tmp_path):
    path = put_file(tmp_path, "m.py", "def f(x):\n    return x")  # no last newline
    contracts = [Contract(path, "f", 1, {"x": "int"}, "int")]
    text = diff(contracts)
    assert text.endswith("     return x\n\\ No newline at end of file\n")
    applied(tmp_path, patch(contracts))
    assert write(contracts) == [path]
    assert (
        pathlib.Path(path).read_text().endswith("def f(x: int) -> int:\n    return x")
    )


def test_nothing_is_written_over_a_file_changed_since_the_diff(tmp_path):
    path = put_file(tmp_path, "m.py", "def f(x):\n    return x\n")
    found = patch([Contract(path, "f", 1, {"x": "int"})])
    put_file(tmp_path, "m.py", "def f(x):\n    return x + 1\n")
    with pytest.raises(
        RuntimeError, match="m.py changed since its contracts were made"
    ):
        found.write()
    assert pathlib.Path(path).read_text() == "def f(x):\n    return x + 1\n"


def test_imports_are_named_as_python_writes_them():
    assert str(Import("jax.sharding", "PartitionSpec", "P")) == (
        "from jax.sharding import PartitionSpec as P"
    )
    assert Import("jax.sharding").bound == "jax"
    assert Import("jaxshard", "L").bound == "L"
    assert imports_for({"P", "L", "Array"}) == (
        Import("jax", "Array"),
        Import("jaxshard", "L"),
        Import("jax.sharding", "PartitionSpec", "P"),
    )


# Random signatures, some of their parameters annotated already, and contracts for
# some of them: what was there stays, the rest is written, and the round trip holds.
NAMES = ["x", "y", "scale", "mask", "weights", "bias", "key", "cache"]


@st.composite
def signatures(draw):
    """A method or a function: its parameters (`name`, annotated, default), where a
    bare `*` goes, the parameters the contract annotates and its return value."""
    names = draw(st.lists(st.sampled_from(NAMES), min_size=1, max_size=6, unique=True))
    star = draw(st.integers(1, len(names)))  # `len(names)`: no `*`
    defaults = draw(st.integers(0, star))  # positional ones with defaults: the last
    params = []
    for i, name in enumerate(names):
        default = i >= star or i >= star - defaults
        params.append(
            (
                name,
                draw(st.booleans()),
                draw(st.sampled_from(["None", "1"])) if default else None,
            )
        )
    wanted = draw(st.lists(st.sampled_from(names), unique=True))
    returns = draw(st.sampled_from([None, 'Float[Array, "n"]']))
    return draw(st.booleans()), params, star, wanted, returns


def signature(params, star) -> str:
    out = []
    for i, (name, annotated, default) in enumerate(params):
        if i == star:
            out.append("*")
        text = name + (": int" if annotated else "")
        if default is not None:
            text += f" = {default}" if annotated else f"={default}"
        out.append(text)
    return ", ".join(out)


@settings(max_examples=60, deadline=None)
@given(signatures())
def test_random_signatures_round_trip(drawn):
    method, params, star, wanted, returns = drawn
    spec = 'Float[Array, "batch seq d", P("dp", None, None)]'
    header = f"def f({'self, ' if method else ''}{signature(params, star)}):\n"
    text = "import jax\n\n\n" + (
        "class C:\n" + textwrap.indent(header + "    return 0\n", "    ")
        if method
        else header + "    return 0\n"
    )
    annotated = {name for name, a, _ in params if a}
    with tempfile.TemporaryDirectory() as folder, contextlib.chdir(folder):
        folder = pathlib.Path(folder)
        path = put_file(folder, "m.py", text)
        qualname = "C.f" if method else "f"
        contracts = [
            Contract(
                path, qualname, 4 + method, dict.fromkeys(wanted, spec), returns, NEEDS
            )
        ]
        found = patch(contracts)
        assert {k.name for k in found.kept} == set(wanted) & annotated
        assert found.missing == ()
        assert written(folder, contracts) == {c.path: c.after for c in found.changes}
        out = pathlib.Path(path).read_text()
    tree = ast.parse(out)
    f = tree.body[-1].body[0] if method else tree.body[-1]
    defaults = {name: default for name, _, default in params}
    for arg in f.args.args[method:] + f.args.kwonlyargs:
        got = None if arg.annotation is None else ast.unparse(arg.annotation)
        if arg.arg in annotated:
            assert got == "int"
        elif arg.arg in wanted:
            allowed = " | None" if defaults[arg.arg] == "None" else ""
            assert got == ast.unparse(ast.parse(spec + allowed))
        else:
            assert got is None
    changed = bool(set(wanted) - annotated) or returns is not None
    removed = [line for line in text.splitlines(True) if "def f(" in line]
    assert removed_lines(text, out) == (removed if changed else [])
    assert (JAXTYPED in out) == (changed or bool(annotated))
    new = set(out.splitlines()) - set(text.splitlines())
    assert all(len(line) <= 88 for line in new)


def test_without_libcst_the_error_says_what_to_install(tmp_path, monkeypatch):
    path = put_file(tmp_path, "m.py", "def f(x):\n    return x\n")
    monkeypatch.setitem(sys.modules, "libcst", None)  # as if not installed
    for name in ("jaxshard._annotate.edit", "jaxshard._annotate.imports"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    with pytest.raises(ImportError, match=r"pip install 'jaxshard\[annotate\]'"):
        patch([Contract(path, "f", 1, {"x": "int"})])


def test_a_patch_says_what_it_changes_keeps_and_could_not_write(tmp_path):
    path = put_file(tmp_path, "m.py", "def f(x: int, y):\n    return x\n")
    found = patch([Contract(path, "f", 1, {"x": "float", "y": "int", "z": "int"})])
    assert str(found) == (
        "1 file changed.\n"
        "Annotations kept that say something else:\n"
        "  m.py:1: f: parameter 'x' keeps its annotation int; annotate saw float\n"
        "Not written:\n"
        "  m.py:1: f: it has no parameter 'z'"
    )
