"""The TensorFlow Engine's compiled steps: the flat entry point gives what the public tf.function
call gives, retraces only for a new input signature, really bypasses the public call once traced,
and falls back to it when TensorFlow's private entry point is missing."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from elasticflow.backends.tensorflow.compiled import Compiled  # noqa: E402


def _step_with_state():
    """A step that reads a captured tensor and updates a captured variable, like the Engine's."""
    table = tf.constant(np.arange(20, dtype=np.float32).reshape(10, 2))
    total = tf.Variable(0.0)

    def step(idx):
        rows = tf.gather(table, idx)
        total.assign_add(tf.reduce_sum(rows))
        return tf.stack([tf.reduce_mean(rows), total])

    return step, total


def test_flat_entry_gives_the_public_calls_results_and_state():
    step, total = _step_with_state()
    public_step, public_total = _step_with_state()
    compiled, public = Compiled(step), tf.function(public_step, autograph=False)
    for positions in ([1, 2, 3], [4, 5, 6], [9, 0], [7, 7, 7]):
        idx = tf.constant(np.array(positions, np.int64))
        np.testing.assert_array_equal(compiled(idx).numpy(), public(idx).numpy())
    assert float(total.numpy()) == float(public_total.numpy()) > 0  # the variable moved on each call


def test_one_trace_per_input_signature():
    compiled = Compiled(lambda batch: tf.reduce_sum(batch[0]) + tf.cast(tf.reduce_sum(batch[1]), tf.float32))
    x3, y3 = tf.ones([3, 2]), tf.ones([3], tf.int64)
    for _ in range(3):
        assert float(compiled((x3, y3))) == 9.0
    assert compiled.experimental_get_tracing_count() == 1
    assert float(compiled((tf.ones([5, 2]), tf.ones([5], tf.int64)))) == 15.0  # new shape: traced
    assert float(compiled((x3, tf.ones([3], tf.int32)))) == 9.0               # new dtype: traced
    assert compiled.experimental_get_tracing_count() == 3
    compiled((x3, y3))
    assert compiled.experimental_get_tracing_count() == 3


def test_a_traced_signature_no_longer_goes_through_the_public_call(monkeypatch):
    step, _ = _step_with_state()
    compiled = Compiled(step)
    idx = tf.constant(np.array([0, 1], np.int64))
    first = compiled(idx).numpy()

    def refuse(*args, **kwargs):
        raise AssertionError("the public tf.function call ran")

    monkeypatch.setattr(type(compiled.function), "__call__", refuse)
    second = compiled(idx).numpy()
    assert second[1] == 2 * first[1]  # it ran: the variable was added to twice


def test_without_the_private_entry_point_the_public_call_is_used(monkeypatch):
    step, total = _step_with_state()
    compiled = Compiled(step)
    real = compiled.function.get_concrete_function
    # A TensorFlow whose concrete functions lack the private attributes the flat call needs.
    monkeypatch.setattr(compiled.function, "get_concrete_function",
                        lambda inputs: SimpleNamespace(captured_inputs=real(inputs).captured_inputs))
    idx = tf.constant(np.array([1, 2], np.int64))
    np.testing.assert_array_equal(compiled(idx).numpy(), [3.5, 14.0])
    np.testing.assert_array_equal(compiled(idx).numpy(), [3.5, 28.0])
    assert float(total.numpy()) == 28.0


def test_shapes_that_keep_changing_are_traced_a_bounded_number_of_times():
    """A collate that pads each micro-batch to its own length: past EXACT_SHAPES signatures the varying
    dimension is traced as unknown, and every length after that reuses the one trace (right results)."""
    from elasticflow.backends.tensorflow.compiled import EXACT_SHAPES

    compiled = Compiled(lambda batch: tf.reduce_sum(batch[0] * 2.0) + tf.cast(tf.shape(batch[1])[1], tf.float32))
    for length in range(1, 41):
        x = np.ones((4, length, 3), np.float32)
        mask = np.ones((4, length), np.int64)
        got = compiled((tf.constant(x), tf.constant(mask)))
        assert float(got.numpy()) == 2.0 * x.sum() + length
    assert compiled.experimental_get_tracing_count() == EXACT_SHAPES + 1
    compiled((tf.constant(np.ones((3, 7, 3), np.float32)), tf.constant(np.ones((3, 7), np.int64))))
    assert compiled.experimental_get_tracing_count() == EXACT_SHAPES + 2  # the batch dimension now varies too
