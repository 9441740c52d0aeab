"""A training command that acts as if it ran on a host of its own (its run lease names a machine no other process
shares, so another start can judge it only by its renewal), with a lease renewed every HEARTBEAT_S seconds and
stale after STALE_S; with STOP_AT > 0 it stops itself (SIGSTOP) during step STOP_AT, as a stalled node would.

    python tests/trainer_on_a_host_of_its_own.py HEARTBEAT_S STALE_S STOP_AT apps.bert.train key=value ...
"""

import functools
import importlib
import os
import signal
import sys

from lingua import train as loop
from lingua.training import lifecycle
from lingua.training import step as training_step

HEARTBEAT_S, STALE_S, STOP_AT = float(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
holder, clip_gradients, steps_done = lifecycle.lease_holder, training_step.clip_gradients, 0


def on_its_own_host() -> dict:
    return {**holder(), "machine": f"host-of-pid-{os.getpid()}"}


def clip_then_stall(model, max_norm):
    global steps_done
    steps_done += 1
    if steps_done == STOP_AT:
        os.kill(os.getpid(), signal.SIGSTOP)
    return clip_gradients(model, max_norm)


lifecycle.lease_holder, training_step.clip_gradients = on_its_own_host, clip_then_stall
loop.RunLock = functools.partial(lifecycle.RunLock, heartbeat_s=HEARTBEAT_S, stale_after_s=STALE_S)
loop.main(importlib.import_module(sys.argv[4]).APP, sys.argv[5:])
