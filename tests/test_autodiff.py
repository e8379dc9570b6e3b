"""jacrev / jacfwd / hessian / vjp / jvp against jax's on the pure function of the state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import brainnx as bnx

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
