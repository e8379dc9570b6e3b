"""A differential program generator: it draws whole programs, runs each under brainnx and under
its oracle, and compares everything a user can observe.

A program is a world (a Module tree with the Variable kinds users write, a global Variable), a
body (the statements of one function over that world), a way the function reaches the world
(argument, closure, global, a plain object, a bound method), a transform (or a nest of them) and
a sequence of calls with edits between them (every route by which code outside writes a
Variable or changes the graph). Two identical worlds are built: world A runs under brainnx,
world B under the oracle, which reaches its world through an explicit argument:

- ``jit``, ``remat``, ``cond``, ``switch``: eager Python (only the branch taken runs);
- ``vmap``: eager Python on the whole batch (every statement is elementwise or broadcasts over
  it: no reduction over the last axis, which would mix the elements), every RNG
  stream advanced once (the documented split per element), and a ``BatchAxisError`` with
  every Variable as before where a batched value is written into a broadcast Variable;
- ``for_loop``, ``scan``: a Python loop over the rows;
- ``grad``, ``value_and_grad``: ``nnx.grad`` / ``nnx.value_and_grad`` with the world passed;
- ``eval_shape``: the shapes eager Python gives, and no Variable changed;
- ``pmap``, ``vmap_new_states``: as ``vmap``; ``map`` with ``batch_size``: a Python loop over
  the rows (streams advanced once per chunk); ``while_loop``, ``fori_loop``,
  ``bounded_while_loop``: ``f(f(x))``; the checkpointed loops: as ``scan`` / ``for_loop``;
  ``shard_map`` on a one-device mesh and ``StatefulFunction.jaxpr_call``: eager Python;
- ``jvp``, ``vjp``, ``jacfwd``, ``jacrev``, ``hessian``: JAX's derivative of the function on a
  copy of the world (Variables held constant), then the eager call for the writes;
- ``grad_states`` (a Variable instance the world held at the start, which edits may replace):
  ``jax.grad`` with respect to that instance's value, zero once it left the graph.

After every call: outputs (structure, values, array types, returned inputs being the very
objects), then every Variable of world A against world B (paths, types, values). Run
``python benchmarks/differential_long.py`` for the long profile; ``VOCABULARY`` below is what
a program may contain (``tests/README.md`` says how to add to it).
"""

from __future__ import annotations

import dataclasses
import textwrap
import threading
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from hypothesis import strategies as st

import brainnx as bnx


class Counter(nnx.Variable):
  """A user-defined Variable type."""


#: A global read inside a method of the Module (the Module is reached as data, not called).
GSCALE = nnx.Variable(jnp.full((3,), 1.5))


class Holder(nnx.Module):
  """A node created inside a call and returned: a Variable holding a pytree."""

  def __init__(self, x):
    self.t = nnx.Variable({'k': x, 'j': (x * 10.0, x.sum(-1))})


@dataclasses.dataclass(frozen=True)
class WorldSpec:
  layers: bool  # Linear, BatchNorm (training mode), Dropout
  tree: bool  # a Variable whose value is a pytree
  shared: bool  # one Variable at two attributes
  empty_cache: bool  # ``nnx.data({})`` (else holding one Cache)
  empty_list: bool  # ``nnx.data([])`` (else an ``nnx.List`` holding one Param)
  rngs: bool
  stack: bool = False  # a Variable a brainnx vmap built stacked with 2 members, never read by a body


class Net(nnx.Module):
  def __init__(self, spec: WorldSpec):
    self.w = nnx.Param(jnp.array([0.5, -1.0, 2.0]))
    self.c = Counter(jnp.array(1.0))
    self.h = nnx.Variable(jnp.zeros(3))
    if spec.layers:
      self.lin = nnx.Linear(3, 3, rngs=nnx.Rngs(0))
      self.bn = nnx.BatchNorm(3, use_running_average=False, rngs=nnx.Rngs(0))
      self.drop = nnx.Dropout(0.5, rngs=nnx.Rngs(1))
    self.named = nnx.Dict(a=nnx.Param(jnp.full(3, -0.5)))
    if spec.tree:
      self.t = nnx.Variable({'k': jnp.full(3, 0.5), 'j': (jnp.arange(3.0), jnp.array(2.0))})
    if spec.shared:
      self.alias = self.w
    self.cache = nnx.data({} if spec.empty_cache else {'a': nnx.Cache(jnp.ones(3))})
    self.items = nnx.data([]) if spec.empty_list else nnx.List([nnx.Param(jnp.full(3, 0.25))])
    if spec.rngs:
      self.rngs = nnx.Rngs(0)
    if spec.stack:  # beside the state a mapped call of 2 elements maps: reached, not read
      self.stack = bnx.vmap(lambda: nnx.Variable(jnp.zeros(3)), axis_size=2)()

  def scaled(self, x):
    return x * GSCALE[...]


