"""jacrev / jacfwd / hessian / vjp / jvp against jax's on the pure function of the state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx
from helpers import assert_same_tree

W0 = jnp.array([[1.0, 2.0], [3.0, -1.0]])
X = jnp.array([0.5, -2.0])


def pure(w, x):
  return jnp.tanh(w @ x) * x


def _setup():
  w = nnx.Param(W0)
  calls = nnx.Variable(jnp.array(0))

  def f(x):
    calls[...] += 1
    return jnp.tanh(w[...] @ x) * x

  return w, calls, f


@pytest.mark.parametrize('name', ['jacrev', 'jacfwd'])
def test_jacobians_match_jax_for_states_and_arguments(name):
  w, calls, f = _setup()
  ours_w, ours_x = getattr(bnx, name)(f, grad_states=w, argnums=0)(X)
  ref_w, ref_x = getattr(jax, name)(pure, argnums=(0, 1))(W0, X)
  np.testing.assert_allclose(ours_w, ref_w, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(ours_x, ref_x, rtol=1e-5, atol=1e-7)
  assert int(calls[...]) == 1  # the other write lands once


def test_hessian_matches_jax():
  w, _, f = _setup()
  scalar = lambda x: f(x).sum()  # noqa: E731
  np.testing.assert_allclose(bnx.hessian(scalar)(X), jax.hessian(lambda x: pure(W0, x).sum())(X), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(
    bnx.hessian(scalar, grad_states=w)(X), jax.hessian(lambda w: pure(w, X).sum())(W0), rtol=1e-6
  )


def test_vjp_and_jvp_match_jax():
  w, calls, f = _setup()
  value, pull = bnx.vjp(f, X, grad_states=w)
  ref_value, ref_pull = jax.vjp(lambda w: pure(w, X), W0)
  ct = jnp.array([1.0, -3.0])
  np.testing.assert_allclose(value, ref_value, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(pull(ct), ref_pull(ct)[0], rtol=1e-5, atol=1e-7)
  value, pull = bnx.vjp(f, X)
  np.testing.assert_allclose(pull(ct)[0], jax.vjp(lambda x: pure(W0, x), X)[1](ct)[0], rtol=1e-5, atol=1e-7)
  out, tangent = bnx.jvp(f, (X,), (jnp.ones(2),))
  ref_out, ref_tangent = jax.jvp(lambda x: pure(W0, x), (X,), (jnp.ones(2),))
  np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(tangent, ref_tangent, rtol=1e-5, atol=1e-7)
  assert int(calls[...]) == 3
  with pytest.raises(TypeError, match='callable'):
    bnx.jacrev(3)


# -- structured outputs, argnums and arguments as JAX takes them ----------------------


@pytest.mark.parametrize('name', ['jacrev', 'jacfwd'])
def test_jacobian_of_a_tuple_output_has_the_output_structure_like_jax(name):
  f = lambda x: (x, 2 * x)  # noqa: E731
  out = getattr(bnx, name)(f)(X)
  ref = getattr(jax, name)(f)(X)
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  jax.tree.map(np.testing.assert_allclose, out, ref)


@pytest.mark.parametrize('name', ['jacrev', 'jacfwd'])
def test_jacobian_of_a_dict_output_with_two_argnums_is_not_unpacked_as_state_and_args(name):
  f = lambda x, y: {'a': x * y, 'b': jnp.tanh(x)}  # noqa: E731
  out = getattr(bnx, name)(f, argnums=(0, 1))(X, 2 * X)
  ref = getattr(jax, name)(f, argnums=(0, 1))(X, 2 * X)
  assert jax.tree.structure(out) == jax.tree.structure(ref)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out, ref)


@pytest.mark.parametrize('name', ['jacrev', 'jacfwd'])
def test_jacobian_with_grad_states_and_a_tuple_output_matches_jax_per_output(name):
  w, calls, _ = _setup()
  out = getattr(bnx, name)(lambda x: (w[...] @ x, jnp.sum(w[...]) * x), grad_states=w, argnums=0)(X)
  ref = getattr(jax, name)(lambda w, x: (w @ x, jnp.sum(w) * x), argnums=(0, 1))(W0, X)
  assert isinstance(out, tuple) and len(out) == 2
  for (state_jac, arg_jac), (ref_w, ref_x) in zip(out, ref):
    np.testing.assert_allclose(state_jac, ref_w)
    np.testing.assert_allclose(arg_jac, ref_x)


def test_jvp_primals_and_tangents_must_be_tuples_or_lists_like_jax():
  f = lambda *a: sum(a)  # noqa: E731
  with pytest.raises(TypeError, match='must be tuples or lists'):
    jax.jvp(f, jnp.ones(2), jnp.ones(2))
  with pytest.raises(TypeError, match='jvp: primals and tangents must be tuples or lists'):
    bnx.jvp(f, jnp.ones(2), jnp.ones(2))
  with pytest.raises(TypeError, match='got tuple and ArrayImpl'):
    bnx.jvp(f, (jnp.ones(2),), jnp.ones(2))
  out, ref = bnx.jvp(f, [jnp.ones(2)], [2 * jnp.ones(2)]), jax.jvp(f, [jnp.ones(2)], [2 * jnp.ones(2)])
  jax.tree.map(np.testing.assert_allclose, out, ref)


def test_vjp_negative_argnums_count_from_the_right_like_jax():
  f = lambda x, y: jnp.sum(10 * x + 100 * y ** 2)  # noqa: E731
  x, y = jnp.ones(2), jnp.arange(2.0)
  _, pull = bnx.vjp(f, x, y, argnums=(-1, 0))
  ref_y, ref_x = jax.grad(f, argnums=(-1, 0))(x, y)
  g_y, g_x = pull(1.0)
  np.testing.assert_allclose(g_y, ref_y)
  np.testing.assert_allclose(g_x, ref_x)
  _, pull = bnx.vjp(f, x, y, argnums=-2)
  np.testing.assert_allclose(pull(1.0), jax.grad(f, argnums=-2)(x, y))


def test_vjp_repeated_or_out_of_range_argnums_are_value_errors():
  f = lambda x, y: jnp.sum(10 * x + 100 * y)  # noqa: E731
  with pytest.raises(ValueError, match=r'vjp: argnums=\(0, -2\) names argument\(s\) \[0\] more than once'):
    bnx.vjp(f, jnp.ones(2), jnp.ones(2), argnums=(0, -2))
  with pytest.raises(ValueError, match='vjp: argnums=.* more than once'):
    bnx.vjp(f, jnp.ones(2), jnp.ones(2), argnums=(1, 1))
  with pytest.raises(ValueError, match='must have value greater than or equal to -len'):  # the oracle
    jax.grad(lambda x: jnp.sum(x), argnums=-3)(jnp.ones(2))
  with pytest.raises(ValueError, match=r'vjp: argnums=-3 is out of range: the function got 1 positional'):
    bnx.vjp(lambda x: jnp.sum(x), jnp.ones(2), argnums=-3)


@pytest.mark.parametrize('name', ['grad', 'value_and_grad', 'jacrev', 'jacfwd', 'hessian', 'vjp'])
@pytest.mark.parametrize('argnums', ['0', 1.0, (0, 'x'), None.__class__])
def test_argnums_of_the_wrong_type_are_type_errors_naming_argnums(name, argnums):
  f = lambda x: jnp.sum(x ** 2)  # noqa: E731
  with pytest.raises(TypeError, match=f'{name}: argnums must be an int or a sequence of ints'):
    if name == 'vjp':
      bnx.vjp(f, jnp.ones(2), argnums=argnums)
    else:
      getattr(bnx, name)(f, argnums=argnums)


@pytest.mark.parametrize('name', ['grad', 'value_and_grad', 'jacrev', 'jacfwd', 'hessian'])
@pytest.mark.parametrize('argnums', [True, False, (True, False)])
def test_a_bool_argnums_is_an_int_as_jax_takes_it(name, argnums):
  f = lambda x, y: jnp.sum(x ** 2 * y ** 3)  # noqa: E731
  x, y = jnp.array([1.0, 2.0]), jnp.array([3.0, 0.5])
  want = getattr(jax, name)(f, argnums=argnums)(x, y)
  if name == 'hessian' and isinstance(argnums, tuple):  # brainnx's gives each argument its own block
    want = tuple(want[k][k] for k in range(len(argnums)))
  got = getattr(bnx, name)(f, argnums=argnums)(x, y)
  assert_same_tree(got, want)


@pytest.mark.parametrize('name', ['jacrev', 'jacfwd', 'hessian', 'value_and_grad'])
def test_derivative_errors_name_the_transform_called(name):
  w = nnx.Variable(jnp.array([1, 2]))
  f = lambda x: jnp.sum(w[...] * x)  # noqa: E731
  with pytest.raises(TypeError, match=f'^{name}: cannot differentiate with respect to'):
    getattr(bnx, name)(f, grad_states=w)(jnp.ones(2))
  with pytest.raises(ValueError, match=f'^{name}: argnums=3 is out of range'):
    getattr(bnx, name)(lambda x: jnp.sum(x ** 2), argnums=3)(jnp.ones(2))
  with pytest.raises(ValueError, match=f'^{name}: grad_states=.* matches none'):
    getattr(bnx, name)(lambda x: jnp.sum(x ** 2), grad_states=nnx.BatchStat)(jnp.ones(2))


def test_hessian_over_several_variables_gives_each_its_own_block():
  a, b = nnx.Param(jnp.array([1.0, 2.0])), nnx.Param(jnp.array([3.0, 0.5, 1.0]))
  got = bnx.hessian(lambda: (a[...] ** 3).sum() * (b[...] ** 2).sum(), grad_states=[a, b])()
  want = jax.hessian(lambda p: (p[0] ** 3).sum() * (p[1] ** 2).sum())((a[...], b[...]))
  assert [g.shape for g in got] == [(2, 2), (3, 3)]
  np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0][0]), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1][1]), rtol=1e-6)
