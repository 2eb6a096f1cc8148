"""The releaser thread and interpreter exit: a cleanup call that is dropping device arrays
when the program ends must not abort the process (it did: exit code 134)."""

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.fast

#: A program whose last act queues a cleanup that drops 2,000 device arrays over about a
#: second, and exits once that cleanup has started: JAX's exit hook frees the backends
#: while the releaser thread still drops arrays, unless the releaser is closed first.
EXIT_DURING_CLEANUP = textwrap.dedent(
    """
    import threading, time
    import jax.numpy as jnp
    from meshshard.runtime.release import RELEASER

    box = [jnp.ones((1000,)) + i for i in range(2000)]
    started = threading.Event()

    def drop_slowly():
        started.set()
        while box:
            box.pop()
            time.sleep(0.0005)

    RELEASER.call(drop_slowly)
    started.wait(10)
    print("exiting", flush=True)
    """
)


def test_exit_while_a_cleanup_drops_device_arrays_does_not_abort():
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", EXIT_DURING_CLEANUP],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == "exiting"


def test_closed_releaser_drops_later_calls_and_flush_returns():
    from meshshard.runtime.release import Releaser

    rel = Releaser()
    done = []
    rel.call(lambda: done.append(1))
    rel.flush()
    rel.close()
    rel.call(lambda: done.append(2))
    rel.flush()  # returns at once: nothing will run
    assert done == [1]