class Runner(nnx.Module):
  """Holds the model; its bound method is the transformed function (access ``method``)."""

  def __init__(self, model):
    self.model = model


class Trainer:
  """A plain object holding the model (access ``trainer``)."""

  def __init__(self, model):
    self.model = model


# -- the vocabulary ---------------------------------------------------------------------------
# Each statement: its source (``m`` the model, ``G`` the global Variable, ``acc`` the running
# value, shape (3,) or (batch, 3)), what it needs of the world, and what it is:
# 'read', 'write' (independent of the batch), 'batched write', 'create' (attaches Variables),
# 'bind' (binds an attribute to an object the model already holds: creates nothing),
# 'rng' (draws from the model's Rngs).


@dataclasses.dataclass(frozen=True)
class Statement:
  source: str
  kind: str
  needs: str = ''  # a WorldSpec field that must be true
  target: str = ''  # the Variable a write writes
  constant: bool = False  # a write of a value that depends on nothing


def host_half(x):
  """``x / 2`` computed on the host by ``jax.pure_callback`` (batched one element at a time)."""
  return jax.pure_callback(lambda a: np.asarray(a) / 2, jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), x,
                           vmap_method='sequential')


VOCABULARY = (
  Statement('acc = acc + m.w[...]', 'read'),
  Statement('acc = acc * m.c[...] + 1.0', 'read'),
  Statement('acc = acc + G[...]', 'read'),
  Statement('acc = (lambda: acc * G[...])()', 'read'),  # the global named only by nested code
  Statement('acc = m.scaled(acc)', 'read'),
  Statement('acc = m.lin(acc)', 'read', 'layers'),
  Statement('acc = m.bn(acc[..., None, :])[..., 0, :] + acc', 'batched write', 'layers', 'bn'),
  Statement('acc = m.drop(acc)', 'rng', 'layers'),
  Statement('acc = acc + sum((v[...] for v in m.named.values()), jnp.zeros(3))', 'read'),
  Statement("acc = acc + m.t['k'] * m.t['j'][1] + m.t['j'][0]", 'read', 'tree'),
  Statement('acc = acc - m.alias[...]', 'read', 'shared'),
  Statement('acc = acc + sum((v[...] for v in m.cache.values()), jnp.zeros(3))', 'read'),
  Statement('acc = acc + sum((v[...] for v in m.items), jnp.zeros(3))', 'read'),
  Statement('acc = jnp.tanh(acc)', 'read'),
  # a host callback (no effect, no derivative: its input is held constant): the call waits for it
  Statement("acc = acc + host(jax.lax.stop_gradient(acc))", 'read'),
  Statement('m.c[...] = m.c[...] + 1.0', 'write', target='c'),
  Statement('m.w[...] = m.w[...] * 0.9', 'write', target='w'),
  Statement('G[...] = G[...] - 0.5', 'write', target='G'),
  Statement('(lambda: G.set_value(G[...] + 0.25))()', 'write', target='G'),
  Statement("m.t.set_value({'k': m.t['k'] * 2.0, 'j': (m.t['j'][0] + 1.0, m.t['j'][1] - 1.0)})", 'write', 'tree', 't'),
  Statement('m.c.set_value(jnp.array(-1.0))', 'write', target='c', constant=True),  # a literal of the jaxpr
  Statement('m.w[...] = m.w[...] * 0.5 + acc', 'batched write', target='w'),
  Statement('m.h[...] = m.h[...] * 0.5 + acc', 'batched write', target='h'),  # elementwise: the eager batch is the oracle
  Statement('G[...] = acc * 0.1', 'batched write', target='G'),
  Statement("m.sow(nnx.Intermediate, 's', acc)", 'create'),
  Statement('m.h = nnx.Variable(m.h[...] * 0.5 + acc)', 'create'),
  Statement("if 'z' not in m.cache:\n  m.cache['z'] = nnx.Cache(jnp.zeros(3))\nm.cache['z'][...] += acc", 'create'),
  Statement('if len(m.items) < 2:\n  m.items.append(nnx.Param(jnp.ones(3)))\nacc = acc + m.items[-1][...]', 'create'),
  Statement("if not hasattr(m.named, 'b'):\n  m.named['b'] = nnx.Param(jnp.ones(3))\nacc = acc * m.named['b'][...]", 'create'),
  Statement("if not hasattr(m, 'extra'):\n  m.extra = nnx.Linear(3, 3, rngs=nnx.Rngs(2))\nacc = m.extra(acc)", 'create'),
  Statement("if 'a' in m.cache:\n  del m.cache['a']", 'create'),  # a node popped inside
  Statement('m.held = m.w\nacc = acc + m.held[...]', 'bind'),  # an existing Variable at a new attribute
  Statement("m.held_dict = m.named\nacc = acc * m.held_dict['a'][...]", 'bind'),  # an existing node
  Statement('acc = acc + m.rngs.uniform((3,))', 'rng', 'rngs'),
  # vmap_new_states stacks what it creates (a later call reading the stack whole is refused: no
  # sow, which reads what it appends to)
  Statement('m.h = nnx.Variable(acc * 0.5)', 'stacked create', target='h'),
)

