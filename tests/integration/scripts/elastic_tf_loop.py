"""An elastic TensorFlow job for the tests: a custom loop (a tf.function step with hvd.DistributedGradientTape and
SGD with momentum in plain tf.Variables) kept in a TensorFlowState. Every rank trains on the same batch, which
depends only on the committed step count, so the averaged gradient does not depend on the size: after STEPS steps
the weights equal a one-process run's, however many workers failed on the way.

Environment: STEPS (default 12), RAISE="<worker id>:<step>" (the worker raises right after the commit of that step,
in its first life), GROW="<hosts file>:<step>" (after that step's commit rank 0 adds 127.0.0.1:1 to the discovery
script's hosts file and waits for the launcher to plan the bigger generation). Without hvdplusrun it runs as one
process: the reference.
Prints {"step", "rank", "size", "worker"} per committed step and {"final": weights, "rank", "size"} at the end.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import hvdplus.tensorflow as hvd  # noqa: E402

STEPS = int(os.environ.get("STEPS", "12"))
WORKER = os.environ.get("HVDPLUS_ELASTIC_WORKER", "single/0")
FIRST_LIFE = os.environ.get("HVDPLUS_ELASTIC_GENERATION", "0") == "0"
RAISE = os.environ.get("RAISE", ":").split(":")
GROW = os.environ.get("GROW", ":").rsplit(":", 1)

hvd.init()
weight = tf.Variable(tf.reshape(tf.range(4, dtype=tf.float32), (4, 1)) / 8)
bias = tf.Variable([0.0])
momenta = [tf.Variable(tf.zeros_like(weight)), tf.Variable(tf.zeros_like(bias))]
state = hvd.elastic.TensorFlowState([weight, bias, *momenta], step=0)


@tf.function
def train_step(step: tf.Tensor) -> None:
    inputs = tf.reshape(tf.range(32, dtype=tf.float32), (8, 4)) / 32 * (1.0 + tf.cast(step % 3, tf.float32))
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean((tf.matmul(inputs, weight) + bias - 1.0) ** 2)
    grads = hvd.DistributedGradientTape(tape).gradient(loss, [weight, bias])
    for variable, momentum, grad in zip([weight, bias], momenta, grads):
        momentum.assign(0.9 * momentum + grad)
        variable.assign_sub(0.05 * momentum)


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


@hvd.elastic.run
def train(state):
    while state.step < STEPS:
        train_step(tf.constant(state.step))
        state.step += 1
        state.commit()
        say(step=state.step, rank=hvd.rank(), size=hvd.size(), worker=WORKER)
        if GROW[1] == str(state.step) and hvd.size() == 1:
            with open(GROW[0], "a") as hosts:
                hosts.write("127.0.0.1:1\n")
            assert state.wait_for_host_updates(60)  # the next commit raises HostsUpdatedInterrupt
        if FIRST_LIFE and [WORKER, str(state.step)] == RAISE:
            raise RuntimeError(f"worker {WORKER} fails on purpose after step {state.step}")


train(state)
say(
    final=[float(v) for v in tf.concat([tf.reshape(weight, [-1]), bias], 0).numpy()],
    rank=hvd.rank(),
    size=hvd.size(),
    worker=WORKER,
)
