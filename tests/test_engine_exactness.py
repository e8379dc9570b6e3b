"""Reproducers for engine bugs: each test compares brainnx with plain JAX (or an exact value).

Test names carry the item number of the bug they guard (test_<item>_...).
"""

import ctypes
import dataclasses
import gc
import io
import threading
import time
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import optax
import psutil
import pytest
from flax import nnx

import brainnx as bnx

X = jax.random.normal(jax.random.key(0), (4, 3))
Y = jax.random.normal(jax.random.key(1), (4, 2))

Tracer = jax.core.Tracer


def _linear(din=3, dout=2, seed=0):
  return nnx.Linear(din, dout, rngs=nnx.Rngs(seed))


def _concrete(variable):
  """The Variable's raw value, asserted to be a concrete jax.Array (no tracer)."""
  raw = variable.get_raw_value()
  assert isinstance(raw, jax.Array), type(raw)
  assert not isinstance(raw, Tracer), raw
  return raw


def _assert_same(got, want):
  """Same tree, and per leaf the same shape, dtype and values."""
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    a, b = jnp.asarray(a), jnp.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    np.testing.assert_array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64))


# -- 2. plain objects are discovered -----------------------------------------------------


def _trainer_step(self, x, y):
  def loss_fn():
    return ((self.model(x) - y) ** 2).mean()

  grads, loss = bnx.grad(loss_fn, grad_states=self.model, return_value=True)()
  self.opt.update(self.model, grads)
  return loss


class PlainTrainer:
  def __init__(self, model, opt):
    self.model, self.opt = model, opt

  step = bnx.jit(_trainer_step)


@dataclasses.dataclass
class DataclassTrainer:
  model: nnx.Linear
  opt: nnx.Optimizer

  step = bnx.jit(_trainer_step)