RETURNS = {
  'acc': 'return acc',
  'model': 'return acc, m',
  'popped': 'return acc, nnx.pop(m, nnx.Intermediate)',
  'created': 'return acc, Holder(acc)',
  'captured': "return nnx.capture(lambda m, a: (m.sow(nnx.Intermediate, 'cap', a), a * 2.0)[1], nnx.Intermediate)(m, acc)",
}

# transform -> (statement kinds it takes, return forms it takes)
TRANSFORMS = {
  'jit': ({'read', 'write', 'batched write', 'create', 'bind', 'rng'},
          ('acc', 'model', 'popped', 'created') + (('captured',) if hasattr(nnx, 'capture') else ())),  # flax >= 0.12.6
  'vmap': ({'read', 'write', 'bind', 'batched write'}, ('acc', 'model')),
  'jit(vmap)': ({'read', 'write', 'bind', 'batched write'}, ('acc',)),
  'for_loop': ({'read', 'write', 'bind', 'batched write', 'rng'}, ('acc',)),
  'jit(for_loop)': ({'read', 'write', 'bind', 'batched write', 'rng'}, ('acc',)),
  'scan': ({'read', 'write', 'bind', 'batched write', 'rng'}, ('acc',)),
  'grad': ({'read', 'write', 'bind', 'batched write', 'rng'}, ('acc',)),
  'value_and_grad': ({'read', 'write', 'bind', 'batched write', 'rng'}, ('acc',)),
  'cond': ({'read', 'write', 'batched write', 'rng'}, ('acc',)),
  'switch': ({'read', 'write', 'batched write', 'rng'}, ('acc',)),
  'remat': ({'read', 'write', 'bind', 'batched write', 'rng'}, ('acc', 'model', 'created')),
  'eval_shape': ({'read', 'write', 'batched write', 'rng'}, ('acc', 'created')),
  'vmap(jit)': ({'read', 'write', 'bind', 'batched write'}, ('acc',)),
  'jit(grad)': ({'read', 'write', 'bind', 'batched write', 'rng'}, ('acc',)),
  'grad(jit)': ({'read', 'write', 'bind', 'batched write', 'rng'}, ('acc',)),
  'jit(cond)': ({'read', 'write', 'batched write', 'rng'}, ('acc',)),
  'jit(remat)': ({'read', 'write', 'bind', 'batched write', 'rng'}, ('acc', 'model')),
}
LOOP_KINDS = {'read', 'write', 'bind', 'batched write', 'rng'}
TRANSFORMS.update({
  'pmap': ({'read', 'write', 'bind', 'batched write'}, ('acc',)),
  'vmap_new_states': ({'read', 'write', 'bind', 'batched write', 'stacked create'}, ('acc', 'model')),
  'map': ({'read'}, ('acc',)),  # with batch_size: vmap over chunks, which may write only RNG state
  'jit(map)': ({'read'}, ('acc',)),
  'while_loop': (LOOP_KINDS, ('acc',)),
  'jit(while_loop)': (LOOP_KINDS, ('acc',)),
  'fori_loop': (LOOP_KINDS, ('acc',)),
  'jit(fori_loop)': (LOOP_KINDS, ('acc',)),
  'bounded_while_loop': (LOOP_KINDS, ('acc',)),
  'checkpointed_scan': (LOOP_KINDS, ('acc',)),
  'jit(checkpointed_scan)': (LOOP_KINDS, ('acc',)),
  'checkpointed_for_loop': (LOOP_KINDS, ('acc',)),
  'shard_map': (LOOP_KINDS, ('acc',)),
  'jit(shard_map)': (LOOP_KINDS, ('acc',)),
  'jvp': (LOOP_KINDS, ('acc',)),
  'vjp': (LOOP_KINDS, ('acc',)),
  'jacfwd': (LOOP_KINDS, ('acc',)),
  'jacrev': (LOOP_KINDS, ('acc',)),
  'jit(jacrev)': (LOOP_KINDS, ('acc',)),
  'hessian': (LOOP_KINDS, ('acc',)),
  'grad_states': (LOOP_KINDS, ('acc',)),  # grad_states= the model's first w instance (edits may replace it)
  'jit(grad_states)': (LOOP_KINDS, ('acc',)),
  'make_jaxpr': ({'read', 'write', 'batched write', 'rng'}, ('acc',)),  # StatefulFunction.jaxpr_call, written back
})
BATCHED = ('vmap', 'jit(vmap)', 'vmap(jit)', 'pmap', 'vmap_new_states')  # the input is a batch of 2
LOOPS = ('for_loop', 'jit(for_loop)', 'scan', 'map', 'jit(map)', 'checkpointed_scan', 'jit(checkpointed_scan)',
         'checkpointed_for_loop')  # the input is 2 rows, one per step
