"""engine/threads.py: the BLAS thread count chosen for a machine, the user's environment, --threads."""

from __future__ import annotations

import pytest
from minecart.engine.threads import (
    THREAD_ENV_VARS,
    configure_threads,
    default_threads,
    threads_from_argv,
)


def test_small_machines_get_one_thread_big_ones_half_at_most_eight():
    assert [default_threads(n) for n in (1, 2, 3, 4, 6, 8, 16, 64)] == [1, 1, 1, 1, 3, 4, 8, 8]


def test_configure_sets_every_variable_unless_the_user_did():
    env: dict[str, str] = {}
    choice = configure_threads(cores=2, env=env)
    assert env == dict.fromkeys(THREAD_ENV_VARS, "1") and choice.source == "default"
    env = {"OMP_NUM_THREADS": "4"}
    choice = configure_threads(cores=2, env=env)
    assert env == {"OMP_NUM_THREADS": "4"} and choice.source == "environment"
    choice = configure_threads(6, cores=2, env=env)  # --threads wins over the environment
    assert env == dict.fromkeys(THREAD_ENV_VARS, "6") and choice.threads == 6
    with pytest.raises(ValueError, match="at least 1"):
        configure_threads(0, env={})


def test_threads_flag_is_read_before_argparse():
    assert threads_from_argv(["run", "m.gguf", "--threads", "3"]) == 3
    assert threads_from_argv(["bench", "--threads=5", "x"]) == 5
    assert threads_from_argv(["run", "--threads", "many"]) is None  # argparse reports it later
    assert threads_from_argv(["run", "--", "--threads", "3"]) is None
    assert threads_from_argv(["run", "-p", "hi"]) is None
