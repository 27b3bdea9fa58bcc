"""A Keras 2-era Horovod script, unmodified: Horovod's examples/tensorflow2/tensorflow2_keras_mnist.py on random
images instead of MNIST (no download), with the Keras 2 idioms such scripts have: `SGD(lr=...)`,
`compile(..., experimental_run_tf_function=False)` and `optimizer.lr`. Run through hvdplusrun's `horovod` alias
by tests/integration/test_horovod_tf_scripts.py."""

import numpy as np
import tensorflow as tf

import horovod.tensorflow.keras as hvd

# Horovod: initialize Horovod.
hvd.init()

rng = np.random.default_rng(hvd.rank())
images = rng.random((256, 8, 8, 1)).astype(np.float32)
labels = (images.mean(axis=(1, 2, 3)) > 0.5).astype(np.int64)
dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().shuffle(256).batch(32)

model = tf.keras.Sequential([
    tf.keras.layers.Input((8, 8, 1)),
    tf.keras.layers.Conv2D(8, [3, 3], activation='relu'),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(2, activation='softmax')
])

# Horovod: adjust learning rate based on number of GPUs.
scaled_lr = 0.1 * hvd.size()
opt = tf.keras.optimizers.SGD(lr=scaled_lr)

# Horovod: add Horovod DistributedOptimizer.
opt = hvd.DistributedOptimizer(opt)

# Horovod: Specify `experimental_run_tf_function=False` to ensure TensorFlow
# uses hvd.DistributedOptimizer() to compute gradients.
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(),
              optimizer=opt,
              metrics=['accuracy'],
              experimental_run_tf_function=False)

callbacks = [
    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    # Horovod: average metrics among workers at the end of every epoch.
    hvd.callbacks.MetricAverageCallback(),
    # Horovod: using `lr = 1.0 * hvd.size()` from the very beginning leads to worse final accuracy.
    hvd.callbacks.LearningRateWarmupCallback(initial_lr=scaled_lr, warmup_epochs=1, verbose=1),
]

# Horovod: write logs on worker 0.
verbose = 2 if hvd.rank() == 0 else 0

# Train the model.
history = model.fit(dataset, steps_per_epoch=16 // hvd.size(), callbacks=callbacks, epochs=2, verbose=verbose)

checksum = sum(float(np.sum(w)) for w in model.get_weights())
agree = abs(float(hvd.allreduce(checksum, name='checksum')) - checksum) < 1e-5
print('rank %d: lr %.2f, loss %.3f, weights agree: %s' % (hvd.rank(), float(model.optimizer.lr),
                                                        history.history['loss'][-1], agree), flush=True)