TWICE = ('while_loop', 'jit(while_loop)', 'fori_loop', 'jit(fori_loop)', 'bounded_while_loop')  # f(f(x))
DERIVATIVES = ('jvp', 'vjp', 'jacfwd', 'jacrev', 'jit(jacrev)', 'hessian')  # of a copy of the world, then eager
EAGER = ('jit', 'vmap', 'jit(vmap)', 'vmap(jit)', 'remat', 'jit(remat)', 'eval_shape', 'pmap', 'vmap_new_states',
         'shard_map', 'jit(shard_map)', 'make_jaxpr')

ACCESS = ('arg', 'closure', 'global', 'trainer', 'method', 'exec trainer')
ONLY: list = []  # a sampler may narrow the draw to these transforms
#: pmap maps one element per device: where the default backend has one (an accelerator chip), it is not drawn
DRAWN = sorted(t for t in TRANSFORMS if 'pmap' not in t or jax.device_count() >= 2)
HOLDERS = ('trainer', 'exec trainer')  # a plain object the function reads the model from on every call

#: A plain holder class made by ``exec`` with globals that lack ``__name__`` (``__module__ ==
#: 'builtins'``, as some tools leave it): user code all the same.
_EXEC_NAMESPACE: dict = {}
exec('class ExecTrainer:\n  def __init__(self, model):\n    self.model = model\n', _EXEC_NAMESPACE)  # noqa: S102
ExecTrainer = _EXEC_NAMESPACE['ExecTrainer']


def _edit_set_value(m, G, k):
  m.w.set_value(jnp.full(3, 0.25 * k, jnp.float32))


def _edit_setitem(m, G, k):
  G[...] = jnp.full(3, -0.5 * k, jnp.float32)


def _edit_update(m, G, k):
  nnx.update(m, nnx.State({'c': Counter(jnp.array(2.0 + k, jnp.float32))}))


def _edit_replace(m, G, k):
  m.w = nnx.Param(jnp.full(3, 1.0 + k, jnp.float32))  # a new Variable at a known place


def _edit_fill(m, G, k):
  m.cache[f'late{k}'] = nnx.Cache(jnp.full(3, float(k), jnp.float32))  # a container gains state


def _edit_nnx_jit(m, G, k):
  nnx.jit(lambda m: m.c.set_value(m.c[...] * 2.0))(m)


def _edit_set_h(m, G, k):
  m.h[...] = jnp.full(3, 100.0 + k, jnp.float32)  # perhaps a Variable the calls replace


def _edit_gscale(m, G, k):
  GSCALE[...] = jnp.full(3, 1.5 + k, jnp.float32)  # a global of the module: one for both worlds


def _edit_pop(m, G, k):
  nnx.pop(m, nnx.Intermediate)


def _edit_delete(m, G, k):
  if hasattr(m, 'extra'):
    del m.extra  # a node the calls attached, removed from outside


def _edit_thread(m, G, k):
  t = threading.Thread(target=lambda: m.c.set_value(jnp.array(-float(k), jnp.float32)))
  t.start()
  t.join()


EDITS: dict[str, Callable] = {
  'set_value': _edit_set_value, 'setitem': _edit_setitem, 'nnx.update': _edit_update,
  'replace': _edit_replace, 'fill': _edit_fill, 'nnx.jit': _edit_nnx_jit, 'thread': _edit_thread,
  'set h': _edit_set_h, 'GSCALE': _edit_gscale, 'nnx.pop': _edit_pop, 'delete': _edit_delete,
}
SHARED_EDITS = ('GSCALE',)  # made once: both worlds read the same object
WORLD_EDITS = ('rebind',)  # edit the world (World.rebind), not the model


