"""tf.compat.v1 graphs whose collectives the ranks do not share (rank 0 runs one that rank 1 never submits, and
rank 1 one that rank 0 never submits): with HOROVOD_STALL_SHUTDOWN_TIME_SECONDS set, both session runs fail with a
TensorFlow error naming the stalled collective and the missing rank, instead of hanging."""

import os
import re
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import hvdplus.tensorflow as hvd  # noqa: E402

tf.compat.v1.disable_eager_execution()
hvd.init()
fetched = hvd.allreduce(tf.ones([3]), name=f"only.rank.{hvd.rank()}")
start = time.monotonic()
with tf.compat.v1.Session() as session:
    try:
        session.run(fetched)
        print(f"rank {hvd.rank()}: no error", flush=True)
    except tf.errors.OpError as exc:
        why = re.search(r"HorovodInternalError: (.*?) Traceback", " ".join(exc.message.split()))
        print(
            f"rank {hvd.rank()}: raised {type(exc).__name__} after {time.monotonic() - start:.0f} s: "
            f"{why.group(1) if why else exc.message}",
            flush=True,
        )
