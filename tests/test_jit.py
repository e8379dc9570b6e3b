"""brainnx.jit against the same computation as a pure function under jax.jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx
from helpers import MLP, Compiles, assert_program_equal, assert_same_tree, assert_same_values, concrete, linear, mlp_params, mlp_pure, no_tracers, run_in_threads, values_of

X = jax.random.normal(jax.random.key(0), (4, 3))


class Counting(nnx.Module):
  def __init__(self, rngs):
    self.mlp = MLP(3, 5, 2, rngs=rngs)
    self.calls = nnx.Variable(jnp.array(0))
    self.total = nnx.BatchStat(jnp.zeros(2))

  def __call__(self, x):
    self.calls[...] += 1
    y = self.mlp(x)
    self.total[...] += y.sum(0)
    return y


def pure_counting(state, x):
  y = mlp_pure(state['mlp'], x)
  return {**state, 'calls': state['calls'] + 1, 'total': state['total'] + y.sum(0)}, y


def counting_state(m):
  return {'mlp': mlp_params(m.mlp), 'calls': m.calls[...], 'total': m.total[...]}


def test_matches_pure_jit_over_several_calls():
  model = Counting(nnx.Rngs(0))
  state = counting_state(model)
  step = bnx.jit(lambda x: model(x))
  pure = jax.jit(pure_counting)
  for k in range(3):
    y = step(X + k)
    state, y_ref = pure(state, X + k)
    np.testing.assert_allclose(y, y_ref, rtol=1e-6)
  np.testing.assert_allclose(model.total[...], state['total'], rtol=1e-6)
  assert int(model.calls[...]) == 3


def test_module_as_argument_and_as_closure_agree():
  a, b, eager = Counting(nnx.Rngs(0)), Counting(nnx.Rngs(0)), Counting(nnx.Rngs(0))
  by_arg = bnx.jit(lambda m, x: m(x))
  by_closure = bnx.jit(lambda x: b(x))
  for _ in range(2):
    want = eager(X)  # the independent oracle: the same calls in plain Python
    np.testing.assert_allclose(by_arg(a, X), want, rtol=1e-6)
    np.testing.assert_allclose(by_closure(X), want, rtol=1e-6)
  assert_same_values(values_of(a), values_of(eager))
  assert_same_values(values_of(b), values_of(eager))


def test_python_runs_once_per_signature():
  model = Counting(nnx.Rngs(0))
  runs = []

  @bnx.jit
  def f(x):
    runs.append(x.shape)
    return model(x)

  f(X), f(X), f(X * 2)
  assert runs == [(4, 3)]
  f(jnp.ones((7, 3)))
  assert runs == [(4, 3), (7, 3)]
  f(jnp.ones((7, 3), jnp.float16))
  assert len(runs) == 3


def test_retrace_on_static_change_only():
  runs = []

  @bnx.jit(static_argnames='n')
  def f(x, n):
    runs.append(n)
    return x * n

  assert float(f(jnp.ones(()), n=2)) == 2 and float(f(jnp.ones(()), n=2)) == 2
  assert float(f(jnp.ones(()), n=3)) == 3
  assert runs == [2, 3]


def test_counter_increments_every_call():
  count = nnx.Variable(jnp.array(0))
  inc = bnx.jit(lambda: count.set_value(count[...] + 1))
  for _ in range(5):
    inc()
  assert int(count[...]) == 5


def test_shared_variable_written_once_per_call():
  shared = nnx.Param(jnp.zeros(()))
  a, b = nnx.Dict(w=shared), nnx.Dict(w=shared)

  @bnx.jit
  def f(p, q):
    p['w'][...] += 1
    q['w'][...] += 1

  f(a, b)
  assert float(shared[...]) == 2.0 and a['w'] is b['w']


def test_rngs_differ_each_call_and_reproduce_by_seed():
  def draws(seed):
    rngs = nnx.Rngs(seed)
    f = bnx.jit(lambda: rngs.normal((3,)))
    return [f() for _ in range(3)], rngs

  (d0, d1, d2), rngs = draws(0)
  assert not np.allclose(d0, d1) and not np.allclose(d1, d2)
  assert int(rngs.default.count[...]) == 3
  again, _ = draws(0)
  for a, b in zip((d0, d1, d2), again):
    np.testing.assert_array_equal(a, b)
  # same draws as nnx without any transform
  plain = nnx.Rngs(0)
  np.testing.assert_allclose(d0, plain.normal((3,)))


@pytest.mark.parametrize('case', ['global', 'closure', 'variable', 'submodule', 'shape', 'dtype'])
def test_cached_trace_stays_valid(case):
  holder = {}
  model = MLP(3, 5, 2, rngs=nnx.Rngs(0))

  def make():
    m = model

    def f(x):
      return m(x)

    def rebind(new):
      nonlocal m
      m = new

    return f, rebind

  fun, rebind = make()
  if case == 'global':
    holder_mod = globals()
    holder_mod['_CASE_MODEL'] = model
    fun = _global_forward
  f = bnx.jit(fun)
  f(X)
  if case == 'global':
    new = MLP(3, 5, 2, rngs=nnx.Rngs(1))
    globals()['_CASE_MODEL'] = new
    expected = lambda: mlp_pure(mlp_params(new), X)  # noqa: E731
  elif case == 'closure':
    new = MLP(3, 5, 2, rngs=nnx.Rngs(1))
    rebind(new)
    expected = lambda: mlp_pure(mlp_params(new), X)  # noqa: E731
  elif case == 'variable':
    model.l1.bias = nnx.Param(jnp.full((5,), 3.0))
    expected = lambda: mlp_pure(mlp_params(model), X)  # noqa: E731
  elif case == 'submodule':
    model.l2 = nnx.Linear(5, 2, rngs=nnx.Rngs(7))
    expected = lambda: mlp_pure(mlp_params(model), X)  # noqa: E731
  elif case == 'shape':
    model.l2 = nnx.Linear(5, 4, rngs=nnx.Rngs(7))
    expected = lambda: mlp_pure(mlp_params(model), X)  # noqa: E731
  else:
    model.l1.kernel[...] = model.l1.kernel[...]  # keep object
    model.l1.kernel.set_value(model.l1.kernel[...].astype(jnp.bfloat16))
    expected = lambda: mlp_pure(mlp_params(model), X)  # noqa: E731
  # bfloat16 keeps 8 bits of mantissa: a relative error up to 2**-8 per rounding, a few roundings
  # through the MLP; every other case computes in float32 like its oracle
  np.testing.assert_allclose(f(X), expected(), rtol=2e-2 if case == 'dtype' else 1e-6)
  holder.clear()


def _global_forward(x):
  return _CASE_MODEL(x)


_CASE_MODEL = None


def test_weak_type_only_change_does_not_rerun_python():
  count = nnx.Variable(jnp.array(0.0))
  runs = []

  @bnx.jit
  def f():
    runs.append(1)
    count[...] += 1.0

  f()
  count.set_value(5.0)  # a weakly typed Python float
  f()
  assert len(runs) == 1 and float(count[...]) == 6.0


def test_exception_at_trace_time_leaves_state_exact():
  model = Counting(nnx.Rngs(0))
  rngs = nnx.Rngs(3)
  before, rng_before = values_of(model), values_of(rngs)

  @bnx.jit(static_argnums=1)
  def f(x, fail):
    model(x)
    rngs.normal(())
    if fail:
      raise ValueError('trace-time failure')
    return model.calls[...]

  with pytest.raises(ValueError, match='trace-time failure'):
    f(X, True)
  assert_same_values(before, values_of(model))
  assert_same_values(rng_before, values_of(rngs))
  assert no_tracers(model) and no_tracers(rngs)
  assert int(f(X, False)) == 1


def test_exception_at_run_time_leaves_state_exact():
  model = Counting(nnx.Rngs(0))
  before = values_of(model)

  def explode(v):
    if v > 0:
      raise RuntimeError('run-time failure')

  @bnx.jit
  def f(x, trigger):
    y = model(x)
    jax.debug.callback(explode, trigger)
    return y

  with pytest.raises(Exception, match='run-time failure'):
    jax.block_until_ready(f(X, 1))
  assert_same_values(before, values_of(model))
  f(X, 0)
  assert int(model.calls[...]) == 1


def test_variables_created_inside_hold_concrete_arrays():
  holder = nnx.Dict(w=nnx.Param(jnp.ones(2)))

  @bnx.jit
  def attach():
    if not hasattr(holder, 'cache'):  # `'cache' in holder` raises before flax 0.12.6
      holder['cache'] = nnx.Cache(jnp.zeros(2))
    holder['cache'][...] += holder['w'][...]

  attach()
  assert type(holder['cache'].get_raw_value()) is type(jnp.zeros(1))
  attach()
  np.testing.assert_array_equal(holder['cache'][...], [2.0, 2.0])
  made = bnx.jit(lambda: MLP(3, 4, 2, rngs=nnx.Rngs(0)))()
  ref = MLP(3, 4, 2, rngs=nnx.Rngs(0))
  assert no_tracers(made)
  for got, want in zip(jax.tree.leaves(mlp_params(made)), jax.tree.leaves(mlp_params(ref)), strict=True):
    assert_program_equal(got, want)  # the same draws, made compiled and eagerly
  np.testing.assert_allclose(made(X), mlp_pure(mlp_params(made), X), rtol=1e-6)


def test_returned_input_node_is_the_same_object():
  model = MLP(3, 5, 2, rngs=nnx.Rngs(0))
  out_model, y = bnx.jit(lambda m, x: (m, m(x)))(model, X)
  assert out_model is model
  assert bnx.jit(lambda: model.l1.kernel)() is model.l1.kernel


def test_write_from_raw_jax_jit_is_refused_clearly():
  count = nnx.Variable(jnp.array(0))
  inc = bnx.jit(lambda: count.set_value(count[...] + 1))
  with pytest.raises(RuntimeError, match=r"Variable at \('count',\).*raw jax.jit"):
    jax.jit(lambda: inc())()
  assert int(count[...]) == 0 and no_tracers(count)
  inc()
  assert int(count[...]) == 1


def test_nested_brainnx_jit_composes():
  count = nnx.Variable(jnp.array(0))
  inner = bnx.jit(lambda: count.set_value(count[...] + 1))

  @bnx.jit
  def outer():
    inner()
    inner()
    return count[...]

  assert int(outer()) == 2 and int(count[...]) == 2


def test_static_argument_errors():
  with pytest.raises(ValueError, match='non-negative'):
    bnx.jit(lambda x: x, static_argnums=-1)
  f = bnx.jit(lambda x, opts: x, static_argnums=1)
  with pytest.raises(TypeError, match='position 1 of type list is not hashable'):
    f(1.0, [1, 2])
  g = bnx.jit(lambda x, opts=None: x, static_argnames='opts')
  with pytest.raises(TypeError, match="'opts' of type dict is not hashable"):
    g(1.0, opts={})
  with pytest.raises(TypeError, match='callable'):
    bnx.jit(5)


def test_donated_arguments():
  f = bnx.jit(lambda buf, x: buf + x, donate_argnums=0)
  ref = jax.jit(lambda buf, x: buf + x, donate_argnums=0)
  # the donated buffer aliases the output, as under jax.jit, and is deleted after the call
  alias = f.lower(jnp.ones(3), 1.0).compile().memory_analysis().alias_size_in_bytes
  assert alias == ref.lower(jnp.ones(3), 1.0).compile().memory_analysis().alias_size_in_bytes > 0  # 12 on CPU
  assert bnx.jit(lambda buf, x: buf + x).lower(jnp.ones(3), 1.0).compile().memory_analysis().alias_size_in_bytes == 0
  buf = jnp.ones(3)
  out = f(buf, 1.0)
  np.testing.assert_array_equal(out, [2.0, 2.0, 2.0])
  assert buf.is_deleted()
  with pytest.raises(ValueError, match='both static and donated'):
    bnx.jit(lambda a: a, static_argnums=0, donate_argnums=0)


def test_lower_and_clear_cache():
  w = nnx.Param(jnp.ones((3, 2)))
  runs = []

  @bnx.jit
  def f(x):
    runs.append(1)
    return x @ w[...]

  text = f.lower(X).as_text()
  assert 'dot_general' in text
  f(X)
  f.clear_cache()
  f(X)
  assert len(runs) == 2
  assert isinstance(f.stateful_fun, bnx.StatefulFunction)


def test_method_decorated_with_jit():
  class Acc(nnx.Module):
    def __init__(self):
      self.total = nnx.Variable(jnp.zeros(()))

    @bnx.jit
    def add(self, x):
      self.total[...] += x
      return self.total[...]

  acc = Acc()
  acc.add(1.0)
  assert float(acc.add(2.0)) == 3.0 and float(acc.total[...]) == 3.0


def test_mixed_container_arguments():
  model = MLP(3, 5, 2, rngs=nnx.Rngs(0))
  f = bnx.jit(lambda pair: pair[0](pair[1]))
  np.testing.assert_allclose(f((model, X)), mlp_pure(mlp_params(model), X), rtol=1e-6)
  np.testing.assert_allclose(f((model, X + 1)), mlp_pure(mlp_params(model), X + 1), rtol=1e-6)


def test_threads_call_one_jitted_function():
  models = [Counting(nnx.Rngs(i)) for i in range(6)]
  step = bnx.jit(lambda m, x: m(x))
  step(models[0], X)  # warm
  refs = [jax.jit(pure_counting)(counting_state(m), X)[1] for m in models]
  results = {}

  def work(i):
    for _ in range(5):
      results[i] = step(models[i], X)

  run_in_threads(work, 6)
  for i, m in enumerate(models):
    np.testing.assert_allclose(results[i], refs[i], rtol=1e-6)
    assert int(m.calls[...]) == 5 + (i == 0)


@pytest.mark.parametrize(
  'kwargs, match',
  [
    ({'static_argnums': 1.0}, r'jit: static_argnums must be an int or a sequence of ints, got 1.0 \(float\)'),
    ({'static_argnums': '0'}, r"jit: static_argnums must be an int or a sequence of ints, got '0' \(str\)"),
    ({'static_argnums': (0, 1.5)}, r'jit: static_argnums must be an int or a sequence of ints, got 1.5'),
    ({'static_argnames': 3}, r'jit: static_argnames must be a str or a sequence of strs, got 3 \(int\)'),
    ({'static_argnames': ('x', 3)}, r'jit: static_argnames must be a str or a sequence of strs'),
    ({'donate_argnums': 0.0}, r'donate_argnums must be an int or a sequence of ints, got 0.0 \(float\)'),
  ],
  ids=['static-float', 'static-str', 'static-float-inside', 'names-int', 'names-mixed', 'donate-float'],
)
def test_jit_keywords_of_the_wrong_type_are_type_errors_naming_the_parameter(kwargs, match):
  with pytest.raises(TypeError, match=r'not iterable|cannot be interpreted as an integer|not a string'):  # jax.jit refuses these too
    jax.jit(lambda x, y=0: x, **kwargs).lower(1.0)
  with pytest.raises(TypeError, match=match):
    bnx.jit(lambda x, y=0: x, **kwargs)


def test_shard_map_mesh_must_be_a_mesh():
  with pytest.raises(TypeError, match=r'shard_map: mesh must be a jax.sharding.Mesh .*got 3'):
    bnx.shard_map(lambda x: x, mesh=3, in_specs=None, out_specs=None)

# -- Variables created in plain containers, static arguments as jax.jit, weak types, lower().compile() ---

def test_new_param_in_plain_dict_is_concrete():
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
  np.testing.assert_array_equal(concrete(d['b']), x1 * 2)
  x2 = jnp.arange(3.0) + 10
  f(x2)  # a warm call must replay the creation with the new input
  np.testing.assert_array_equal(concrete(d['b']), x2 * 2)


def test_replaced_param_in_plain_dict_is_concrete():
  """Replacing a plain dict's Param inside jit leaves the new Param with a concrete value."""
  d = {'a': nnx.Param(jnp.ones(3))}

  @bnx.jit
  def f(x):
    d['a'] = nnx.Param(x * 3)

  x = jnp.arange(3.0)
  f(x)
  assert isinstance(d['a'], nnx.Param)
  np.testing.assert_array_equal(concrete(d['a']), x * 3)