@dataclasses.dataclass(frozen=True)
class Program:
  world: WorldSpec
  body: tuple[int, ...]  # indices into VOCABULARY
  returns: str
  access: str
  transform: str
  edits: tuple[str | None, ...]  # before each call after the first
  pred: bool = True  # cond's predicate / switch's branch (True: the function)

  def source(self, oracle: bool) -> str:
    """The function's source: world A's (reaching it as ``access`` says) or the oracle's
    (``f(world, x)``)."""
    lines = '\n'.join(VOCABULARY[i].source for i in self.body) + '\n' + RETURNS[self.returns]
    if oracle:
      return 'def f(world, x):\n  m, G = world["model"], world["G"]\n  acc = x\n' + textwrap.indent(lines, '  ')
    body = textwrap.indent('acc = x\n' + lines, '    ')
    head = {
      'arg': 'def make(model, trainer):\n  def f(m, x):\n',
      'closure': 'def make(model, trainer):\n  m = model\n  def f(x):\n',
      'global': 'def make(model, trainer):\n  def f(x):\n    m = MODEL\n',
      'trainer': 'def make(model, trainer):\n  def f(x):\n    m = trainer.model\n',
      'exec trainer': 'def make(model, trainer):\n  def f(x):\n    m = trainer.model\n',
      'method': 'def make(model, trainer):\n  def f(self, x):\n    m = self.model\n',
    }[self.access]
    return head + body + '\n  return f\n'

  def __str__(self) -> str:
    return (f'# {self.transform}, access={self.access}, world={self.world}, edits={self.edits}, '
            f'pred={self.pred}\n' + self.source(oracle=False))


@st.composite
def programs(draw) -> Program:
  """A program: world, transform, body in that transform's vocabulary, calls and edits."""
  world = WorldSpec(*(draw(st.booleans()) for _ in range(7)))
  transform = draw(st.sampled_from(ONLY or DRAWN))
  kinds, returns = TRANSFORMS[transform]
  usable = [i for i, s in enumerate(VOCABULARY) if s.kind in kinds and (not s.needs or getattr(world, s.needs))]
  body = tuple(draw(st.lists(st.sampled_from(usable), min_size=1, max_size=6)))
  access = draw(st.sampled_from(ACCESS))
  if access == 'arg' and transform in ('cond', 'switch', 'jit(cond)'):
    access = 'closure'  # branches take the operand only
  edits = tuple(draw(st.lists(st.one_of(st.none(), st.sampled_from(sorted(EDITS) + list(WORLD_EDITS))),
                               min_size=0, max_size=3)))
  if access not in HOLDERS:  # only a holder read on every call can be rebound to another model
    edits = tuple(None if e in WORLD_EDITS else e for e in edits)
  return Program(world, body, draw(st.sampled_from(returns)), access, transform, edits, draw(st.booleans()))


# -- running a program ------------------------------------------------------------------------


class World:
  """One world: the model, the global Variable and the function over them."""

  def __init__(self, program: Program, oracle: bool):
    self.model = Net(program.world)
    self.selected = self.model.w  # what grad_states selects: this instance, wherever it goes
    self.G = nnx.Variable(jnp.array([1.0, 0.0, -1.0]))
    namespace = {'jnp': jnp, 'jax': jax, 'nnx': nnx, 'host': host_half, 'Holder': Holder, 'G': self.G, 'MODEL': self.model}
    exec(program.source(oracle), namespace)  # noqa: S102 - the drawn program
    if oracle:
      self.f = namespace['f']
      return
    trainer = (ExecTrainer if program.access == 'exec trainer' else Trainer)(self.model)
    fn = namespace['make'](self.model, trainer)
    runner = type('Runner', (Runner,), {'run': fn})(self.model)  # fn as a method of the class
    if program.access == 'method':
      fn = runner.run
    self.f = fn
    self.trainer = trainer
    self.keep = (trainer, runner)

  def rebind(self, program: Program) -> None:
    """The holder (and the oracle's world) now hold a fresh model of the same structure."""
    self.model = Net(program.world)
    if hasattr(self, 'trainer'):
      self.trainer.model = self.model

  def state(self) -> dict:
    return {path: (type(v), v.get_value()) for path, v in nnx.to_flat_state(nnx.state({'model': self.model, 'G': self.G}))}


def _inputs(program: Program):
  x = jnp.array([0.3, -0.7, 1.1])
  if program.transform in BATCHED or program.transform in LOOPS:
    return jnp.stack([x, x * -2.0 + 0.1])
  return x


MESH1 = jax.make_mesh((1,), ('d',), devices=jax.devices()[:1])
_P = jax.sharding.PartitionSpec
_TANGENT = jnp.array([1.0, -0.5, 2.0])


def _while_cond(c):
  return c[0] < 2


