"""Every op of elasticflow.ops on every backend against a numpy reference: values, shapes, layouts, gradients.

One suite, parametrised over the backends: a model file written with these ops means the same
thing everywhere. Gradients are checked against central finite differences of the float64 numpy
reference (a directional derivative per input) and against the other backend.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.special import erf

from elasticflow import ops

BACKENDS = ["torch", "tensorflow"]


@pytest.fixture(params=BACKENDS)
def be(request):
    """The backend module, active in elasticflow.ops for this test (the previous one restored after)."""
    with ops.using(request.param) as module:
        yield module
        module.set_training(True)


def rand(*shape, seed=0):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def T(be, a):
    return be.to_tensor(np.asarray(a))


def N(be, t):
    return be.to_numpy(t)


# ---------------------------------------------------------------- numpy references (float64)
def np_softmax(x, axis=-1):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def np_log_softmax(x, axis=-1):
    z = x - x.max(axis=axis, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=axis, keepdims=True))


def np_gelu(x):
    return 0.5 * x * (1 + erf(x / np.sqrt(2)))


def np_cross_entropy(logits, labels):
    return -np_log_softmax(logits)[np.arange(len(labels)), labels].mean()


def np_layer_norm(x, gamma=None, beta=None, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    y = (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    return y * (1 if gamma is None else gamma) + (0 if beta is None else beta)


def np_conv2d(x, w, b=None, stride=1, padding="valid"):
    """NCHW input, OIHW weights; 'same' pads (k-1)//2 before and the rest after (torch and TF agree)."""
    kh, kw = w.shape[2:]
    if padding == "same":
        pads = ((kh - 1) // 2, kh - 1 - (kh - 1) // 2), ((kw - 1) // 2, kw - 1 - (kw - 1) // 2)
    else:
        p = 0 if padding == "valid" else padding
        pads = (p, p), (p, p)
    xp = np.pad(x, ((0, 0), (0, 0), *pads))
    win = np.lib.stride_tricks.sliding_window_view(xp, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride]
    out = np.einsum("nchwij,ocij->nohw", win, w)
    return out if b is None else out + b[None, :, None, None]


def np_max_pool2d(x, size, stride):
    win = np.lib.stride_tricks.sliding_window_view(x, (size, size), axis=(2, 3))[:, :, ::stride, ::stride]
    return win.max(axis=(-2, -1))


# ---------------------------------------------------------------- values, shapes, layouts
ELEMENTWISE = [("relu", lambda x: np.maximum(x, 0)), ("tanh", np.tanh), ("sigmoid", lambda x: 1 / (1 + np.exp(-x))),
               ("gelu", np_gelu), ("exp", np.exp), ("square", np.square), ("abs", np.abs)]


@pytest.mark.parametrize("name,ref", ELEMENTWISE, ids=[n for n, _ in ELEMENTWISE])
def test_elementwise(be, name, ref):
    x = rand(3, 4)
    np.testing.assert_allclose(N(be, getattr(ops, name)(T(be, x))), ref(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


def test_log_sqrt_maximum(be):
    x = np.abs(rand(5)) + 0.1
    np.testing.assert_allclose(N(be, ops.log(T(be, x))), np.log(x), rtol=1e-6)
    np.testing.assert_allclose(N(be, ops.sqrt(T(be, x))), np.sqrt(x), rtol=1e-6)
    a, b = rand(2, 3), rand(3, seed=1)
    np.testing.assert_array_equal(N(be, ops.maximum(T(be, a), T(be, b))), np.maximum(a, b))  # broadcasts


@pytest.mark.parametrize("sa,sb", [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((2, 3, 4), (2, 4, 5)),
                                   ((2, 1, 3, 4), (5, 4, 2)), ((4,), (4, 5)), ((3, 4), (4,)), ((4,), (4,))])
def test_matmul_follows_numpy_rules(be, sa, sb):
    a, b = rand(*sa), rand(*sb, seed=1)
    out = N(be, ops.matmul(T(be, a), T(be, b)))
    assert out.shape == np.matmul(a, b).shape
    np.testing.assert_allclose(out, np.matmul(a.astype(np.float64), b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [None, 0, 1, -1, (0, 2)])
@pytest.mark.parametrize("keepdims", [False, True])
def test_mean_sum(be, axis, keepdims):
    x = rand(2, 3, 4)
    for op, ref in ((ops.mean, np.mean), (ops.sum, np.sum)):
        out = N(be, op(T(be, x), axis=axis, keepdims=keepdims))
        expected = ref(x.astype(np.float64), axis=axis, keepdims=keepdims)
        assert out.shape == expected.shape
        np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_reshape_transpose_concat(be):
    x = rand(2, 3, 4)
    assert N(be, ops.reshape(T(be, x), (4, -1))).shape == (4, 6)
    np.testing.assert_array_equal(N(be, ops.reshape(T(be, x), [6, 4])), x.reshape(6, 4))
    np.testing.assert_array_equal(N(be, ops.transpose(T(be, x))), x.transpose())
    np.testing.assert_array_equal(N(be, ops.transpose(T(be, x), (1, 0, 2))), x.transpose(1, 0, 2))
    y = rand(2, 1, 4, seed=1)
    np.testing.assert_array_equal(N(be, ops.concat([T(be, x), T(be, y)], axis=1)), np.concatenate([x, y], 1))
    np.testing.assert_array_equal(N(be, ops.concat((T(be, x), T(be, x)))), np.concatenate([x, x]))


@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_log_softmax(be, axis):
    x = rand(4, 5) * 10
    np.testing.assert_allclose(N(be, ops.softmax(T(be, x), axis)), np_softmax(x.astype(np.float64), axis), atol=1e-6)
    np.testing.assert_allclose(N(be, ops.log_softmax(T(be, x), axis)), np_log_softmax(x.astype(np.float64), axis),
                               rtol=1e-5, atol=1e-5)


def test_classification_ops(be):
    logits = rand(6, 5) * 3
    labels = np.array([0, 4, 2, 2, 1, 3], np.int64)
    np.testing.assert_allclose(float(ops.cross_entropy(T(be, logits), T(be, labels))),
                               np_cross_entropy(logits.astype(np.float64), labels), rtol=1e-6)
    np.testing.assert_allclose(float(ops.cross_entropy(T(be, logits), T(be, labels.astype(np.int32)))),
                               np_cross_entropy(logits.astype(np.float64), labels), rtol=1e-6)
    assert float(ops.accuracy(T(be, logits), T(be, labels))) == pytest.approx((logits.argmax(1) == labels).mean())
    am = N(be, ops.argmax(T(be, logits)))
    np.testing.assert_array_equal(am, logits.argmax(-1))
    assert am.dtype == np.int64
    np.testing.assert_array_equal(N(be, ops.argmax(T(be, logits), axis=0)), logits.argmax(0))
    oh = N(be, ops.one_hot(T(be, labels), 5))
    assert oh.dtype == np.float32
    np.testing.assert_array_equal(oh, np.eye(5, dtype=np.float32)[labels])
    pred, target = rand(4, 3), rand(4, 3, seed=1)
    np.testing.assert_allclose(float(ops.mse(T(be, pred), T(be, target))),
                               ((pred.astype(np.float64) - target) ** 2).mean(), rtol=1e-6)


CONV_CASES = [  # (x shape NCHW, w shape OIHW, stride, padding, bias)
    ((2, 3, 7, 6), (4, 3, 3, 3), 1, "valid", True),
    ((2, 3, 7, 6), (4, 3, 3, 3), 1, "same", True),
    ((1, 2, 6, 5), (3, 2, 2, 4), 1, "same", False),   # even kernels: the extra padding goes after
    ((2, 3, 7, 6), (4, 3, 3, 3), 2, "valid", True),
    ((2, 3, 7, 6), (4, 3, 3, 2), 2, 1, True),
    ((1, 1, 8, 8), (2, 1, 5, 5), 1, 2, False),
]


@pytest.mark.parametrize("xs,ws,stride,padding,bias", CONV_CASES)
def test_conv2d_nchw_oihw(be, xs, ws, stride, padding, bias):
    x, w, b = rand(*xs), rand(*ws, seed=1), rand(ws[0], seed=2)
    out = N(be, ops.conv2d(T(be, x), T(be, w), T(be, b) if bias else None, stride=stride, padding=padding))
    expected = np_conv2d(x.astype(np.float64), w.astype(np.float64), b if bias else None, stride, padding)
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_conv2d_rejects_strided_same(be):
    with pytest.raises((ValueError, RuntimeError), match="same"):  # torch raises RuntimeError
        ops.conv2d(T(be, rand(1, 1, 6, 6)), T(be, rand(1, 1, 3, 3)), stride=2, padding="same")


@pytest.mark.parametrize("size,stride", [(2, None), (3, 2), (2, 1)])
def test_max_pool2d(be, size, stride):
    x = rand(2, 3, 7, 6)
    out = N(be, ops.max_pool2d(T(be, x), size, stride))
    np.testing.assert_array_equal(out, np_max_pool2d(x, size, stride or size))


@pytest.mark.parametrize("affine", [False, True])
def test_layer_norm(be, affine):
    x, g, b = rand(3, 4, 8) * 3 + 1, rand(8, seed=1), rand(8, seed=2)
    args = (T(be, g), T(be, b)) if affine else (None, None)
    for eps in (1e-5, 0.5):
        out = N(be, ops.layer_norm(T(be, x), *args, eps=eps))
        ref = np_layer_norm(x.astype(np.float64), *((g, b) if affine else (None, None)), eps=eps)
        np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_embedding(be):
    table = rand(7, 3)
    ids = np.array([[0, 6, 2], [2, 2, 1]], np.int64)
    out = N(be, ops.embedding(T(be, table), T(be, ids)))
    assert out.shape == (2, 3, 3)
    np.testing.assert_array_equal(out, table[ids])
    np.testing.assert_array_equal(N(be, ops.embedding(T(be, table), T(be, ids.astype(np.int32)))), table[ids])


def test_dropout_training_and_eval(be):
    x = np.ones((200, 50), np.float32)
    assert ops.training() is True
    out = N(be, ops.dropout(T(be, x), 0.3))
    kept = out != 0
    assert 0.65 < kept.mean() < 0.75
    np.testing.assert_allclose(out[kept], 1 / 0.7, rtol=1e-6)
    np.testing.assert_array_equal(N(be, ops.dropout(T(be, x), 0.0)), x)
    be.set_training(False)  # what Engine.train_mode(False) does around evaluation
    assert ops.training() is False
    np.testing.assert_array_equal(N(be, ops.dropout(T(be, x), 0.3)), x)


def test_dropout_is_seeded(be):
    be.setup(None, 7)
    a = N(be, ops.dropout(T(be, np.ones((20, 20), np.float32)), 0.5))
    be.setup(None, 7)
    b = N(be, ops.dropout(T(be, np.ones((20, 20), np.float32)), 0.5))
    np.testing.assert_array_equal(a, b)


def test_cast_and_to_tensor(be):
    x = np.array([1.7, -2.2])
    assert N(be, T(be, x)).dtype == np.float32  # float64 data becomes float32
    assert N(be, T(be, np.arange(3))).dtype == np.int64
    for dtype in ("float32", "float64", "int32", "int64"):
        assert N(be, ops.cast(T(be, x), dtype)).dtype == np.dtype(dtype)
    np.testing.assert_array_equal(N(be, ops.cast(T(be, x), "int32")), [1, -2])  # truncation, as C
    rows = be.gather(be.resident([np.arange(10) * 2.0, np.arange(10)]), be.index(np.array([3, 1])))
    np.testing.assert_array_equal(N(be, rows[0]), [6.0, 2.0])
    np.testing.assert_array_equal(N(be, rows[1]), [3, 1])


def test_backend_name(be):
    assert ops.backend_name() == be.NAME


# ---------------------------------------------------------------- gradients
def _grads(be, fn, inputs, cot, wrt):
    """d sum(fn(*inputs) * cot) / d inputs[i] for i in wrt, with the backend's own autodiff."""
    if be.NAME == "torch":
        import torch

        ts = [torch.tensor(a, requires_grad=i in wrt) for i, a in enumerate(inputs)]
        (fn(*ts) * torch.tensor(cot)).sum().backward()
        return [ts[i].grad.numpy() for i in wrt]
    import tensorflow as tf

    ts = [tf.constant(a) for a in inputs]
    with tf.GradientTape() as tape:
        tape.watch([ts[i] for i in wrt])
        total = tf.reduce_sum(fn(*ts) * tf.constant(cot))
    return [np.asarray(tf.convert_to_tensor(g)) for g in tape.gradient(total, [ts[i] for i in wrt])]


def _directional_fd(ref, inputs, cot, i, h=1e-5):
    """Central difference of sum(ref * cot) along a random direction of inputs[i], in float64."""
    d = np.random.default_rng(i + 11).normal(size=inputs[i].shape)
    args = [np.asarray(a, np.float64) if a.dtype.kind == "f" else a for a in inputs]

    def f(delta):
        moved = list(args)
        moved[i] = args[i] + delta * d
        return float((np.asarray(ref(*moved)) * cot).sum())

    return (f(h) - f(-h)) / (2 * h), d


LABELS = np.array([0, 4, 2, 2, 1, 3], np.int64)
IDS = np.array([[0, 3, 3], [1, 0, 3]], np.int64)
GRAD_CASES = {  # name: (op on backend tensors, numpy reference, inputs, indices of inputs to differentiate)
    "matmul": (lambda a, b: ops.matmul(a, b), np.matmul, [rand(2, 3, 4), rand(4, 5, seed=1)], [0, 1]),
    "gelu": (ops.gelu, np_gelu, [rand(3, 4)], [0]),
    "sigmoid_tanh": (lambda x: ops.sigmoid(x) * ops.tanh(x), lambda x: np.tanh(x) / (1 + np.exp(-x)), [rand(5)], [0]),
    "softmax": (lambda x: ops.softmax(x, 0), lambda x: np_softmax(x, 0), [rand(4, 3)], [0]),
    "log_softmax": (ops.log_softmax, np_log_softmax, [rand(4, 3)], [0]),
    "cross_entropy": (ops.cross_entropy, np_cross_entropy, [rand(6, 5), LABELS], [0]),
    "mse": (ops.mse, lambda p, t: ((p - t) ** 2).mean(), [rand(4, 3), rand(4, 3, seed=1)], [0, 1]),
    "mean_sum": (lambda x: ops.mean(x, (0, 2), keepdims=True) * ops.sum(x, 1, keepdims=True),
                 lambda x: x.mean((0, 2), keepdims=True) * x.sum(1, keepdims=True), [rand(2, 3, 4)], [0]),
    "conv2d_same": (lambda x, w, b: ops.conv2d(x, w, b, 1, "same"), lambda x, w, b: np_conv2d(x, w, b, 1, "same"),
                    [rand(2, 2, 5, 6), rand(3, 2, 3, 2, seed=1), rand(3, seed=2)], [0, 1, 2]),
    "conv2d_stride_pad": (lambda x, w: ops.conv2d(x, w, None, 2, 1), lambda x, w: np_conv2d(x, w, None, 2, 1),
                          [rand(1, 2, 6, 5), rand(2, 2, 3, 3, seed=1)], [0, 1]),
    "max_pool2d": (lambda x: ops.max_pool2d(x, 2), lambda x: np_max_pool2d(x, 2, 2), [rand(2, 2, 4, 6)], [0]),
    "layer_norm": (lambda x, g, b: ops.layer_norm(x, g, b), np_layer_norm,
                   [rand(3, 6), rand(6, seed=1), rand(6, seed=2)], [0, 1, 2]),
    "embedding": (ops.embedding, lambda t, i: t[i], [rand(5, 3), IDS], [0]),
    "transpose_reshape": (lambda x: ops.reshape(ops.transpose(x, (2, 0, 1)), (4, 6)),
                          lambda x: x.transpose(2, 0, 1).reshape(4, 6), [rand(2, 3, 4)], [0]),
}


@pytest.mark.parametrize("case", sorted(GRAD_CASES))
def test_gradient_matches_finite_differences(be, case):
    fn, ref, inputs, wrt = GRAD_CASES[case]
    out = np.asarray(ref(*[a.astype(np.float64) if a.dtype.kind == "f" else a for a in inputs]))
    cot = np.random.default_rng(5).normal(size=out.shape).astype(np.float32)
    grads = _grads(be, fn, [np.array(a) for a in inputs], cot, wrt)
    for i, g in zip(wrt, grads):
        assert g.shape == inputs[i].shape
        fd, d = _directional_fd(ref, inputs, cot.astype(np.float64), i)
        assert float((g * d).sum()) == pytest.approx(fd, rel=2e-3, abs=1e-4), f"d/d input {i}"


@pytest.mark.parametrize("case", sorted(GRAD_CASES) + ["maximum_ties"])
def test_gradients_agree_across_backends(case):
    if case == "maximum_ties":  # not differentiable at a tie: both backends split the gradient in half
        a = np.array([[1.0, 2.0, 3.0], [0.0, -1.0, 5.0]], np.float32)
        fn, inputs, wrt = ops.maximum, [a, np.array([1.0, 0.0, 5.0], np.float32)], [0, 1]
        cot = np.ones((2, 3), np.float32)
    else:
        fn, ref, inputs, wrt = GRAD_CASES[case]
        cot = np.random.default_rng(5).normal(size=np.shape(ref(*inputs))).astype(np.float32)
    results = {}
    for name in BACKENDS:
        with ops.using(name) as module:
            results[name] = _grads(module, fn, [np.array(x) for x in inputs], cot, wrt)
    for g_torch, g_tf in zip(results["torch"], results["tensorflow"]):
        np.testing.assert_allclose(g_tf, g_torch, rtol=1e-5, atol=1e-6)
    if case == "maximum_ties":
        np.testing.assert_array_equal(results["torch"][0], [[0.5, 1, 0], [0, 0, 0.5]])
        np.testing.assert_array_equal(results["torch"][1], [1.5, 1, 1.5])


def test_stop_gradient(be):
    x = rand(4)
    (g,) = _grads(be, lambda t: t * ops.stop_gradient(t), [x], np.ones(4, np.float32), [0])
    np.testing.assert_allclose(g, x, rtol=1e-6)  # d(x * const)/dx = x, not 2x


def test_every_op_is_tested():
    """A new op in elasticflow.ops must get a test here (and an implementation in every backend)."""
    import inspect

    import elasticflow.backends as backends

    public = {n for n, f in vars(ops).items() if inspect.isfunction(f) and not n.startswith("_")
              and f.__module__ == ops.__name__} - {"use", "using", "current", "backend_name"}  # the dispatch
    source = open(__file__).read()
    untested = sorted(n for n in public if f"ops.{n}(" not in source and n not in dict(ELEMENTWISE))
    assert not untested, f"ops without a test: {untested}"
    for name in BACKENDS:
        module = backends.load(name)
        assert not [n for n in public if not callable(getattr(module, n, None))], name
