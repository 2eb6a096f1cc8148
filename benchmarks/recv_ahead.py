"""Receives posted ahead of their RECV (``runtime/recv_ahead.py``), on and off, in one run.

    python benchmarks/recv_ahead.py [--stages 2 4] [--steps 30] [--rounds 3]
                                    [--json OUT.json]

``benchmarks/runtime_switch.py --option recv_ahead``: each schedule of the peer GPT on
the local Ray cluster in alternating rounds with each peer's next receive posted ahead
(on, the default) and with every receive posted at its ``RECV``, as the stream is
written (off).  Reported per schedule: the median step of each, and on / off.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.runtime_switch import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(option="recv_ahead"))