def _build_more(program: Program, w: World, f1: Callable, t: str) -> Callable:
  """The transforms beyond the first generator's (see ``build_ours``)."""
  inner = t[4:-1] if t.startswith('jit(') else t
  g = None
  if inner == 'pmap':
    g = bnx.pmap(f1)
  elif inner == 'vmap_new_states':
    g = bnx.vmap_new_states(f1)
  elif inner == 'map':
    g = lambda x: bnx.map(f1, x, batch_size=1 if program.pred else 2)  # noqa: E731
  elif inner == 'while_loop':
    g = lambda x: bnx.while_loop(_while_cond, lambda c: (c[0] + 1, f1(c[1])), (0, x))[1]  # noqa: E731
  elif inner == 'fori_loop':
    g = lambda x: bnx.fori_loop(0, 2, lambda i, c: f1(c), x)  # noqa: E731
  elif inner == 'bounded_while_loop':
    g = lambda x: bnx.bounded_while_loop(_while_cond, lambda c: (c[0] + 1, f1(c[1])), (0, x), max_steps=3, base=2)[1]  # noqa: E731
  elif inner == 'checkpointed_scan':
    step = lambda c, x: (c + f1(x), c)  # noqa: E731
    g = lambda x: bnx.checkpointed_scan(step, jnp.zeros(3), x, base=2)  # noqa: E731
  elif inner == 'checkpointed_for_loop':
    g = lambda x: bnx.checkpointed_for_loop(f1, x, base=2)  # noqa: E731
  elif inner == 'shard_map':
    g = bnx.shard_map(f1, mesh=MESH1, in_specs=_P(), out_specs=_P())
  elif inner == 'jvp':
    g = lambda x: bnx.jvp(f1, (x,), (_TANGENT,))  # noqa: E731
  elif inner == 'vjp':
    def g(x):
      value, pull = bnx.vjp(f1, x)
      return value, pull(_TANGENT)[0]
  elif inner in ('jacfwd', 'jacrev'):
    g = getattr(bnx, inner)(f1)
  elif inner == 'hessian':
    g = bnx.hessian(lambda x: f1(x).sum())
  elif inner == 'grad_states':
    g = bnx.grad(lambda x: f1(x).sum(), grad_states=w.selected)
  elif inner == 'make_jaxpr':
    sf = bnx.StatefulFunction(f1)

    def g(x):
      states = sf.get_states(x)
      new, out = sf.jaxpr_call([v.get_value() for v in states], x)
      for v, value in zip(states, new):
        v.set_value(value)
      return out
  if g is None:
    raise AssertionError(t)
  return bnx.jit(g) if t.startswith('jit(') else g


def build_ours(program: Program, w: World) -> Callable:
  """World A's function under the program's transform, built once: ``call(x)`` for every call
  of the sequence (warm calls reuse what the first one cached, as a user's would)."""
  f, t, model = w.f, program.transform, w.model
  by_arg = program.access == 'arg'
  f1 = (lambda x: w.f(model, x)) if by_arg else f  # noqa: E731 - the model passed by argument each call
  with_model = (lambda g: lambda x: g(model, x)) if by_arg else (lambda g: g)  # noqa: E731
  if t == 'jit':
    return with_model(bnx.jit(f))
  if t in ('vmap', 'jit(vmap)', 'vmap(jit)'):
    inner = bnx.jit(f) if t == 'vmap(jit)' else f
    g = bnx.vmap(inner, in_axes=(None, 0)) if by_arg else bnx.vmap(inner)
    return with_model(bnx.jit(g) if t == 'jit(vmap)' else g)
  if t == 'for_loop':
    return lambda x: bnx.for_loop(f1, x)
  if t == 'jit(for_loop)':
    return bnx.jit(lambda xs: bnx.for_loop(f1, xs))
  if t == 'scan':
    step = lambda c, x: (c + f1(x), c)  # noqa: E731
    return lambda x: bnx.scan(step, jnp.zeros(3), x)
  if t in ('grad', 'value_and_grad', 'jit(grad)', 'grad(jit)'):
    transform = getattr(bnx, 'value_and_grad' if t == 'value_and_grad' else 'grad')
    inner = bnx.jit(f) if t == 'grad(jit)' else f
    if by_arg:
      g = transform(lambda m, x: inner(m, x).sum(), argnums=1)
    else:
      g = transform(lambda x: inner(x).sum())
    return with_model(bnx.jit(g) if t == 'jit(grad)' else g)
  if t == 'cond':
    return lambda x: bnx.cond(program.pred, f1, _other_branch, x)
  if t == 'jit(cond)':  # the predicate a traced value
    g = bnx.jit(lambda x, p: bnx.cond(p, f1, _other_branch, x))
    return lambda x: g(x, jnp.asarray(program.pred))
  if t == 'jit(remat)':
    return with_model(bnx.jit(bnx.remat(f)))
  if t == 'switch':
    return lambda x: bnx.switch(0 if program.pred else 1, [f1, _other_branch], x)
  if t == 'remat':
    return with_model(bnx.remat(f))
  if t == 'eval_shape':
    return (lambda x: bnx.eval_shape(f, model, x)) if by_arg else (lambda x: bnx.eval_shape(f, x))
  return _build_more(program, w, f1, t)


