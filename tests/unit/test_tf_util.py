"""horovod.tensorflow.util: Horovod's helpers behave as Horovod's do, and `import horovod.tensorflow.util` serves
them under the alias."""

import subprocess
import sys

import pytest

tf = pytest.importorskip("tensorflow")

from hvdplus.runner.alias import ALIAS_PATH  # noqa: E402
from hvdplus.tensorflow import util  # noqa: E402


def test_executing_eagerly_follows_the_mode():
    seen = []
    tf.function(lambda: seen.append(util._executing_eagerly()))()
    with tf.Graph().as_default():
        seen.append(util._executing_eagerly())
    assert [util._executing_eagerly(), *seen] == [True, False, False]


def test_make_subgraph_is_a_tf_function():
    double = util._make_subgraph(lambda x: x * 2)
    assert hasattr(double, "get_concrete_function") and double(tf.constant(3)).numpy() == 6


def test_cache_keys_on_the_arguments_and_the_mode():
    """Horovod's _cache: one call of `f` per (args, executing eagerly)."""
    calls = []

    @util._cache
    def build(*args):
        calls.append((args, tf.executing_eagerly()))
        return len(calls)

    assert [build(1), build(1), build(2)] == [1, 1, 2]
    with tf.Graph().as_default():
        assert [build(1), build(1)] == [3, 3]
    assert calls == [((1,), True), ((2,), True), ((1,), False)]


def test_vars_to_refs_and_back_keep_nesting_and_identity():
    a, b, c = tf.Variable(1.0), tf.Variable(2.0), tf.Variable(3.0)
    refs = util.vars_to_refs([a, [b, c]])
    assert isinstance(refs, tuple) and hash(refs) == hash(util.vars_to_refs([a, [b, c]]))
    back = util.refs_to_vars(refs)
    assert back[0] is a and back[1][0] is b and back[1][1] is c
    assert util.refs_to_vars(util.vars_to_refs(a)) is a


def test_horovod_tensorflow_util_under_the_alias():
    """hvdplus/runner/horovod_alias maps every `horovod.X` onto `hvdplus.X`, submodules included."""
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); "
        "import horovod.tensorflow as hvd, horovod.tensorflow.util as util, hvdplus.tensorflow.util as own; "
        "from horovod.tensorflow.util import _cache, _executing_eagerly, _make_subgraph, vars_to_refs, refs_to_vars; "
        "assert util is own is hvd.util and _executing_eagerly(); print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, ALIAS_PATH], capture_output=True, text=True, timeout=240, env=None
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