def test_appended_param_in_plain_list_is_concrete():
  """A Param appended to a closed-over plain list inside jit holds a concrete array."""
  lst = []

  @bnx.jit
  def f(x):
    lst.append(nnx.Param(x))

  x = jnp.arange(3.0)
  f(x)
  assert len(lst) == 1 and isinstance(lst[0], nnx.Param)
  np.testing.assert_array_equal(concrete(lst[0]), x)


def test_error_restores_plain_dict():
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
  np.testing.assert_array_equal(concrete(a), jnp.ones(3))


def test_new_param_in_nnx_dict_is_concrete():
  """nnx.Dict already works: a Param added inside jit holds a concrete array afterwards."""
  nd = nnx.Dict(a=nnx.Param(jnp.ones(3)))

  @bnx.jit
  def f(x):
    nd['b'] = nnx.Param(x * 2)

  x = jnp.arange(3.0)
  f(x)
  assert isinstance(nd['b'], nnx.Param)
  np.testing.assert_array_equal(concrete(nd['b']), x * 2)
  np.testing.assert_array_equal(concrete(nd['a']), jnp.ones(3))


def _type_dependent(x, k):
  if isinstance(k, bool):
    return x * 3
  if isinstance(k, float):
    return x * 2
  return x


def test_static_int_float_bool_are_distinct():
  """Static 1, 1.0 and True are separate traces, as in jax.jit."""
  f = bnx.jit(_type_dependent, static_argnums=1)
  ref = jax.jit(_type_dependent, static_argnums=1)
  x = jnp.ones(2)
  for k in (1, 1.0, True, 1, 1.0, True):
    assert_same_tree(f(x, k), ref(x, k))