def _other_branch(x):
  return x * 2.0


def run_oracle(program: Program, w: World, x):
  """The same call on world B, without brainnx."""
  world = {'model': w.model, 'G': w.G}
  f = lambda x: w.f(world, x)  # noqa: E731
  t = program.transform
  if t in EAGER:
    return f(x)
  if t in TWICE:
    return f(f(x))
  if t in ('for_loop', 'jit(for_loop)', 'map', 'jit(map)', 'checkpointed_for_loop'):
    return jnp.stack([f(row) for row in x])
  if t in DERIVATIVES:
    derivative = _derivative_of_a_copy(t, w, world, x)  # the world as it is before the call
    return f(x), derivative  # the eager call writes what brainnx's one trace writes
  if t in ('grad_states', 'jit(grad_states)'):
    grads = _grad_of_the_selected(w, world, x)
    f(x)  # the writes of the one call
    return grads
  if t in ('scan', 'checkpointed_scan', 'jit(checkpointed_scan)'):
    c, ys = jnp.zeros(3), []
    for row in x:
      c, y = c + f(row), c
      ys.append(y)
    return c, jnp.stack(ys)
  if t in ('grad', 'value_and_grad', 'jit(grad)', 'grad(jit)'):
    transform = getattr(nnx, 'value_and_grad' if t == 'value_and_grad' else 'grad')
    return transform(lambda x, world: w.f(world, x).sum())(x, nnx.Dict(world))
  if t in ('cond', 'jit(cond)'):
    return f(x) if program.pred else _other_branch(x)
  if t == 'switch':
    return f(x) if program.pred else _other_branch(x)
  raise AssertionError(t)


def _derivative_of_a_copy(t: str, w: World, world: dict, x):
  """``jax``'s derivative of the function on a copy of the world (Variables held constant, as
  brainnx's jvp/vjp/jac* hold them; the copy's writes are dropped)."""
  graphdef, state = nnx.split(nnx.Dict(world))
  # Variables made inside the trace (merge alone would reuse the split's, made outside: flax
  # refuses writes to those under a JAX transform)
  pure = lambda x: w.f(nnx.merge(graphdef, jax.tree.map(lambda a: a, state)), x)  # noqa: E731
  if t == 'jvp':
    return jax.jvp(pure, (x,), (_TANGENT,))[1]
  if t == 'vjp':
    return jax.vjp(pure, x)[1](_TANGENT)[0]
  if t == 'hessian':
    return jax.hessian(lambda x: pure(x).sum())(x)
  return (jax.jacfwd if t == 'jacfwd' else jax.jacrev)(pure)(x)


def _grad_of_the_selected(w: World, world: dict, x):
  """``jax.grad`` with respect to the value of ``w.selected`` (the instance grad_states
  names) of the function on a copy of the world: zero once that instance left the graph."""
  graphdef, state = nnx.split(nnx.Dict(world))
  path = next((p for p, node in nnx.iter_graph(nnx.Dict(world)) if node is w.selected), None)

  def pure(value):
    copy = nnx.merge(graphdef, jax.tree.map(lambda a: a, state))
    if path is not None:
      node = copy
      for key in path:
        node = node[key] if isinstance(node, (nnx.Dict, dict, nnx.List, list)) else getattr(node, key)
      node.set_value(value)
    return w.f(copy, x).sum()

  return jax.grad(pure)(w.selected[...])


def expected_error(program: Program):
  """The documented error a program must raise, if any (``None``: it must run): under ``vmap``,
  a broadcast Variable whose final value depends on the batch (a later constant write undoes
  an earlier batched one; a write reading a batched value stays batched)."""
  if program.transform not in BATCHED:
    return None
  batched: dict = {}
  created: set = set()  # Variables replaced by one the call creates: its writes go to the new one
  for i in program.body:
    s = VOCABULARY[i]
    if s.kind == 'stacked create':
      created.add(s.target)
    elif s.kind == 'batched write' and s.target not in created:
      batched[s.target] = True
    elif s.constant:
      batched[s.target] = False
  return bnx.BatchAxisError if any(batched.values()) else None


def mapped_calls(program: Program) -> int:
  """How many mapped calls one call makes: one for a batched transform, one per chunk for
  ``map`` with ``batch_size`` (1: two chunks of the 2 rows; 2: one), none otherwise."""
  if program.transform in BATCHED:
    return 1
  if program.transform in ('map', 'jit(map)'):
    return 2 if program.pred else 1
  return 0


