"""Whether other processes ran on this machine while a cost probe timed a call, and turns for the probes of the
workers that share it.

A worker's measured costs are the cost policy's prior: a probe call timed while another process computed (the other
worker of the pair loading or measuring its own costs: both start together, `make run` and `coordinator bench` start
them so) reads slow, and the policy then prices target-only decoding too high and drafts where drafting loses. Measured
on 2 cores, transformers bfloat16: the 1.5B verifier alone, 253 ms a one-token pass; with the 0.5B drafter measuring at
the same time, 305 ms (and 358 ms in one bench run whose steps then took 255 ms); the drafter's 96-116 ms a token
read 411-564 ms beside the verifier. So the
probes of one machine take turns (probe_turn: a lock file in the specmesh cache), and a call during which other
processes used a fair share of a core is made again (OthersCpu).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

from specmesh.runtime.catalog import file_lock

log = logging.getLogger(__name__)

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")  # /proc/stat counts in clock ticks
# A call is disturbed where other processes used more than this share of one core over it (on average), beyond what
# the ticks' rounding can make up: a process computing beside it uses a whole core.
BUSY_SHARE = 0.25
# Calls shorter than this are never judged: the ticks' rounding is as large as what another process could do in them
# (the probe calls of the real models take 40 ms and more; a tiny test model's, a few milliseconds).
MIN_JUDGED_S = 0.03


def machine_busy_s() -> float | None:
    """CPU seconds all cores have spent busy since boot (/proc/stat); None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice, already counted in user and nice]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) * TICK_S


@dataclass
class OthersCpu:
    """What other processes did during a `with` block: their CPU seconds (all cores) and the block's wall time.

    Own threads count as own (time.process_time covers every thread of this process). Unknown (no /proc/stat):
    never busy."""

    wall_s: float = 0.0
    others_s: float | None = None

    def __enter__(self) -> "OthersCpu":
        self._machine, self._own, self._wall = machine_busy_s(), time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        machine = machine_busy_s()
        self.wall_s = time.perf_counter() - self._wall
        if machine is not None and self._machine is not None:
            self.others_s = max(machine - self._machine - (time.process_time() - self._own), 0.0)

    @property
    def busy(self) -> bool:
        """Other processes used more than BUSY_SHARE of a core over the block, beyond a tick per core each side of
        it (the rounding of /proc/stat); a block shorter than MIN_JUDGED_S is never judged."""
        if self.others_s is None or self.wall_s < MIN_JUDGED_S:
            return False
        slack = 2 * TICK_S * (os.cpu_count() or 1)
        return self.others_s > BUSY_SHARE * self.wall_s + slack


@contextmanager
def probe_turn(lock_path) -> Iterator[None]:
    """Hold this machine's probe turn: one probe call at a time among the workers that share `lock_path` (the catalog's
    inter-process file_lock, released by the kernel if the holder dies). Without the lock file (a read-only cache), no
    turns."""
    with ExitStack() as turn:
        try:
            turn.enter_context(file_lock(lock_path))
        except OSError as e:
            log.debug("no probe turns (%s): probing without them", e)
        yield
