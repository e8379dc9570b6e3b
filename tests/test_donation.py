"""``jit(donate_states=...)``: written Variables' buffers are reused, as with ``donate_argnums``.

Oracle: the pure training step under ``jax.jit(donate_argnums=0)`` on ``nnx.split`` state.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import brainnx as bnx
from helpers import MLP

X = jnp.ones((8, 16))


def make():
  model = MLP(16, 64, 16, rngs=nnx.Rngs(0))
  return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def step(model, opt, x):
  grads = bnx.grad(lambda x: (model(x) ** 2).mean(), grad_states=model)(x)
  opt.update(model, grads)


def test_donated_step_aliases_like_the_pure_step_and_gives_the_same_values():
  """``donate_states=True`` aliases what the pure step donating its state aliases, ``nnx.Param``
  what donating only the Params does; the default donates nothing on CPU and, on an accelerator,
  what ``True`` donates. Values as the pure step's."""
  from brainnx._engine import jitted

  results = {}
  for donate in (None, True, nnx.Param):
    model, opt = make()
    f = bnx.jit(step, donate_states=donate)
    aliased = f.lower(model, opt, X).compile().memory_analysis().alias_size_in_bytes
    for _ in range(3):
      f(model, opt, X)
    results[donate] = aliased, jax.tree.map(np.asarray, nnx.state(model))

  model, opt = make()
  graphdef, state = nnx.split((model, opt))

  def pure(state, x):
    m, o = nnx.merge(graphdef, state)
    o.update(m, nnx.grad(lambda m: (m(x) ** 2).mean())(m))
    return nnx.state((m, o))

  pure_step = jax.jit(pure, donate_argnums=0)
  pure_alias = pure_step.lower(state, X).compile().memory_analysis().alias_size_in_bytes
  assert results[True][0] == pure_alias > 0
  assert results[None][0] == (pure_alias if jax.default_backend() in jitted.DONATE_BY_DEFAULT else 0)
  params, rest = nnx.state((model, opt), nnx.Param, ...)

  def pure_params(params, rest, x):  # the same step donating only the Params
    out = pure(nnx.merge_state(params, rest), x)
    return nnx.state(out, nnx.Param), nnx.state(out, nnx.Not(nnx.Param))

  param_alias = jax.jit(pure_params, donate_argnums=0).lower(params, rest, X).compile().memory_analysis().alias_size_in_bytes
  assert results[nnx.Param][0] == param_alias > 0  # only the Params: the optimizer state is copied
  for _ in range(3):
    state = pure_step(state, X)
  expected = jax.tree.map(np.asarray, state[0])  # the model's part of the (model, opt) state
  for donate in (None, True, nnx.Param):
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), results[donate][1], expected)


def test_an_old_array_of_a_donated_variable_is_deleted():
  model, opt = make()
  old = model.l1.kernel[...]
  bnx.jit(step, donate_states=True)(model, opt, X)
  with pytest.raises(RuntimeError, match='deleted'):
    old + 1
  assert np.isfinite(np.asarray(model.l1.kernel[...])).all()  # the Variable holds the new buffer


def _host_says_no(x):
  raise RuntimeError('host says no')


def _raising_callbacks():
  from jax.experimental import io_callback

  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  return {
    'pure_callback': lambda x: jax.pure_callback(_host_says_no, scalar, x),
    'io_callback': lambda x: io_callback(_host_says_no, scalar, x),
    'debug.callback': lambda x: (jax.debug.callback(_host_says_no, x), x)[1],
    'callback inside scan': lambda x: jax.lax.scan(
      lambda c, _: (c + jax.pure_callback(_host_says_no, scalar, c), None), x, None, length=2)[0],
  }


@pytest.mark.parametrize('kind', list(_raising_callbacks()))
def test_a_failing_host_callback_leaves_donated_variables_their_pre_call_values(kind):
  callback = _raising_callbacks()[kind]
  model, opt = make()
  # the pre-call values, read off an identical model: a host view of the model's own buffers
  # would keep XLA from donating them
  before = jax.tree.map(np.asarray, nnx.state(make()[0]))

  @bnx.jit(donate_states=True)
  def f(x):
    step(model, opt, x)
    return callback(jnp.float32(1.0))

  with pytest.raises(Exception, match='host says no'):
    jax.block_until_ready(f(X))
  leaves = jax.tree.leaves(nnx.state(model))
  assert not any(leaf.is_deleted() for leaf in leaves)  # not consumed by donation
  after = jax.tree.map(lambda a: np.asarray(a + 0), nnx.state(model))  # computed on device, not a cached copy
  jax.tree.map(np.testing.assert_array_equal, after, before)



def test_a_program_with_a_host_callback_gives_the_values_of_the_undonated_program():
  scalar = jax.ShapeDtypeStruct((), jnp.float32)
  results = []
  for donate in (None, True):
    model, opt = make()

    @bnx.jit(donate_states=donate)
    def f(x):
      step(model, opt, x)
      return jax.pure_callback(lambda a: np.float32(a * 2), scalar, jnp.float32(1.0))

    out = f(X)
    results.append((float(out), jax.tree.map(np.asarray, nnx.state(model))))
  assert results[0][0] == results[1][0] == 2.0
  jax.tree.map(np.testing.assert_array_equal, results[0][1], results[1][1])


