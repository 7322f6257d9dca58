"""Saving over a snapshot or a page is whole or not at all (`_verify/files.py`): a
save that fails midway leaves the old file byte for byte and no stray file beside
it; one that succeeds replaces it, keeping its permission bits."""

import errno
import os
import stat
import subprocess
import sys
import textwrap

import pytest
from jax import Array
from jax.sharding import PartitionSpec as P

import jaxshard
from jaxshard import Float
from jaxshard._verify import files


OLD = '{"jaxshard_snapshot": 1, "old": "the golden snapshot, committed"}\n'


def double(x: Float[Array, "b d", P("dp", None)]) -> Float[Array, "b d", P("dp")]:
    return x * 2


@pytest.fixture(scope="module")
def report(auto_mesh):
    return jaxshard.verify(double, mesh=auto_mesh, dims={"b": 8, "d": 4})


def written(folder) -> set[str]:
    return {p.name for p in folder.iterdir()}


@pytest.mark.parametrize("save", ["save", "save_html"])
@pytest.mark.parametrize(
    "error",
    [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), KeyboardInterrupt()],
    ids=["disk full", "interrupted"],
)
def test_a_failed_save_leaves_the_old_file(report, tmp_path, monkeypatch, save, error):
    """The disk fills up (or the user presses Ctrl-C) as the new text is flushed:
    the save raises, the old file is as it was, and nothing else is left in its
    folder."""
    golden = tmp_path / "golden.json"
    golden.write_text(OLD)

    def fail(fd):
        raise error

    monkeypatch.setattr(files.os, "fsync", fail)
    with pytest.raises(type(error)):
        getattr(report, save)(golden)
    assert golden.read_bytes() == OLD.encode()
    assert written(tmp_path) == {"golden.json"}


def test_a_folder_one_may_not_write_to(report, tmp_path, monkeypatch):
    """The error names the file the user asked for, not the temporary one."""

    def refused(name, *args):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), name)

    monkeypatch.setattr(files.os, "open", refused)
    golden = tmp_path / "golden.json"
    with pytest.raises(PermissionError) as e:
        report.save(golden)
    assert e.value.filename == str(golden) and written(tmp_path) == set()


def test_a_successful_save_replaces_the_file_and_keeps_its_mode(report, tmp_path):
    golden = tmp_path / "golden.json"
    golden.write_text(OLD)
    golden.chmod(0o640)
    report.save(golden)
    assert golden.read_text() != OLD and report.compare(golden) == ()
    assert stat.S_IMODE(golden.stat().st_mode) == 0o640
    assert written(tmp_path) == {"golden.json"}


def test_a_new_file_gets_the_umasks_mode(report, tmp_path):
    old = os.umask(0o027)
    try:
        report.save_html(tmp_path / "pages" / "report.html")
    finally:
        os.umask(old)
    page = tmp_path / "pages" / "report.html"
    assert page.read_text(encoding="utf-8") == report.html()
    assert stat.S_IMODE(page.stat().st_mode) == 0o640


def test_a_link_is_followed(report, tmp_path):
    """A snapshot kept elsewhere behind a symbolic link: the file is replaced, the
    link stays a link."""
    (tmp_path / "store").mkdir()
    target = tmp_path / "store" / "golden.json"
    target.write_text(OLD)
    link = tmp_path / "golden.json"
    link.symlink_to(target)
    report.save(link)
    assert link.is_symlink() and report.compare(target) == ()
    assert written(tmp_path / "store") == {"golden.json"}


FULL_DISK = textwrap.dedent(
    """
    import resource, signal, sys

    import jax
    from jax import Array
    from jax.sharding import PartitionSpec as P

    import jaxshard
    from jaxshard import Float


    def double(x: Float[Array, "b", P("dp")]) -> Float[Array, "b", P("dp")]:
        return x * 2


    def full_disk():
        # No file of this process may grow past 200 bytes: writes beyond fail
        # (EFBIG), as on a full disk, instead of killing the process.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (200, resource.RLIM_INFINITY))


    if __name__ == "__main__" and sys.argv[1] == "api":
        mesh = jax.make_mesh((1,), ("dp",))
        report = jaxshard.verify(double, mesh=mesh, dims={"b": 8})
        full_disk()
        for save, path in zip((report.save, report.save_html), sys.argv[2:]):
            try:
                save(path)
            except OSError as e:
                print(f"refused: {e.strerror}")
    elif __name__ == "__main__":
        from jaxshard._verify.cli import main

        full_disk()
        sys.exit(main(["verify", f"{__file__}:double", "--mesh", "dp=1", "--dim",
                       "b=8", "--snapshot", sys.argv[2]]))
    """
)


def full_disk(tmp_path, *args):
    script = tmp_path / "full_disk.py"
    script.write_text(FULL_DISK)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


@pytest.mark.skipif(sys.platform == "win32", reason="RLIMIT_FSIZE is POSIX's")
def test_a_save_past_a_file_size_limit(tmp_path):
    """The real thing: the system refuses to write past 200 bytes, in a process of
    its own, to `report.save`, `report.save_html` and the command line's
    `--snapshot` alike."""
    golden, page = tmp_path / "golden.json", tmp_path / "report.html"
    golden.write_text(OLD)
    page.write_text("<p>the last good page</p>")
    out = full_disk(tmp_path, "api", golden, page)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["refused: File too large"] * 2
    assert golden.read_text() == OLD
    assert page.read_text() == "<p>the last good page</p>"
    out = full_disk(tmp_path, "cli", golden)
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last == f"cannot write the snapshot {golden}: [Errno 27] File too large"
    assert golden.read_text() == OLD
    assert written(tmp_path) == {"golden.json", "report.html", "full_disk.py"}