def reaches_model(program: Program) -> bool:
  """Whether the function reaches the model (a closure reaches it only if its code names it)."""
  if program.access != 'closure':
    return True
  return program.returns in ('model', 'popped') or any('m.' in VOCABULARY[i].source for i in program.body)


def assert_same_output(program: Program, got, want, wa: World, wb: World) -> None:
  is_node = lambda x: isinstance(x, (nnx.Module, nnx.Variable, nnx.State))  # noqa: E731
  got_flat, got_def = jax.tree.flatten(got, is_leaf=is_node)
  want_flat, want_def = jax.tree.flatten(want, is_leaf=is_node)
  assert got_def == want_def, f'output structure {got_def} != {want_def}'
  for g, w_ in zip(got_flat, want_flat, strict=True):
    if isinstance(w_, nnx.Module) and w_ is wb.model:
      assert g is wa.model, 'a returned input is not the very object'
      continue
    if is_node(w_):
      g, w_ = _pure(g), _pure(w_)
      assert jax.tree.structure(g) == jax.tree.structure(w_), f'returned node {g} != {w_}'
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w_), strict=True):
      _same_leaf(program, a, b, 'output')


def _pure(node) -> dict:
  return nnx.to_pure_dict(node if isinstance(node, nnx.State) else nnx.state(node))


def _same_leaf(program: Program, a, b, what: str) -> None:
  if program.transform == 'eval_shape':
    assert (tuple(a.shape), a.dtype) == (tuple(np.shape(b)), jnp.result_type(b)), f'{what}: {a} vs {b}'
    return
  assert isinstance(a, jax.Array), f'{what} is a {type(a).__name__}, not a jax Array'
  if jnp.issubdtype(a.dtype, jax.dtypes.prng_key):
    a, b = jax.random.key_data(a), jax.random.key_data(b)
  assert np.shape(a) == np.shape(b), f'{what}: shape {np.shape(a)} != {np.shape(b)}'
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5, err_msg=what)


def assert_same_state(program: Program, got: dict, want: dict) -> None:
  assert sorted(got, key=str) == sorted(want, key=str), f'Variables {sorted(got, key=str)} != {sorted(want, key=str)}'
  for path, (kind, value) in want.items():
    got_kind, got_value = got[path]
    assert got_kind is kind, f'{path}: {got_kind.__name__} != {kind.__name__}'
    assert jax.tree.structure(got_value) == jax.tree.structure(value), f'{path}: {got_value} != {value}'
    for a, b in zip(jax.tree.leaves(got_value), jax.tree.leaves(value), strict=True):
      _same_leaf(dataclasses.replace(program, transform='jit'), a, b, f'Variable {path}')


def check(program: Program) -> None:
  """Run ``program`` under brainnx and its oracle; any difference is an ``AssertionError``."""
  GSCALE[...] = jnp.full(3, 1.5)
  wa, wb = World(program, oracle=False), World(program, oracle=True)
  ours = build_ours(program, wa)
  x = _inputs(program)
  error = expected_error(program)
  for k, edit in enumerate((None,) + program.edits):
    if edit in WORLD_EDITS:
      wa.rebind(program)
      wb.rebind(program)
    elif edit is not None:
      EDITS[edit](wa.model, wa.G, k)
      if edit not in SHARED_EDITS:
        EDITS[edit](wb.model, wb.G, k)
    before = wa.state()
    if error is not None:
      try:
        ours(x)
      except error:
        assert_same_state(program, wa.state(), before)  # rolled back exactly
        continue
      raise AssertionError(f'expected {error.__name__}')
    got = ours(x)
    if program.transform == 'eval_shape':  # computes nothing: the oracle's writes are undone
      saved = [(v, v.get_raw_value()) for _, v in nnx.iter_graph([wb.model, wb.G]) if isinstance(v, nnx.Variable)]
      want = run_oracle(program, wb, x)
      for v, value in saved:
        v.set_raw_value(value)
      assert_same_output(program, got, want, wa, wb)
      assert_same_state(program, wa.state(), before)
      continue
    want = run_oracle(program, wb, x)
    if program.transform in DERIVATIVES and program.transform not in ('jvp', 'vjp'):
      want = want[1]
    if reaches_model(program):  # documented: a mapped call advances every stream it reaches once
      for _, node in nnx.iter_graph(wb.model):
        if isinstance(node, nnx.RngStream):
          node.count[...] += mapped_calls(program)
    assert_same_output(program, got, want, wa, wb)
    assert_same_state(program, wa.state(), wb.state())