@pytest.mark.parametrize('form', ['call', 'decorator'])
def test_donate_states_donates_only_what_the_call_writes(form):
  """A Variable the call only reads keeps its buffer (its old array stays usable); the written
  one's old buffer is consumed, as jax.jit's donation of that argument alone would; given to
  ``jit(f, ...)`` or to the decorator ``@jit(...)`` alike."""
  w, v = nnx.Param(jnp.ones(3)), nnx.Variable(jnp.zeros(3))

  def step():
    v[...] = v[...] + w[...]
    return v[...] * 2  # a second output of w's shape: a donated w would be reused for it

  f = bnx.jit(step, donate_states=True) if form == 'call' else bnx.jit(donate_states=True)(step)
  f()
  read, written = w.get_value(), v.get_value()
  f()
  assert not read.is_deleted() and written.is_deleted()
  np.testing.assert_allclose(read, jnp.ones(3))
  np.testing.assert_allclose(v[...], jnp.full(3, 2.0))


@pytest.fixture
def donating_by_default(monkeypatch):
  """This backend taken for an accelerator, where ``donate_states=None`` donates what a call writes."""
  from brainnx._engine import jitted

  monkeypatch.setattr(jitted, 'DONATE_BY_DEFAULT', frozenset({jax.default_backend()}))


def _buffer(variable) -> int:
  return variable[...].unsafe_buffer_pointer()


def test_the_default_donates_on_an_accelerator_and_spares_an_array_a_user_holds(donating_by_default):
  """On an accelerator a default call donates a written Variable's array, so XLA writes the result
  in place (the buffer is reused), unless something else references the old array: a user's
  ``old = v[...]`` still reads after the call (that call runs the program that donates nothing),
  and the next call donates again. Values as ``jax.lax.scan`` of the pure update."""
  w = nnx.Param(jnp.arange(3.0))
  step = bnx.jit(lambda x: w.set_value(w[...] * 2.0 + x))

  def oracle(calls):
    return jax.lax.scan(lambda c, _: (c * 2.0 + 1.0, None), jnp.arange(3.0), None, length=calls)[0]

  step(1.0)
  step(1.0)
  before = _buffer(w)
  step(1.0)
  assert _buffer(w) == before  # donated: the result lives in the old buffer
  old = w[...]
  step(1.0)
  assert not old.is_deleted()
  np.testing.assert_array_equal(old, oracle(3))
  assert old.unsafe_buffer_pointer() != _buffer(w)
  del old
  before = _buffer(w)
  step(1.0)
  assert _buffer(w) == before
  np.testing.assert_array_equal(w[...], oracle(5))


def test_the_default_spares_an_array_two_variables_share(donating_by_default):
  """An array held by two Variables is not donated by a call that writes one of them: the other
  keeps reading it."""
  shared = jnp.ones(3)
  a, b = nnx.Param(shared), nnx.Param(shared)
  del shared
  step = bnx.jit(lambda: a.set_value(a[...] + 1.0))
  step()
  step()
  np.testing.assert_array_equal(b[...], jnp.ones(3))
  np.testing.assert_array_equal(a[...], jnp.full(3, 3.0))


@pytest.mark.skipif(jax.default_backend() != 'cpu', reason='reads the CPU default')
def test_the_default_donates_nothing_on_cpu():
  """On CPU (this suite's backend) the default call donates nothing: a fresh buffer each call."""
  w = nnx.Param(jnp.arange(3.0))
  step = bnx.jit(lambda: w.set_value(w[...] + 1.0))
  step()
  pointers = []
  for _ in range(3):
    pointers.append(_buffer(w))
    step()
  assert _buffer(w) not in pointers[-1:]


# -- issue 55: donate_argnums / donate_argnames on graph nodes, as nnx.jit means them -------------

DONATING_ARGS = {
  'donate_argnums': dict(donate_argnums=(0, 1)),
  'donate_argnames': dict(donate_argnames=('model', 'opt')),
  'a name, passed by keyword': dict(donate_argnames='opt'),
}


@pytest.mark.parametrize('form', list(DONATING_ARGS))
def test_donating_graph_node_arguments_donates_what_the_call_writes_in_them(form):
  model, opt = make()
  by_keyword = form == 'a name, passed by keyword'
  f = bnx.jit((lambda model, x, opt: step(model, opt, x)) if by_keyword else step, **DONATING_ARGS[form])
  run = (lambda: f(model, X, opt=opt)) if by_keyword else (lambda: f(model, opt, X))
  compiled = f.lower(model, X, opt=opt) if by_keyword else f.lower(model, opt, X)
  written = nnx.state(opt) if by_keyword else nnx.state((model, opt))
  # the backend's own figure for donating exactly those arrays (an accelerator pads buffers)
  donated = jax.jit(lambda w: jax.tree.map(lambda a: a + 1, w), donate_argnums=0).lower(written).compile()
  assert compiled.compile().memory_analysis().alias_size_in_bytes == donated.memory_analysis().alias_size_in_bytes > 0
  old_mu = opt.opt_state[0].mu['l1']['kernel'][...]
  for _ in range(3):
    run()
  assert old_mu.is_deleted()  # donated, as nnx.jit(donate_argnums=...) donates it
  theirs, their_opt = make()  # the oracle: nnx.jit of the same step, donating the same arguments
  their_step = nnx.jit(lambda m, o, x: o.update(m, nnx.grad(lambda m: (m(x) ** 2).mean())(m)), donate_argnums=(0, 1))
  for _ in range(3):
    their_step(theirs, their_opt, X)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), nnx.state(model), nnx.state(theirs))


def test_a_donated_name_that_is_no_parameter_is_refused_by_name():
  with pytest.raises(ValueError, match=r"jit: donate_argnames \['optimiser'\] are not parameters of the function"):
    bnx.jit(step, donate_argnames=('model', 'optimiser'))