def test_static_argnames_covers_positional():
  """static_argnames='b' also makes b static when passed by position."""
  fn = lambda x, b: x[:b]
  f = bnx.jit(fn, static_argnames='b')
  ref = jax.jit(fn, static_argnames='b')
  x = jnp.arange(5.0)
  assert_same_tree(f(x, 3), ref(x, 3))
  assert_same_tree(f(x, 2), ref(x, 2))
  assert_same_tree(f(x, b=4), ref(x, b=4))


def test_static_argnums_covers_keyword():
  """static_argnums=1 also makes that argument static when passed by keyword."""
  fn = lambda x, b: x[:b]
  f = bnx.jit(fn, static_argnums=1)
  ref = jax.jit(fn, static_argnums=1)
  x = jnp.arange(5.0)
  assert_same_tree(f(x, b=3), ref(x, b=3))
  assert_same_tree(f(x, b=2), ref(x, b=2))
  assert_same_tree(f(x, 4), ref(x, 4))


def test_static_argnames_reaches_a_parameter_only_kwargs_receives():
  """A static name the function takes through **kwargs is static, as under jax.jit."""
  def fn(x, **options):
    return x * 2 if options['mode'] == 'double' else x - 1

  f, ref = bnx.jit(fn, static_argnames='mode'), jax.jit(fn, static_argnames='mode')
  x = jnp.arange(3.0)
  for mode in ('double', 'shift', 'double'):
    assert_same_tree(f(x, mode=mode), ref(x, mode=mode))


