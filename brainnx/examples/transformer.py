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
Either decodes byte by byte with a key/value cache (``nnx.Cache`` Variables stacked like the
blocks): :func:`generate` (one ``bnx.jit`` call per byte, or one compiled loop) and
:func:`generate_flax` draw the same bytes as a pure-jax decode that recomputes the whole
sequence. Run ``python -m brainnx.examples.transformer --help`` for the command line (also the
many-process run, ``--distributed``, and ``--generate``: train, then print what the model writes).

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
import time
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
  'flax_train_step', 'generate', 'generate_flax', 'make_mesh', 'partition_spec', 'place_batch', 'sample',
  'state_rules', 'text', 'to_host', 'train', 'train_step',
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

  def _qkv(self, x):
    b, s, w = x.shape
    return (t.reshape(b, s, self.heads, w // self.heads) for t in jnp.split(self.qkv(self.ln1(x)), 3, axis=-1))

  def _attend(self, x, q, k, v, visible, deterministic: bool):
    """The residual block after the projections: ``q`` attends to ``k``/``v`` where ``visible``."""
    b, s, w = x.shape
    scores = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(w // self.heads)
    scores = jnp.where(visible, scores, jnp.finfo(scores.dtype).min)
    attended = jnp.einsum('bhqk,bkhd->bqhd', jax.nn.softmax(scores, axis=-1), v).reshape(b, s, w)
    x = x + self.dropout(self.proj(attended), deterministic=deterministic)
    mlp = self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x))))
    return x + self.dropout(mlp, deterministic=deterministic)

  def __call__(self, x, deterministic: bool = False):
    s = x.shape[1]
    q, k, v = self._qkv(x)
    return self._attend(x, q, k, v, jnp.tril(jnp.ones((s, s), bool)), deterministic)

  def decode(self, x, index):
    """One position ``x`` of shape ``(batch, 1, width)`` at ``index``: its keys and values go into
    the cache (:meth:`GPT.init_cache`) and it attends to every cached position up to its own."""
    q, k, v = self._qkv(x)
    self.cache_k[...] = jax.lax.dynamic_update_slice_in_dim(self.cache_k[...], k, index, axis=1)
    self.cache_v[...] = jax.lax.dynamic_update_slice_in_dim(self.cache_v[...], v, index, axis=1)
    visible = jnp.arange(self.cache_k.shape[1]) <= index
    return self._attend(x, q, self.cache_k[...], self.cache_v[...], visible, deterministic=True)


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

  def init_cache(self, batch: int, length: int) -> None:
    """Empty key/value caches (``nnx.Cache``, one per layer, stacked like the blocks) for decoding
    ``length`` positions of ``batch`` sequences, and the position counter."""
    cfg = self.cfg
    if length > cfg.seq:
      raise ValueError(f'init_cache: {length} positions, but the model has position embeddings for {cfg.seq}')
    shape = (cfg.layers, batch, length, cfg.heads, cfg.width // cfg.heads)
    self.blocks.cache_k = nnx.Cache(jnp.zeros(shape))
    self.blocks.cache_v = nnx.Cache(jnp.zeros(shape))
    self.cache_index = nnx.Cache(jnp.zeros((), jnp.int32))

  def decode_step(self, tokens):
    """Feed one token per sequence (shape ``(batch,)``) at the cache's position; returns the next
    byte's logits ``(batch, vocab)`` and advances the position."""
    index = self.cache_index[...]
    x = self.token(tokens[:, None]) + self.pos(index[None])
    x = self._decode(x, index)
    self.cache_index[...] = index + 1
    return self.head(self.ln_f(x))[:, 0]


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

  def _decode(self, x, index):
    blocks = self.blocks
    return bnx.scan(lambda h, _: (blocks.decode(h, index), None), x, None, state_in_axes={0: ...})[0]


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

  def _decode(self, x, index):
    @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
    def run(block, h, index):
      return block.decode(h, index)

    return run(self.blocks, x, index)


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
  over; ``sharded`` lays their state out by :func:`state_rules` (call it under ``jax.set_mesh``);
  ``donate=False`` donates nothing, on an accelerator too."""
  def step(x, y):
    loss, grads = bnx.value_and_grad(lambda m: cross_entropy(m(x, deterministic), y), argnums=0)(model)
    opt.update(model, grads)
    return loss

  return bnx.jit(step, donate_states=bool(donate), state_shardings=state_rules() if sharded else None)


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


# -- decoding ------------------------------------------------------------------------


def sample(logits, key, temperature: float):
  """The next bytes: the ``argmax`` at ``temperature == 0``, else a draw from
  ``softmax(logits / temperature)`` with ``key``."""
  if temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  return jax.random.categorical(key, logits / temperature).astype(jnp.int32)


def generate(model: GPT, prompt, n: int, rngs: nnx.Rngs, *, temperature: float = 1.0,
             compiled: bool = False) -> np.ndarray:
  """``n`` bytes after ``prompt`` (ints ``(batch, p)``), drawn with ``rngs.sample``: ``(batch, n)``.

  The prompt goes through the key/value cache one position at a time, then each new byte is
  sampled and fed back. By default each position is one call of a ``bnx.jit``-ted step that
  reads and writes the caches, the position and the ``sample`` stream (the host-bound regime of
  serving); ``compiled=True`` runs the whole decode as one ``bnx.jit`` of a ``bnx.for_loop`` over
  the prompt and a ``bnx.scan`` over the new bytes. Both draw the same keys and return the same
  bytes (``tests/test_transformer.py``, against flax and a pure-jax decode without a cache).
  """
  prompt = jnp.asarray(prompt, jnp.int32)
  batch, p = prompt.shape
  if n < 1 or p < 1:
    raise ValueError(f'generate: a prompt of at least 1 byte and n >= 1, got {p} and {n}')
  model.init_cache(batch, p + n)

  def next_byte(token):
    return sample(model.decode_step(token), rngs.sample(), temperature)

  if compiled:
    # the loops run over positions: the stacked layers' parameters (and their unused dropout
    # streams) are read whole at every step; the caches, the position and the sample stream are
    # carried, each step writes them
    whole = {None: (nnx.Param, nnx.All(nnx.RngState, nnx.PathContains('dropout')))}

    @bnx.jit
    def run(prompt):
      if p > 1:
        bnx.for_loop(model.decode_step, prompt[:, :-1].T, state_in_axes=whole)
      first = next_byte(prompt[:, -1])
      if n == 1:
        return first[:, None]
      _, rest = bnx.scan(lambda token, _: (next_byte(token),) * 2, first, None, length=n - 1,
                         state_in_axes=whole)
      return jnp.concatenate([first[None], rest]).T

    return np.asarray(run(prompt))
  return _byte_by_byte(bnx.jit(model.decode_step), bnx.jit(next_byte), prompt, n)


def _byte_by_byte(feed, step, prompt, n: int) -> np.ndarray:
  """The host loop of a decode: ``feed`` every prompt byte but the last, then ``step`` (feed a
  byte, sample the next) from the last prompt byte on, ``n`` times: ``(batch, n)``."""
  for t in range(prompt.shape[1] - 1):
    feed(prompt[:, t])
  tokens = [step(prompt[:, -1])]
  for _ in range(n - 1):
    tokens.append(step(tokens[-1]))
  return np.asarray(jnp.stack(tokens, axis=1))


def generate_flax(model: FlaxGPT, prompt, n: int, rngs: nnx.Rngs, *, temperature: float = 1.0) -> np.ndarray:
  """:func:`generate` the flax way: ``nnx.jit`` steps that take the model and the streams."""
  prompt = jnp.asarray(prompt, jnp.int32)
  batch, p = prompt.shape
  model.init_cache(batch, p + n)
  feed = nnx.jit(lambda model, token: model.decode_step(token))
  step = nnx.jit(lambda model, rngs, token: sample(model.decode_step(token), rngs.sample(), temperature))
  return _byte_by_byte(lambda token: feed(model, token), lambda token: step(model, rngs, token), prompt, n)


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
  parser.add_argument('--steps', type=int, default=None, help='training steps (default 20; 400 with --generate)')
  parser.add_argument('--idiom', choices=('brainnx', 'flax'), default='brainnx')
  parser.add_argument('--devices', type=int, default=None, help='a (data, model) mesh over this many devices')
  parser.add_argument('--build', choices=('inside', 'outside', 'both'), default='inside',
                      help='build the brainnx model inside jax.set_mesh, before it, or train once each way')
  parser.add_argument('--deterministic', action='store_true', help='no dropout')
  parser.add_argument('--size', type=int, nargs=4, metavar=('LAYERS', 'WIDTH', 'SEQ', 'BATCH'), default=None,
                      help='a smaller or larger model than the default 4 128 64 8')
  parser.add_argument('--save', default=None, help='write losses and parameters here (process 0)')
  parser.add_argument('--generate', type=int, nargs='?', const=48, default=None, metavar='N',
                      help='after training, print N bytes (default 48) the model writes after a prompt taken '
                           'from the text, one bnx.jit call per byte')
  parser.add_argument('--temperature', type=float, default=0.7, help='sampling temperature of --generate (0: greedy)')
  parser.add_argument('--distributed', metavar='HOST:PORT', default=None,
                      help='one process of a jax.distributed job whose coordinator listens at HOST:PORT')
  parser.add_argument('--num-processes', type=int, default=None)
  parser.add_argument('--process-id', type=int, default=None)
  args = parser.parse_args(argv)
  if args.steps is None:
    args.steps = 20 if args.generate is None else 400
  if args.generate is not None and args.distributed is not None:
    parser.error('--generate runs in one process: leave out --distributed')
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
  if args.generate is not None:
    with jax.set_mesh(result['mesh']) if result['mesh'] is not None else _nothing():
      _print_generated(result['model'], cfg, args, parser)
  return result


def _print_generated(model: GPT, cfg: Config, args, parser) -> None:
  data = text().tobytes()
  start = max(data.find(b'brainnx brings'), 0)
  prompt = np.frombuffer(data[start:start + 14], np.uint8).astype(np.int32)[None]
  if prompt.shape[1] + args.generate > cfg.seq:
    parser.error(f'--generate {args.generate}: the 14-byte prompt and the new bytes must fit the model\'s '
                 f'{cfg.seq} positions (at most --generate {cfg.seq - prompt.shape[1]})')
  rngs = nnx.Rngs(sample=0)
  begin = time.perf_counter()
  new = generate(model, prompt, args.generate, rngs, temperature=args.temperature)
  seconds = time.perf_counter() - begin
  as_text = lambda b: bytes(np.asarray(b, np.uint8)).decode('utf-8', errors='replace')  # noqa: E731
  print(f'generated after {args.steps} steps (temperature {args.temperature:g}, '
        f'{1e3 * seconds / (prompt.shape[1] + args.generate):.1f} ms a byte, compile included):')
  print(f'{as_text(prompt[0])}|{as_text(new[0])}')


if __name__ == '__main__':
  main()