@pytest.mark.parametrize('trainer_cls', [PlainTrainer, DataclassTrainer])
def test_2_trainer_method_step_matches_optax(trainer_cls):
  """A @bnx.jit method on a plain/dataclass object holding model + Optimizer trains like optax."""
  model = _linear()
  tx = optax.adam(1e-2)
  params = {'kernel': model.kernel[...], 'bias': model.bias[...]}
  trainer = trainer_cls(model, nnx.Optimizer(model, tx, wrt=nnx.Param))

  def pure_loss(p, x, y):
    return ((x @ p['kernel'] + p['bias'] - y) ** 2).mean()

  @jax.jit
  def pure_step(p, s, x, y):
    loss, g = jax.value_and_grad(pure_loss)(p, x, y)
    updates, s = tx.update(g, s, p)
    return optax.apply_updates(p, updates), s, loss

  opt_state = tx.init(params)
  for k in range(3):
    loss = trainer.step(X + k, Y)
    params, opt_state, loss_ref = pure_step(params, opt_state, X + k, Y)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-5)
  np.testing.assert_allclose(_concrete(model.kernel), params['kernel'], rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(_concrete(model.bias), params['bias'], rtol=1e-5, atol=1e-7)
  assert int(trainer.opt.step[...]) == 3


def test_2_module_through_namespace_is_not_baked():
  """A module reached via a plain object attribute is an input, not a jaxpr constant."""
  m = _linear()
  t = types.SimpleNamespace(model=m)
  f = bnx.jit(lambda x: t.model(x))
  np.testing.assert_allclose(f(X), X @ m.kernel[...] + m.bias[...], rtol=1e-6)
  t.model.bias[...] = jnp.full((2,), 100.0)
  np.testing.assert_allclose(f(X), X @ m.kernel[...] + 100.0, rtol=1e-6)


def test_2_namespace_attribute_rebound_is_followed():
  """Rebinding a plain object's attribute to another module changes what the next call uses."""
  a, b = _linear(seed=0), _linear(seed=1)
  t = types.SimpleNamespace(model=a)
  f = bnx.jit(lambda x: t.model(x))
  np.testing.assert_allclose(f(X), X @ a.kernel[...] + a.bias[...], rtol=1e-6)
  t.model = b
  np.testing.assert_allclose(f(X), X @ b.kernel[...] + b.bias[...], rtol=1e-6)


def test_2_write_through_namespace_is_visible():
  """A Variable written through a plain object attribute is written back, concrete."""
  t = types.SimpleNamespace(count=nnx.Variable(jnp.array(0)))

  @bnx.jit
  def f(x):
    t.count[...] += 1
    return x * 2

  f(X), f(X)
  assert int(_concrete(t.count)) == 2


class _Node:
  pass


def test_2_cyclic_plain_object():
  """An object whose attribute refers back to itself is discovered without recursion errors."""
  m = _linear()
  h = _Node()
  h.me, h.model, h.family = h, m, [h]
  h.count = nnx.Variable(jnp.array(0))

  def body(holder, x):
    holder.me.count[...] += 1
    return holder.family[0].model(x)

  f = bnx.jit(lambda x: body(h, x))
  g = bnx.jit(body)
  np.testing.assert_allclose(f(X), X @ m.kernel[...] + m.bias[...], rtol=1e-6)
  np.testing.assert_allclose(g(h, X), X @ m.kernel[...] + m.bias[...], rtol=1e-6)
  m.bias[...] = jnp.full((2,), -5.0)
  np.testing.assert_allclose(f(X), X @ m.kernel[...] - 5.0, rtol=1e-6)
  np.testing.assert_allclose(g(h, X), X @ m.kernel[...] - 5.0, rtol=1e-6)
  assert int(_concrete(h.count)) == 4


# -- 3. new Variables in plain containers inside jit ----------------------------------------


def test_3_new_param_in_plain_dict_is_concrete():
  """A Param added to a closed-over plain dict inside jit ends up holding a concrete array."""
  a = nnx.Param(jnp.ones(3))
  d = {'a': a}

  @bnx.jit
  def f(x):
    d['b'] = nnx.Param(x * 2)

  x1 = jnp.arange(3.0)
  f(x1)
  assert d['a'] is a
  assert isinstance(d['b'], nnx.Param)
  np.testing.assert_array_equal(_concrete(d['b']), x1 * 2)
  x2 = jnp.arange(3.0) + 10
  f(x2)  # a warm call must replay the creation with the new input
  np.testing.assert_array_equal(_concrete(d['b']), x2 * 2)


def test_3_replaced_param_in_plain_dict_is_concrete():
  """Replacing a plain dict's Param inside jit leaves the new Param with a concrete value."""
  d = {'a': nnx.Param(jnp.ones(3))}

  @bnx.jit
  def f(x):
    d['a'] = nnx.Param(x * 3)

  x = jnp.arange(3.0)
  f(x)
  assert isinstance(d['a'], nnx.Param)
  np.testing.assert_array_equal(_concrete(d['a']), x * 3)


def test_3_appended_param_in_plain_list_is_concrete():
  """A Param appended to a closed-over plain list inside jit holds a concrete array."""
  lst = []

  @bnx.jit
  def f(x):
    lst.append(nnx.Param(x))

  x = jnp.arange(3.0)
  f(x)
  assert len(lst) == 1 and isinstance(lst[0], nnx.Param)
  np.testing.assert_array_equal(_concrete(lst[0]), x)


def test_3_error_restores_plain_dict():
  """If the function raises, a plain dict's entries are restored (original object, no new keys)."""
  a = nnx.Param(jnp.ones(3))
  d = {'a': a}

  @bnx.jit
  def f(x):
    d['a'] = nnx.Param(x * 3)
    d['b'] = nnx.Param(x)
    raise RuntimeError('boom')

  with pytest.raises(RuntimeError, match='boom'):
    f(jnp.arange(3.0))
  assert d['a'] is a
  assert 'b' not in d
  np.testing.assert_array_equal(_concrete(a), jnp.ones(3))


def test_3_new_param_in_nnx_dict_is_concrete():
  """nnx.Dict already works: a Param added inside jit holds a concrete array afterwards."""
  nd = nnx.Dict(a=nnx.Param(jnp.ones(3)))

  @bnx.jit
  def f(x):
    nd['b'] = nnx.Param(x * 2)

  x = jnp.arange(3.0)
  f(x)
  assert isinstance(nd['b'], nnx.Param)
  np.testing.assert_array_equal(_concrete(nd['b']), x * 2)
  np.testing.assert_array_equal(_concrete(nd['a']), jnp.ones(3))


# -- 4. threads -------------------------------------------------------------------------------

G_SHARED = nnx.Linear(3, 4, rngs=nnx.Rngs(7))


def test_4_warm_calls_race_fresh_traces():
  """Warm calls in one thread stay exact while another thread traces fresh functions on the same module."""
  kernel, bias = np.asarray(G_SHARED.kernel[...]), np.asarray(G_SHARED.bias[...])
  expect = np.asarray(X) @ kernel + bias
  warm = bnx.jit(lambda x: G_SHARED(x))
  read_kernel = bnx.jit(lambda: G_SHARED.kernel[...])
  warm(X), read_kernel()
  deadline = time.monotonic() + 1.5
  errors, counts = [], {'a': 0, 'b': 0}

  def thread_b():
    try:
      while time.monotonic() < deadline:
        y, k = warm(X), read_kernel()
        assert not isinstance(y, Tracer) and not isinstance(k, Tracer)
        np.testing.assert_allclose(y, expect, rtol=1e-5)
        np.testing.assert_array_equal(k, kernel)
        counts['b'] += 1
    except BaseException as e:
      errors.append(e)

  def make(k):
    return bnx.jit(lambda x: G_SHARED(x) + k)

  def thread_a():
    try:
      k = 0.0
      while time.monotonic() < deadline:
        k += 1.0
        y = make(k)(X)
        assert not isinstance(y, Tracer)
        np.testing.assert_allclose(y, expect + k, rtol=1e-5)
        counts['a'] += 1
    except BaseException as e:
      errors.append(e)

  threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert not any(t.is_alive() for t in threads), 'threads did not finish'
  if errors:
    raise errors[0]
  assert counts['a'] >= 2 and counts['b'] >= 2, counts
  np.testing.assert_array_equal(_concrete(G_SHARED.kernel), kernel)


# -- 5. static arguments like jax.jit -------------------------------------------------------


def _type_dependent(x, k):
  if isinstance(k, bool):
    return x * 3
  if isinstance(k, float):
    return x * 2
  return x


def test_5_static_int_float_bool_are_distinct():
  """Static 1, 1.0 and True are separate traces, as in jax.jit."""
  f = bnx.jit(_type_dependent, static_argnums=1)
  ref = jax.jit(_type_dependent, static_argnums=1)
  x = jnp.ones(2)
  for k in (1, 1.0, True, 1, 1.0, True):
    _assert_same(f(x, k), ref(x, k))


def test_5_static_argnames_covers_positional():
  """static_argnames='b' also makes b static when passed by position."""
  fn = lambda x, b: x[:b]
  f = bnx.jit(fn, static_argnames='b')
  ref = jax.jit(fn, static_argnames='b')
  x = jnp.arange(5.0)
  _assert_same(f(x, 3), ref(x, 3))
  _assert_same(f(x, 2), ref(x, 2))
  _assert_same(f(x, b=4), ref(x, b=4))


def test_5_static_argnums_covers_keyword():
  """static_argnums=1 also makes that argument static when passed by keyword."""
  fn = lambda x, b: x[:b]
  f = bnx.jit(fn, static_argnums=1)
  ref = jax.jit(fn, static_argnums=1)
  x = jnp.arange(5.0)
  _assert_same(f(x, b=3), ref(x, b=3))
  _assert_same(f(x, b=2), ref(x, b=2))
  _assert_same(f(x, 4), ref(x, 4))


def test_5_static_argnums_out_of_range_raises():
  """static_argnums beyond the signature is a ValueError (jax.jit raises one too)."""
  with pytest.raises(ValueError):
    jax.jit(lambda x: x, static_argnums=5)(jnp.ones(2))
  with pytest.raises(ValueError):
    bnx.jit(lambda x: x, static_argnums=5)(jnp.ones(2))


def test_5_unknown_static_argname_raises():
  """static_argnames naming no parameter is a ValueError (jax.jit raises one too)."""
  with pytest.raises(ValueError):
    jax.jit(lambda x: x, static_argnames='nope')(jnp.ones(2))
  with pytest.raises(ValueError):
    bnx.jit(lambda x: x, static_argnames='nope')(jnp.ones(2))


# -- 6. weak types ----------------------------------------------------------------------------


def test_6_jit_weak_float_keeps_bfloat16():
  """A Python float argument stays weak: bf16 * 2.0 is bf16, as under jax.jit."""
  fn = lambda x: jnp.ones(3, jnp.bfloat16) * x
  _assert_same(bnx.jit(fn)(2.0), jax.jit(fn)(2.0))


def test_6_jit_weak_int_keeps_int8():
  """A Python int argument stays weak: int8 + 2 is int8, as under jax.jit."""
  fn = lambda x: jnp.ones(3, jnp.int8) + x
  _assert_same(bnx.jit(fn)(2), jax.jit(fn)(2))


def test_6_vmap_broadcast_weak_float():
  """vmap with in_axes=(0, None) keeps a Python float weak, as jax.vmap does."""
  fn = lambda a, s: a * s
  a = jnp.ones((2, 3), jnp.bfloat16)
  _assert_same(bnx.vmap(fn, in_axes=(0, None))(a, 2.0), jax.vmap(fn, in_axes=(0, None))(a, 2.0))


def test_6_vmap_axis_size_weak_float():
  """vmap with in_axes=None and axis_size keeps a Python float weak, as jax.vmap does."""
  fn = lambda s: jnp.ones(3, jnp.bfloat16) * s
  _assert_same(bnx.vmap(fn, in_axes=None, axis_size=2)(2.0), jax.vmap(fn, in_axes=None, axis_size=2)(2.0))


def test_6_eager_scan_weak_int_init():
  """Eager scan with a Python int init matches jax.lax.scan in values and dtypes."""
  fn = lambda c, x: (c + x, c)
  _assert_same(bnx.scan(fn, 0, jnp.ones(3)), jax.lax.scan(fn, 0, jnp.ones(3)))


def test_6_eager_scan_weak_int_init_bfloat16():
  """Eager scan with an int init over bf16 xs matches jax.lax.scan (bf16 carry)."""
  fn = lambda c, x: (c + x, c)
  xs = jnp.ones(3, jnp.bfloat16)
  _assert_same(bnx.scan(fn, 0, xs), jax.lax.scan(fn, 0, xs))


def test_6_fori_loop_weak_int_init():
  """fori_loop(0, 3, c + 1.5, 0) equals jax.lax.fori_loop (jax 0.10 gives 4.5 float32; no error)."""
  fn = lambda i, c: c + 1.5
  _assert_same(bnx.fori_loop(0, 3, fn, 0), jax.lax.fori_loop(0, 3, fn, 0))


def test_6_while_loop_weak_int_init():
  """while_loop on a Python int init equals jax.lax.while_loop."""
  args = (lambda c: c < 3, lambda c: c + 1, 0)
  _assert_same(bnx.while_loop(*args), jax.lax.while_loop(*args))


def test_6_checkpointed_scan_weak_int_init():
  """checkpointed_scan with a Python int init matches jax.lax.scan."""
  fn = lambda c, x: (c + x, c)
  _assert_same(bnx.checkpointed_scan(fn, 0, jnp.ones(3)), jax.lax.scan(fn, 0, jnp.ones(3)))


# -- 7. guards on the names a trace read -------------------------------------------------------

M_GUARD = None
SCALE_GUARD = 2.0


def test_7_global_rebound_from_none_to_module():
  """A global rebound from None to a module is seen by the next call."""
  global M_GUARD
  M_GUARD = None
  try:
    f = bnx.jit(lambda x: x if M_GUARD is None else M_GUARD(x))
    x = jnp.ones(2)
    _assert_same(f(x), x)
    M_GUARD = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    y = f(x)
    assert y.shape == (3,)
    np.testing.assert_allclose(y, M_GUARD(x), rtol=1e-6)
  finally:
    M_GUARD = None


def test_7_closure_rebound_from_none_to_module():
  """A closure cell rebound from None to a module is seen by the next call."""
  m = None
  f = bnx.jit(lambda x: x if m is None else m(x))
  x = jnp.ones(2)
  _assert_same(f(x), x)
  m = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
  y = f(x)
  assert y.shape == (3,)
  np.testing.assert_allclose(y, m(x), rtol=1e-6)


def test_7_global_float_rebound():
  """A global float the trace read is guarded: 2.0 -> 3.0 changes the result (unlike jax.jit)."""
  global SCALE_GUARD
  SCALE_GUARD = 2.0
  try:
    f = bnx.jit(lambda x: x * SCALE_GUARD)
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(f(x), x * 2.0)
    SCALE_GUARD = 3.0
    np.testing.assert_array_equal(f(x), x * 3.0)
  finally:
    SCALE_GUARD = 2.0


def test_7_closure_float_rebound():
  """A closure float the trace read is guarded: 2.0 -> 3.0 changes the result."""
  scale = 2.0
  f = bnx.jit(lambda x: x * scale)
  x = jnp.arange(3.0)
  np.testing.assert_array_equal(f(x), x * 2.0)
  scale = 3.0
  np.testing.assert_array_equal(f(x), x * 3.0)


# -- 8. checked entry points ----------------------------------------------------------------


def _jaxpr_call_setup():
  weight_param = nnx.Param(jnp.ones(3))
  sf = bnx.StatefulFunction(lambda x: x * weight_param[...])
  x = jnp.arange(3.0)
  # sanity: the right state values work
  new_vals, out = sf.jaxpr_call([jnp.full(3, 2.0)], x)
  np.testing.assert_array_equal(out, x * 2.0)
  return sf, x


def test_8_jaxpr_call_wrong_shape_names_state():
  """jaxpr_call with a wrong-shaped state value raises ValueError naming the Param."""
  sf, x = _jaxpr_call_setup()
  with pytest.raises(ValueError) as info:
    sf.jaxpr_call([jnp.ones(5)], x)
  msg = str(info.value)
  assert 'Param' in msg and 'weight_param' in msg, msg


def test_8_jaxpr_call_wrong_dtype():
  """jaxpr_call with an int32 value for a float32 Param raises ValueError."""
  sf, x = _jaxpr_call_setup()
  with pytest.raises(ValueError):
    sf.jaxpr_call([jnp.ones(3, jnp.int32)], x)


def test_8_jaxpr_call_wrong_count():
  """jaxpr_call with the wrong number of state values raises ValueError."""
  sf, x = _jaxpr_call_setup()
  with pytest.raises(ValueError):
    sf.jaxpr_call([], x)
  with pytest.raises(ValueError):
    sf.jaxpr_call([jnp.ones(3), jnp.ones(3)], x)


def test_8_jit_reads_str_variable():
  """Reading a Variable that holds a str inside jit raises TypeError naming the Variable."""
  label_var = nnx.Variable('hello')
  f = bnx.jit(lambda x: x * len(label_var.get_value()))
  with pytest.raises(TypeError) as info:
    f(jnp.ones(2))
  msg = str(info.value)
  assert 'Variable' in msg and 'label_var' in msg, msg


def test_8_jit_reads_object_variable():
  """Reading a Variable that holds an arbitrary object inside jit raises TypeError naming it."""
  obj_var = nnx.Variable(object())
  f = bnx.jit(lambda x: x if obj_var.get_value() is not None else -x)
  with pytest.raises(TypeError) as info:
    f(jnp.ones(2))
  msg = str(info.value)
  assert 'Variable' in msg and 'obj_var' in msg, msg


def _run_loop(kind, write):
  if kind == 'scan':
    return bnx.scan(lambda c, x: (write() or c, c), 0.0, jnp.ones(2))
  if kind == 'for_loop':
    return bnx.for_loop(lambda x: write() or x, jnp.ones(2))
  if kind == 'fori_loop':
    return bnx.fori_loop(0, 2, lambda i, c: write() or c, 0.0)
  if kind == 'while_loop':
    return bnx.while_loop(lambda c: c < 2, lambda c: write() or c + 1, 0)
  raise AssertionError(kind)


@pytest.mark.parametrize('kind', ['scan', 'for_loop', 'fori_loop', 'while_loop'])
def test_8_loop_body_changes_variable_dtype(kind):
  """A loop body that changes a Variable's dtype raises an error naming the Variable (jax.lax.scan raises too)."""
  with pytest.raises(TypeError):  # the oracle: a dtype-changing carry is an error in JAX
    jax.lax.scan(lambda c, x: (c.astype(jnp.int32), None), jnp.zeros(3), None, length=2)
  dtype_var = nnx.Variable(jnp.zeros(3))

  def write():  # set_value: `v[...] = ...` would cast back to the Variable's dtype
    dtype_var.set_value(dtype_var.get_value().astype(jnp.int32))

  with pytest.raises((ValueError, TypeError)) as info:
    _run_loop(kind, write)
  assert 'dtype_var' in str(info.value), str(info.value)
  raw = _concrete(dtype_var)
  assert raw.dtype == jnp.float32


def test_8_jit_dtype_change_is_legal():
  """Under jit (no loop) a write that changes a Variable's dtype is allowed."""
  v = nnx.Variable(jnp.zeros(3))

  @bnx.jit
  def f():
    v.set_value(v.get_value().astype(jnp.int32) + 1)  # `v[...] = ...` would keep float32

  f()
  raw = _concrete(v)
  assert raw.dtype == jnp.int32
  np.testing.assert_array_equal(raw, np.ones(3, np.int32))


# -- 9. lower().compile() ------------------------------------------------------------------


def test_9_lower_compile_call_with_user_args():
  """jit(f).lower(x).compile() takes the user's arguments, returns f's output and writes Variables."""
  m = _linear()
  counter = nnx.Variable(jnp.array(0))

  def f(x):
    counter[...] += 1
    return m(x)

  compiled = bnx.jit(f).lower(X).compile()
  assert int(counter[...]) == 0
  expect = X @ m.kernel[...] + m.bias[...]
  np.testing.assert_allclose(compiled(X), expect, rtol=1e-6)
  assert int(_concrete(counter)) == 1
  np.testing.assert_allclose(compiled(X + 1), (X + 1) @ m.kernel[...] + m.bias[...], rtol=1e-6)
  assert int(_concrete(counter)) == 2


# -- 10. memory ------------------------------------------------------------------------------


def _dead(*refs):
  gc.collect()
  return all(r() is None for r in refs)


def test_10_module_argument_freed_while_jit_alive():
  """A module passed as a jit argument is not kept alive by the jitted function."""
  m = _linear()
  g = bnx.jit(lambda m, x: m(x))
  g(m, X)
  r = weakref.ref(m)
  del m
  assert _dead(r)
  assert g is not None


def test_10_module_argument_freed_plain_jax_sanity():
  """Sanity for the oracle: plain jax.jit over a pure function frees the module."""
  m = _linear()
  g = jax.jit(lambda k, b, x: x @ k + b)
  g(m.kernel[...], m.bias[...], X)
  r = weakref.ref(m)
  del m
  assert _dead(r)


def _closure_pair(fn_of_m):
  m = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
  return m, fn_of_m(m)


def test_10_scan_closure_freed():
  """An eagerly scanned closure (and the module it holds) is freed afterwards; plain jax frees it too."""
  for scan in (jax.lax.scan, bnx.scan):
    m, f = _closure_pair(lambda m: lambda c, x: (c + m(x).sum(), c))
    scan(f, 0.0, jnp.ones((2, 3)))
    rf, rm = weakref.ref(f), weakref.ref(m)
    del f, m
    assert _dead(rf, rm), scan.__module__


def test_10_for_loop_closure_freed():
  """A closure run by eager for_loop (and its module) is freed afterwards."""
  m, f = _closure_pair(lambda m: lambda x: x + m(x))
  bnx.for_loop(f, jnp.ones((2, 3)))
  rf, rm = weakref.ref(f), weakref.ref(m)
  del f, m
  assert _dead(rf, rm)


def test_10_fori_loop_closure_freed():
  """A closure run by eager fori_loop (and its module) is freed afterwards; plain jax frees it too."""
  for fori in (jax.lax.fori_loop, bnx.fori_loop):
    m, f = _closure_pair(lambda m: lambda i, c: c + m(c))
    fori(0, 2, f, jnp.ones(3))
    rf, rm = weakref.ref(f), weakref.ref(m)
    del f, m
    assert _dead(rf, rm), fori.__module__


def test_10_vmap_closure_freed():
  """After dropping f and vmap(f), both (and the module) are freed; plain jax frees them too."""
  for vmap in (jax.vmap, bnx.vmap):
    m, f = _closure_pair(lambda m: lambda x: x + m(x))
    vf = vmap(f)
    vf(jnp.ones((2, 3)))
    rf, rv, rm = weakref.ref(f), weakref.ref(vf), weakref.ref(m)
    del f, vf, m
    assert _dead(rf, rv, rm), vmap.__module__


def test_10_jit_closure_freed():
  """After dropping f and jit(f), both (and the module) are freed; plain jax frees them too."""
  for jit in (jax.jit, bnx.jit):
    m, f = _closure_pair(lambda m: lambda x: x + m(x))
    jf = jit(f)
    jf(jnp.ones(3))
    rf, rj, rm = weakref.ref(f), weakref.ref(jf), weakref.ref(m)
    del f, jf, m
    assert _dead(rf, rj, rm), jit.__module__


def test_10_progress_bar_freed():
  """A ProgressBar used by an eager scan is freed after del."""
  pbar = bnx.ProgressBar(freq=1, file=io.StringIO())
  bnx.scan(lambda c, x: (c + x, c), 0.0, jnp.ones(3), pbar=pbar)
  r = weakref.ref(pbar)
  del pbar
  assert _dead(r)


def _rss_mb():
  gc.collect()
  try:  # hand freed heap pages back to the OS (glibc), so RSS tracks live memory
    ctypes.CDLL('libc.so.6').malloc_trim(0)
  except (OSError, AttributeError):
    pass
  return psutil.Process().memory_info().rss / 2**20


def test_10_many_scanned_closures_do_not_accumulate():
  """Eagerly scanning many distinct closures does not retain them: RSS grows like plain jax.lax.scan.

  Each closure holds a 4 MiB payload, so retaining closures is visible above
  allocator noise; jax.clear_caches() after each phase takes JAX's own
  compilation caches (shared by both phases) out of the comparison.
  N=100 keeps the test near 15 s (each distinct closure compiles once).
  """
  n = 100
  xs = jnp.ones(2)

  def make(i):
    payload = np.full(2**20, float(i), np.float32)  # 4 MiB, owned by this closure alone
    return lambda c, x: (c + x + payload.shape[0] * 0, c)

  def phase(scan, offset, count=n):
    for i in range(count):
      scan(make(i + offset), 0.0, xs)
    jax.clear_caches()
    return _rss_mb()

  phase(jax.lax.scan, -10, 3)  # warm-up of both paths
  phase(bnx.scan, -20, 3)
  start = _rss_mb()
  after_jax = phase(jax.lax.scan, 0)
  after_bnx = phase(bnx.scan, 10_000)
  baseline = max(after_jax - start, 0.0)
  grown = after_bnx - after_jax
  bound = baseline * 3 + 60.0 * n / 1000
  assert grown <= bound, f'brainnx grew RSS by {grown:.1f} MiB over {n} closures; plain jax.lax.scan {baseline:.1f} MiB'
