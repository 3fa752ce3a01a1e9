"""A user's loss module that the tests whose jobs run until stopped copy into the job's directory:
the default loss, paced. Unpaced, such a job's workers take both cores while the test drives it,
and so would every other test's beside it. Paced, each step still costs a worker about 14 ms of a
core (gpt-tiny, its replica, the step's calls; measured here), so the pace sets what a job that runs
until it is stopped spends: at 0.05 s, a 2-worker job took 0.57 of a core; at 0.2 s, 0.27."""

import time

from elastic_zero.losses import next_token_loss

PACE_S = 0.2  # per micro batch


def loss(model, batch):
    time.sleep(PACE_S)
    return next_token_loss(model, batch)
