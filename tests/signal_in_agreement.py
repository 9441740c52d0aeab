"""A training command whose rank 1 receives the preemption signal at the worst moment: right after the first
all-reduce that follows step STEP, that is inside the stop agreement, between the reduction and the use of its
result (the only `dist.all_reduce` of a step when nothing is logged, validated or saved).

    torchrun --nproc-per-node 2 tests/signal_in_agreement.py STEP apps.bert.train key=value ...
"""

import importlib
import os
import signal
import sys

import torch.distributed as dist

from lingua import train as loop
from lingua.training import step as training_step

STEP = int(sys.argv[1])
steps_done = 0
clip_gradients, all_reduce = training_step.clip_gradients, dist.all_reduce


def counting_clip_gradients(model, max_norm):
    global steps_done
    steps_done += 1
    return clip_gradients(model, max_norm)


def all_reduce_then_signal(tensor, *args, **kwargs):
    global steps_done
    work = all_reduce(tensor, *args, **kwargs)
    if steps_done == STEP and dist.get_rank() == 1:
        steps_done = -1  # once
        os.kill(os.getpid(), signal.SIGUSR2)  # its handler runs before this call returns
    return work


training_step.clip_gradients, dist.all_reduce = counting_clip_gradients, all_reduce_then_signal
loop.main(importlib.import_module(sys.argv[2]).APP, sys.argv[3:])
