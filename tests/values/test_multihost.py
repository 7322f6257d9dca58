"""Several JAX processes joined over loopback, as a pod's hosts are: every process
gives the same verdict, with the same message, and none is left waiting in a
collective. What each process runs is in `multihost.py`."""

import json
import os

import pytest

import jaxshard


HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
LIMIT = 120  # seconds a launch may take; a process still running then is killed
PROMPT = LIMIT / 2  # "well within the limit"
DEVICES = 8  # in all, over the processes


@pytest.fixture(params=[2, 4], ids=lambda n: f"{n}-processes")
def processes(request):
    return request.param


def launch(name: str, processes: int, *args, timeout: float = LIMIT) -> list:
    path = os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")])
    return jaxshard.launch(
        f"multihost:{name}",
        processes=processes,
        devices=DEVICES // processes,
        timeout=timeout,
        args=args,
        env={"PYTHONPATH": path},
    )


def all_raise(outcomes: list, error: str) -> str:
    """Asserts every process raised `error`, the same message, promptly; returns the
    message."""
    for o in outcomes:
        assert not o.timed_out and o.seconds < PROMPT, (o.seconds, o.output[-3000:])
        assert o.error == error, o.output[-3000:]
        assert o.returncode == 1
    messages = {o.message for o in outcomes}
    assert len(messages) == 1, messages
    return messages.pop()


def test_passing_contracts(processes):
    outcomes = launch("passing", processes)
    for o in outcomes:
        assert o.ok, o.output[-3000:]
    assert len({json.dumps(o.returned) for o in outcomes}) == 1
    found = outcomes[0].returned
    ways = ("eager", "jit", "shard_map", "verify")
    assert all(found[f"{w}, {k}"] is True for w in ways for k in ("Explicit", "Auto"))


def test_sharding_violation(processes):
    outcomes = launch("sharding_violation", processes)
    last = all_raise(outcomes, "jaxshard.ShardingError")
    assert "- mislabeled, the return value" in last
    caught = []
    for o in outcomes:
        (line,) = [x for x in o.output.splitlines() if x.startswith("MESSAGES ")]
        caught.append(json.loads(line.removeprefix("MESSAGES ")))
    assert all(c == caught[0] for c in caught)
    assert sorted(caught[0]) == sorted(
        f"{w}, {k}"
        for w in ("eager", "jit", "shard_map", "verify")
        for k in ("Explicit", "Auto")
        if (w, k) != ("verify", "Auto")  # the last: raised out of the process
    )
    for name, message in caught[0].items():
        assert (
            "is sharded as P('dp', None) (float32[16@dp,8]), but the annotation "
            "expects P(None, 'dp') (float32[16,8@dp])"
            in message
            or "differs across the shard_map mesh axes" in message
        ), (name, message)
    assert "found when XLA compiled it" in caught[0]["jit, Auto"]
    assert "- mislabeled, the return value" in caught[0]["verify, Explicit"]


@pytest.mark.parametrize("mode", ["raise", "deferred", "deferred-70", "python"])
def test_value_violation_on_one_process(processes, mode):
    """The bad value is in the last process's rows only; every process reports it,
    with its value and position, read through the compiled program."""
    message = all_raise(
        launch("value_violation", processes, mode), "jaxshard.CheckError"
    )
    assert "x is nan" in message and "first at element [15, 3]" in message
    assert "tree['x'] holds NaN or infinity" in message
    assert ("call 3" in message) == mode.startswith("deferred")


def test_value_violation_inside_shard_map(processes):
    message = all_raise(
        launch("shard_map_value_violation", processes), "jaxshard.CheckError"
    )
    assert "block value 77.0" in message and "device dp=7" in message


def test_eager_check_across_processes():
    message = all_raise(launch("eager_value_violation", 2), "jaxshard.CheckError")
    assert "x is 99.0" in message and "first at element [15, 3]" in message


# --- the launcher itself --------------------------------------------------------------


def test_a_hang_is_killed_at_the_time_limit():
    outcomes = launch("hang", 2, timeout=20)
    assert outcomes[1].error == "builtins.RuntimeError" and not outcomes[1].timed_out
    assert outcomes[0].timed_out and not outcomes[0].ok
    assert outcomes[0].seconds < 30


def test_launch_takes_a_file_path_and_arguments():
    (outcome,) = jaxshard.launch(
        os.path.join(HERE, "multihost.py") + ":describe", processes=1, args=(3,)
    )
    assert outcome.ok and outcome.returned == {"processes": 1, "devices": 4, "x": 3}


def test_an_unknown_target_is_every_processs_error():
    outcomes = launch("no_such_function", 2, timeout=60)
    assert [o.error for o in outcomes] == ["builtins.AttributeError"] * 2
    assert all(not o.timed_out and "no_such_function" in o.message for o in outcomes)


def test_launch_refuses_bad_input():
    with pytest.raises(ValueError, match="module:function"):
        jaxshard.launch("multihost.passing")
    with pytest.raises(ValueError, match="at least 1"):
        jaxshard.launch("multihost:passing", processes=0)
    with pytest.raises(TypeError):
        jaxshard.launch("multihost:passing", args=(object(),))