def test_a_keyword_after_the_positionals_is_not_taken_for_the_static_position():
  """static_argnums=1 with one argument passed by position: a keyword for a later parameter stays
  dynamic (an array), not static by its slot number."""
  fn = lambda x, scale=None, shift=0.0: x + shift  # noqa: E731
  f, ref = bnx.jit(fn, static_argnums=1), jax.jit(fn, static_argnums=1)
  x = jnp.arange(3.0)
  for shift in (jnp.array(2.0), jnp.array(-1.0)):
    assert_same_tree(f(x, shift=shift), ref(x, shift=shift))


TRACES = 0


def test_a_function_counting_its_traces_wrapped_anew_each_call_traces_and_compiles_once():
  """``bnx.jit(f)(x)`` written inline (a new wrapper each call) over a function that counts its
  traces in a global: one trace and one compile in all, as ``jax.jit(f)(x)`` inline gives."""
  global TRACES
  w = nnx.Param(jnp.arange(3.0))

  def f(x):
    global TRACES
    TRACES += 1
    return x * w[...]

  TRACES = 0
  x, compiles = jnp.ones(3), []
  for _ in range(3):
    with Compiles() as c:
      np.testing.assert_array_equal(bnx.jit(f)(x), x * jnp.arange(3.0))
    compiles.append(c.compiled_programs())
  assert TRACES == 1 and compiles == [1, 0, 0], (TRACES, compiles)


