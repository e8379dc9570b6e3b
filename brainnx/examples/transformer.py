"""A small decoder-only byte-level transformer, trained sharded: the brainnx way and the flax way.

The model is ordinary ``nnx`` modules: token and position embeddings, pre-norm blocks (causal
multi-head attention and an MLP, dropout on both residual branches) and a head, on the bytes of
this repository's own LICENSE and README. Its ``layers`` blocks are one stacked module:

* :class:`GPT` (brainnx): built by ``bnx.vmap(lambda: Block(cfg, rngs), axis_size=L)()`` and run
  by ``bnx.scan(..., state_in_axes={0: ...})`` over ``bnx.remat`` of the block; laid out over a
  ``('data', 'model')`` mesh by ``bnx.jit(state_shardings=state_rules())`` (parameters and optimizer
  state alike), stepped by a donated ``bnx.jit`` with ``optax.adamw``.
* :class:`FlaxGPT` (flax): the same blocks built by ``nnx.split_rngs`` + ``nnx.vmap`` and run by
  ``nnx.scan`` over ``nnx.remat``; laid out by ``nnx.with_partitioning`` metadata under
  ``jax.set_mesh``, stepped by a donated ``nnx.jit``.

Both start from the same keys and compute the same numbers (``tests/test_transformer.py``).
Run ``python -m brainnx.examples.transformer --help`` for the command line (also the many-process
run, ``--distributed``).

Example:
  >>> from brainnx.examples import transformer as tf
  >>> cfg = tf.Config(layers=2, width=32, heads=2, seq=16, batch=2)
  >>> model, opt = tf.build(cfg, seed=0)
  >>> step = tf.train_step(model, opt)
  >>> x, y = tf.batch(tf.text(), cfg, 0)
  >>> first = float(step(x, y))
  >>> 5.0 < first < 6.5   # about log(256): bytes, not yet learnt
  True
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import brainnx as bnx

__all__ = [
  'Block', 'Config', 'FlaxGPT', 'GPT', 'PARTITIONS', 'batch', 'build', 'build_flax', 'cross_entropy',
  'flax_train_step', 'make_mesh', 'partition_spec', 'place_batch', 'state_rules', 'text', 'to_host',
  'train', 'train_step',
]


@dataclasses.dataclass(frozen=True)
class Config:
  """Sizes and training settings (the defaults: 4 layers of width 128 on 64-byte windows)."""

  layers: int = 4
  width: int = 128
  heads: int = 4
  seq: int = 64
  batch: int = 8
  vocab: int = 256
  mlp_ratio: int = 4
  dropout: float = 0.1
  lr: float = 1e-3
  remat: bool = True


# Mesh axes of each kernel / embedding, by the attribute that holds it: 2-D over ('data', 'model')
# (each matrix split both ways, FSDP over 'data' and tensor-parallel over 'model'); biases and
# norms replicated. A stacked block's Variables have the layer axis first, unsplit.
PARTITIONS = {
  'token': ('data', 'model'), 'pos': (None, 'model'), 'head': ('data', 'model'),
  'qkv': ('data', 'model'), 'proj': ('model', 'data'), 'mlp_in': ('data', 'model'), 'mlp_out': ('model', 'data'),
}
_SPLIT_LEAVES = ('kernel', 'embedding')


def partition_spec(path) -> P | None:
  """The intended ``PartitionSpec`` of the Variable at ``path`` (a parameter or its optimizer
  state: the path ends in the parameter's own), ``None`` for replicated ones."""
  names = tuple(path)
  if not names or names[-1] not in _SPLIT_LEAVES:
    return None
  owner = next((n for n in reversed(names[:-1]) if isinstance(n, str) and n in PARTITIONS), None)
  if owner is None:
    return None
  axes = PARTITIONS[owner]
  return P(None, *axes) if 'blocks' in names else P(*axes)


def state_rules() -> dict:
  """``state_shardings`` for :func:`train_step`: one rule per distinct spec of :data:`PARTITIONS`,
  then every other Variable replicated (``P()``)."""
  specs = {P(*a) for a in PARTITIONS.values()} | {P(None, *a) for a in PARTITIONS.values()}
  rules = {spec: (lambda path, v, spec=spec: partition_spec(path) == spec) for spec in sorted(specs, key=str)}
  rules[P()] = ...
  return rules


def _init(name: str, partitioned: bool, base=None):
  base = base or nnx.initializers.lecun_normal()
  return nnx.with_partitioning(base, PARTITIONS[name]) if partitioned else base


class Block(nnx.Module):
  """Pre-norm causal self-attention then MLP, each a residual branch with dropout."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs, partitioned: bool = False):
    w, hidden = cfg.width, cfg.mlp_ratio * cfg.width
    dense = lambda name, i, o: nnx.Linear(i, o, kernel_init=_init(name, partitioned), rngs=rngs)  # noqa: E731
    self.ln1 = nnx.LayerNorm(w, rngs=rngs)
    self.qkv = dense('qkv', w, 3 * w)
    self.proj = dense('proj', w, w)
    self.ln2 = nnx.LayerNorm(w, rngs=rngs)
    self.mlp_in = dense('mlp_in', w, hidden)
    self.mlp_out = dense('mlp_out', hidden, w)
    self.dropout = nnx.Dropout(cfg.dropout, rngs=rngs)
    self.heads = cfg.heads

  def __call__(self, x, deterministic: bool = False):
    b, s, w = x.shape
    q, k, v = (t.reshape(b, s, self.heads, w // self.heads) for t in jnp.split(self.qkv(self.ln1(x)), 3, axis=-1))
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(w // self.heads)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, jnp.finfo(scores.dtype).min)
    attended = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(scores, axis=-1), v).reshape(b, s, w)
    x = x + self.dropout(self.proj(attended), deterministic=deterministic)
    mlp = self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x))))
    return x + self.dropout(mlp, deterministic=deterministic)


class _Decoder(nnx.Module):
  """Embeddings, the stacked blocks (built and run by the subclass's idiom), final norm, head."""

  def __init__(self, cfg: Config, rngs: nnx.Rngs, partitioned: bool = False):
    self.cfg, self.partitioned = cfg, partitioned
    embed_init = nnx.initializers.normal(0.02)
    self.token = nnx.Embed(cfg.vocab, cfg.width, embedding_init=_init('token', partitioned, embed_init), rngs=rngs)
    self.pos = nnx.Embed(cfg.seq, cfg.width, embedding_init=_init('pos', partitioned, embed_init), rngs=rngs)
    # fresh streams (count 0) for the stack: then bnx.vmap's per-layer keys are nnx.split_rngs'
    self.blocks = self._stack(rngs.fork())
    self.ln_f = nnx.LayerNorm(cfg.width, rngs=rngs)
    self.head = nnx.Linear(cfg.width, cfg.vocab, kernel_init=_init('head', partitioned), rngs=rngs)

  def __call__(self, tokens, deterministic: bool = False):
    x = self.token(tokens) + self.pos(jnp.arange(tokens.shape[1]))
    return self.head(self.ln_f(self._run(x, deterministic)))


class GPT(_Decoder):
  """The brainnx idioms: ``bnx.vmap`` builds the stack, ``bnx.scan`` over ``bnx.remat`` runs it."""

  def _stack(self, rngs):
    cfg = self.cfg
    return bnx.vmap(lambda: Block(cfg, rngs, self.partitioned), axis_size=cfg.layers)()

  def _run(self, x, deterministic):
    blocks = self.blocks
    layer = lambda h: blocks(h, deterministic)  # noqa: E731
    if self.cfg.remat:
      layer = bnx.remat(layer)
    return bnx.scan(lambda h, _: (layer(h), None), x, None, state_in_axes={0: ...})[0]


class FlaxGPT(_Decoder):
  """The flax idioms: ``nnx.split_rngs`` + ``nnx.vmap`` build the stack, ``nnx.scan`` over
  ``nnx.remat`` runs it (the partition metadata gets the layer axis from ``transform_metadata``)."""

  def _stack(self, rngs):
    cfg, partitioned = self.cfg, self.partitioned

    @nnx.split_rngs(splits=cfg.layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make(r):
      return Block(cfg, r, partitioned)

    return make(rngs)

  def _run(self, x, deterministic):
    def layer(block, h):
      return block(h, deterministic)

    if self.cfg.remat:
      layer = nnx.remat(layer)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: None})
    def run(block, h):
      return layer(block, h)

    return run(self.blocks, x)


def _rngs(seed: int) -> nnx.Rngs:
  return nnx.Rngs(params=seed, dropout=seed + 1)


def build(cfg: Config, seed: int = 0) -> tuple[GPT, nnx.Optimizer]:
  """The brainnx model and its ``optax.adamw`` optimizer (laid out by :func:`train_step`)."""
  model = GPT(cfg, _rngs(seed))
  return model, nnx.Optimizer(model, optax.adamw(cfg.lr), wrt=nnx.Param)


def build_flax(cfg: Config, seed: int = 0, mesh=None) -> tuple[FlaxGPT, nnx.Optimizer]:
  """The flax model and optimizer; with ``mesh``, created under it with partition metadata, so
  flax lays every parameter and optimizer state out as :data:`PARTITIONS` says."""
  if mesh is None:
    model = FlaxGPT(cfg, _rngs(seed))
    return model, nnx.Optimizer(model, optax.adamw(cfg.lr), wrt=nnx.Param)
  with jax.set_mesh(mesh):
    model = FlaxGPT(cfg, _rngs(seed), partitioned=True)
    return model, nnx.Optimizer(model, optax.adamw(cfg.lr), wrt=nnx.Param)


def cross_entropy(logits, targets):
  """Mean next-byte cross-entropy."""
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def train_step(model: GPT, opt: nnx.Optimizer, *, sharded: bool = False, donate: bool = True,
               deterministic: bool = False):
  """``step(x, y) -> loss``: one adamw step, a ``bnx.jit`` over the model and optimizer it closes
  over; ``sharded`` lays their state out by :func:`state_rules` (call it under ``jax.set_mesh``)."""
  def step(x, y):
    loss, grads = bnx.value_and_grad(lambda m: cross_entropy(m(x, deterministic), y), argnums=0)(model)
    opt.update(model, grads)
    return loss

  return bnx.jit(step, donate_states=True if donate else None, state_shardings=state_rules() if sharded else None)


def flax_train_step(*, donate: bool = True, deterministic: bool = False):
  """``step(model, opt, x, y) -> loss``, the flax way: ``nnx.jit`` (donated) of ``nnx.value_and_grad``."""
  def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: cross_entropy(m(x, deterministic), y))(model)
    opt.update(model, grads)
    if jax.sharding.get_abstract_mesh().shape:  # keep the metadata's layout (replicated where none)
      state = nnx.state((model, opt))
      nnx.update((model, opt), jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
    return loss

  return nnx.jit(step, donate_argnums=(0, 1) if donate else ())


# -- data and meshes ---------------------------------------------------------------


def text() -> np.ndarray:
  """The bytes of this repository's LICENSE and README (a fixed text when they are not there)."""
  root = Path(__file__).resolve().parents[2]
  parts = [p.read_bytes() for p in (root / 'LICENSE', root / 'README.md') if p.exists()]
  data = b'\n'.join(parts) or (b'brainnx brings stateful transforms to flax nnx. ' * 200)
  return np.frombuffer(data, np.uint8)


def batch(data: np.ndarray, cfg: Config, step: int) -> tuple[np.ndarray, np.ndarray]:
  """Step ``step``'s windows: ``cfg.batch`` random ``cfg.seq``-byte inputs and their next bytes
  (numpy, the same in every process)."""
  starts = np.random.default_rng(step).integers(0, len(data) - cfg.seq - 1, cfg.batch)
  windows = np.stack([data[s:s + cfg.seq + 1] for s in starts]).astype(np.int32)
  return windows[:, :-1], windows[:, 1:]


def make_mesh(devices: int | None = None):
  """A ``('data', 'model')`` mesh, 2 x devices/2 (``(1, 1)`` on one device), automatic axes."""
  found = jax.devices()[: devices or jax.device_count()]
  data = 2 if len(found) % 2 == 0 else 1
  return jax.make_mesh((data, len(found) // data), ('data', 'model'), axis_types=(AxisType.Auto,) * 2, devices=found)


def place_batch(mesh, *arrays):
  """Host arrays split over ``'data'`` (each process supplies its own devices' rows)."""
  sharding = NamedSharding(mesh, P('data'))
  return tuple(jax.make_array_from_callback(a.shape, sharding, lambda i, a=a: a[i]) for a in arrays)


def to_host(x) -> np.ndarray:
  """A numpy copy of ``x`` (a key: its data), gathered from every process when it spans several."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if getattr(x, 'is_fully_addressable', True):
    return np.asarray(x)
  from jax.experimental import multihost_utils

  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def flat_state(node) -> dict:
  """``{'blocks/qkv/kernel': Variable, ...}`` for every Variable of ``node``."""
  return {'/'.join(map(str, path)): v for path, v in nnx.to_flat_state(nnx.state(node))}


# -- one training run ----------------------------------------------------------------


def train(cfg: Config, steps: int, *, idiom: str = 'brainnx', devices: int | None = None,
          build_outside_mesh: bool = False, deterministic: bool = False, seed: int = 0) -> dict:
  """Train for ``steps`` steps; ``devices=None``: one device, no mesh.

  Returns ``losses`` (numpy), ``model`` and ``opt`` (the trained objects) and ``mesh``.
  ``build_outside_mesh`` (brainnx only): build before entering ``jax.set_mesh`` and let the
  first sharded step lay the state out.
  """
  data = text()
  mesh = None if devices is None else make_mesh(devices)
  losses = []
  if idiom == 'flax':
    model, opt = build_flax(cfg, seed, mesh)
    step = flax_train_step(deterministic=deterministic)
    with jax.set_mesh(mesh) if mesh is not None else _nothing():
      for i in range(steps):
        x, y = batch(data, cfg, i)
        if mesh is not None:
          x, y = place_batch(mesh, x, y)
        losses.append(step(model, opt, x, y))
  elif idiom == 'brainnx':
    if build_outside_mesh or mesh is None:
      model, opt = build(cfg, seed)
    with jax.set_mesh(mesh) if mesh is not None else _nothing():
      if not build_outside_mesh and mesh is not None:
        model, opt = build(cfg, seed)
      step = train_step(model, opt, sharded=mesh is not None, deterministic=deterministic)
      for i in range(steps):
        x, y = batch(data, cfg, i)
        if mesh is not None:
          x, y = place_batch(mesh, x, y)
        losses.append(step(x, y))
  else:
    raise ValueError(f"idiom must be 'brainnx' or 'flax', got {idiom!r}")
  losses = np.array([float(np.asarray(loss.addressable_data(0))) for loss in losses])
  return {'losses': losses, 'model': model, 'opt': opt, 'mesh': mesh}


class _nothing:
  def __enter__(self):
    return None

  def __exit__(self, *exc):
    return False


# -- command line --------------------------------------------------------------------


def main(argv=None) -> dict:
  """Train and print the losses; ``--save`` writes them and the parameters (``.npz``)."""
  parser = argparse.ArgumentParser(prog='python -m brainnx.examples.transformer', description=__doc__.split('\n')[0])
  parser.add_argument('--steps', type=int, default=20)
  parser.add_argument('--idiom', choices=('brainnx', 'flax'), default='brainnx')
  parser.add_argument('--devices', type=int, default=None, help='a (data, model) mesh over this many devices')
  parser.add_argument('--build', choices=('inside', 'outside', 'both'), default='inside',
                      help='build the brainnx model inside jax.set_mesh, before it, or train once each way')
  parser.add_argument('--deterministic', action='store_true', help='no dropout')
  parser.add_argument('--size', type=int, nargs=4, metavar=('LAYERS', 'WIDTH', 'SEQ', 'BATCH'), default=None,
                      help='a smaller or larger model than the default 4 128 64 8')
  parser.add_argument('--save', default=None, help='write losses and parameters here (process 0)')
  parser.add_argument('--distributed', metavar='HOST:PORT', default=None,
                      help='one process of a jax.distributed job whose coordinator listens at HOST:PORT')
  parser.add_argument('--num-processes', type=int, default=None)
  parser.add_argument('--process-id', type=int, default=None)
  args = parser.parse_args(argv)
  if args.distributed is not None:
    if args.num_processes is None or args.process_id is None:
      parser.error('--distributed needs --num-processes and --process-id')
    if jax.config.jax_platforms in (None, '', 'cpu'):
      jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(args.distributed, num_processes=args.num_processes, process_id=args.process_id)
    args.devices = args.devices or jax.device_count()
  orders = ('inside', 'outside') if args.build == 'both' else (args.build,)
  saved = {}
  for order in orders:
    cfg = Config() if args.size is None else Config(*args.size[:2], heads=2, seq=args.size[2], batch=args.size[3])
    result = train(cfg, args.steps, idiom=args.idiom, devices=args.devices,
                   build_outside_mesh=order == 'outside', deterministic=args.deterministic)
    prefix = f'{order}/' if len(orders) > 1 else ''
    saved[prefix + 'losses'] = result['losses']
    saved.update({prefix + k: to_host(v.get_value()) for k, v in flat_state(result['model']).items()})
    if jax.process_index() == 0:
      print(f'{args.idiom} (built {order} the mesh) on {jax.device_count()} device(s) in '
            f'{jax.process_count()} process(es): loss {result["losses"][0]:.4f} -> {result["losses"][-1]:.4f}')
  if jax.process_index() == 0 and args.save:
    np.savez(args.save, **saved)
  return result


if __name__ == '__main__':
  main()