def test_static_argnums_out_of_range_raises():
  """static_argnums beyond the signature is a ValueError (jax.jit raises one too)."""
  with pytest.raises(ValueError, match=r'static_argnums=\(5,\), but only accepts 1 positional'):
    jax.jit(lambda x: x, static_argnums=5)(jnp.ones(2))
  with pytest.raises(ValueError, match=r'static_argnums=\(5,\) but the function accepts 1 positional argument\(s\) \(x\)'):
    bnx.jit(lambda x: x, static_argnums=5)(jnp.ones(2))


def test_unknown_static_argname_raises():
  """static_argnames naming no parameter is a ValueError (jax.jit raises one too)."""
  with pytest.raises(ValueError, match="invalid argnames {'nope'}"):
    jax.jit(lambda x: x, static_argnames='nope')(jnp.ones(2))
  with pytest.raises(ValueError, match=r"static_argnames \['nope'\] are not parameters of the function \(its parameters: x\)"):
    bnx.jit(lambda x: x, static_argnames='nope')(jnp.ones(2))


def test_jit_weak_float_keeps_bfloat16():
  """A Python float argument stays weak: bf16 * 2.0 is bf16, as under jax.jit."""
  fn = lambda x: jnp.ones(3, jnp.bfloat16) * x
  assert_same_tree(bnx.jit(fn)(2.0), jax.jit(fn)(2.0))


def test_jit_weak_int_keeps_int8():
  """A Python int argument stays weak: int8 + 2 is int8, as under jax.jit."""
  fn = lambda x: jnp.ones(3, jnp.int8) + x
  assert_same_tree(bnx.jit(fn)(2), jax.jit(fn)(2))


def test_jit_dtype_change_is_legal():
  """Under jit (no loop) a write that changes a Variable's dtype is allowed."""
  v = nnx.Variable(jnp.zeros(3))

  @bnx.jit
  def f():
    v.set_value(v.get_value().astype(jnp.int32) + 1)  # `v[...] = ...` would keep float32

  f()
  raw = concrete(v)
  assert raw.dtype == jnp.int32
  np.testing.assert_array_equal(raw, np.ones(3, np.int32))


def test_lower_compile_call_with_user_args():
  """jit(f).lower(x).compile() takes the user's arguments, returns f's output and writes Variables."""
  m = linear()
  counter = nnx.Variable(jnp.array(0))

  def f(x):
    counter[...] += 1
    return m(x)

  compiled = bnx.jit(f).lower(X).compile()
  assert int(counter[...]) == 0
  expect = X @ m.kernel[...] + m.bias[...]
  np.testing.assert_allclose(compiled(X), expect, rtol=1e-6)
  assert int(concrete(counter)) == 1
  np.testing.assert_allclose(compiled(X + 1), (X + 1) @ m.kernel[...] + m.bias[...], rtol=1e-6)
  assert int(concrete(counter)) == 2



def test_trace_lower_compile_stages_as_jax_jit():
  """f.trace(x).lower().compile() is jax.jit's staging on the pure step, and the compiled call
  writes the Variable back."""
  count = nnx.Variable(jnp.zeros(()))

  def f(x):
    count[...] += 1.0
    return (x * 2.0).sum()

  traced = bnx.jit(f).trace(X)
  pure = jax.jit(lambda c, x: (c + 1.0, (x * 2.0).sum())).trace(jnp.zeros(()), X)
  assert sorted(str(e.primitive) for e in traced.jaxpr.jaxpr.eqns if 'pjit' not in str(e.primitive)) == \
    sorted(str(e.primitive) for e in pure.jaxpr.jaxpr.eqns)
  compiled = traced.lower().compile()
  np.testing.assert_allclose(compiled(X), (X * 2.0).sum())
  assert count[...] == 1.0
