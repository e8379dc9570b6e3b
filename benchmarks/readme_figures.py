"""Where each figure README.md states comes from, in the order the README states them.

Each entry is ``(figure as written, results file, heading it sits under (a prefix), row label,
column header[, which of the columns so named, from 1])``: ``benchmarks/check_readme.py`` finds that cell in that stamped table and
requires it to hold exactly the figure. A figure added to the README, removed from it, moved, or
edited without its table fails the check. ``NOT_MEASURED`` lists what looks like a figure but
states no measurement.
"""

DEMO = ('demo_resources.md', 'Demo and property tests')
SEEDS = ('figure1_seeds.md', 'The four panels at the default flags')
COVERAGE = ('figure1_seeds.md', 'Coverage of x³ on [-6, 6], seed by seed')
OVERHEAD_2 = ('overhead.md', '2-layer MLP 32x32, batch 16')
OVERHEAD_100 = ('overhead.md', '100-layer stack, 10 rounds')
FRAMES = ('frames.md', 'Python frames per warm call')
GRAPH_WARM = ('object_graph.md', 'Warm call')
GRAPH_NEW = ('object_graph.md', 'Creates and returns')
GRAPH_ATTACH = ('object_graph.md', 'Attaches an nnx.Intermediate')
TRANSFORMER = ('transformer.md', 'min–max over 3 runs')
MANY = ('many_variables.md', 'Per call against the number of Variables')
DECODE = ('many_variables.md', 'One decode step')
BETWEEN_800 = ('many_variables.md', 'Other code between calls, 800 Variables')
BETWEEN_8000 = ('many_variables.md', 'Other code between calls, 8,000 Variables')
FIRST = ('first_call.md', 'First call (trace + compile)')
TAX = ('import_tax.md', 'flax-only workloads')
DONATION = ('donation.md', 'Donated training step')
CHECKPOINTED = ('checkpoint_memory.md', 'tanh RNN')
TPU_LOOP = ('accelerator_tpu.md', "The demo's training loop")
TPU_ENSEMBLE = ('accelerator_tpu.md', 'Ensemble adam step')
TPU_TRANSFORMER = ('accelerator_tpu.md', "The example transformer's training step")

LEDGER = [
  # the main job
  ('10.0 s', *DEMO, 'demo, default flags', 'wall (s)'),
  ('1.17x', *SEEDS, '(iv) Ensemble of 5 (NLL + adversarial)', 'left: min'),
  ('0.80x', *SEEDS, '(iv) Ensemble of 5 (NLL + adversarial)', 'right: min'),
  ('3.10x', *SEEDS, '(iv) Ensemble of 5 (NLL + adversarial)', 'left: median'),
  ('3.53x', *SEEDS, '(iv) Ensemble of 5 (NLL + adversarial)', 'right: median'),
  ('80%', *SEEDS, '(iv) Ensemble of 5 (NLL + adversarial)', 'x³ within ± 3 std (median share of [-6, 6])'),
  ('73%', *COVERAGE, '(iv) Ensemble of 5 (NLL + adversarial)', 'default: min'),
  ('20%', *SEEDS, '(i) Ensemble of 5 (MSE)', 'x³ within ± 3 std (median share of [-6, 6])'),
  ('73%', *COVERAGE, '(iv) Ensemble of 5 (NLL + adversarial)', '[-1, 1]: median'),
  ('63%', *COVERAGE, '(iv) Ensemble of 5 (NLL + adversarial)', '[-1, 1]: min'),
  ('58%', *COVERAGE, '(ii) One network (NLL)', 'default: median'),
  ('66%', *COVERAGE, '(iii) One network (NLL + adversarial)', 'default: median'),
  ('65%', *COVERAGE, '(ii) One network (NLL)', '[-1, 1]: median'),
  ('67%', *COVERAGE, '(iii) One network (NLL + adversarial)', '[-1, 1]: median'),
  ('385 MB', *DEMO, 'demo, --steps 20000', 'peak RSS (MB)'),
  ('453 MB', *DEMO, 'demo, --steps 20000 --checkpoint-every 100', 'peak RSS (MB)'),
  ('436 MB', *DEMO, 'demo, --steps 40000 --checkpoint-every 100', 'peak RSS (MB)'),
  ('68 MB', *DEMO, 'demo, --steps 20000 --checkpoint-every 100', 'RSS over the 20000-step run without checkpoints (MB)'),
  # Benchmarks
  ('96.0 MB', *DONATION, 'brainnx jit, donate_states=True', 'aliased (MB)'),
  ('0.0 MB', *DONATION, 'brainnx jit', 'aliased (MB)'),
  ('3.3 MB', *CHECKPOINTED, 'brainnx.checkpointed_scan', 'XLA temp (MB)'),
  ('1.8%', *CHECKPOINTED, 'brainnx.checkpointed_scan', 'temp vs jax.lax.scan'),
  ('187.8 MB', *CHECKPOINTED, 'jax.lax.scan', 'XLA temp (MB)'),
  ('9.6 µs', *OVERHEAD_2, 'brainnx.jit (closure)', 'µs (median)'),
  ('9.8 µs', *OVERHEAD_2, 'brainnx.jit (arg)', 'µs (median)'),
  ('7.6 µs', *OVERHEAD_2, 'raw jax.jit', 'µs (median)'),
  ('7.6 µs', *OVERHEAD_2, 'raw jax.jit, list of pairs', 'µs (median)'),
  ('323.2 µs', *OVERHEAD_2, 'nnx.jit', 'µs (median)'),
  ('124.0 µs', *OVERHEAD_2, 'nnx.cached_partial', 'µs (median)'),
  ('124.5 µs', *OVERHEAD_100, 'brainnx.jit (closure)', 'µs (median)'),
  ('126.3 µs', *OVERHEAD_100, 'brainnx.jit (arg)', 'µs (median)'),
  ('124.4 µs', *OVERHEAD_100, 'raw jax.jit', 'µs (median)'),
  ('10521.6 µs', *OVERHEAD_100, 'nnx.jit', 'µs (median)'),
  ('4 frames', *FRAMES, 'brainnx.jit', 'frames'),
  ('9 frames', *FRAMES, 'brainnx.vmap', 'frames'),
  ('757 frames', *FRAMES, 'nnx.jit', 'frames'),
  ('90 frames', *FRAMES, 'equinox.filter_jit', 'frames'),
  ('91 frames', *FRAMES, 'equinox.filter_jit(filter_vmap)', 'frames'),
  ('1 frame', *FRAMES, 'jax.jit, pure pytree', 'frames'),
  ('19.5 µs', *GRAPH_WARM, 'brainnx.jit', 'µs (median)'),
  ('20.3 µs', *GRAPH_WARM, 'raw jax.jit, flat', 'µs (median)'),
  ('65.0 µs', *GRAPH_NEW, 'brainnx.jit', 'µs (median)'),
  ('126.4 µs', *GRAPH_NEW, 'nnx.jit', 'µs (median)'),
  ('59.7 µs', *GRAPH_NEW, 'raw jax.jit + merge', 'µs (median)'),
  ('84.1 µs', *GRAPH_ATTACH, 'brainnx.jit', 'µs (median)'),
  ('653.3 µs', *GRAPH_ATTACH, 'nnx.jit', 'µs (median)'),
  ('1.09x', *MANY, '80', 'bnx.jit'),
  ('1.01x', *MANY, '800', 'bnx.jit'),
  ('1.05x', *MANY, '8,000', 'bnx.jit'),
  ('3.18x', *MANY, '80', 'jax.jit over nnx.State (split once)'),
  ('3.69x', *MANY, '800', 'jax.jit over nnx.State (split once)'),
  ('3.21x', *MANY, '8,000', 'jax.jit over nnx.State (split once)'),
  ('69.77x', *MANY, '80', 'nnx.jit'),
  ('72.22x', *MANY, '800', 'nnx.jit'),
  ('27.01x', *MANY, '8,000', 'nnx.jit'),
  ('1.03x', *DECODE, '4 (23 Variables)', 'bnx.jit'),
  ('0.98x', *DECODE, '32 (23 Variables)', 'bnx.jit'),
  ('3.64x', *DECODE, '4 (23 Variables)', 'nnx.jit'),
  ('1.53x', *DECODE, '32 (23 Variables)', 'nnx.jit'),
  ('0.96x', *BETWEEN_800, 'nothing', 'bnx / raw'),
  ('1.01x', *BETWEEN_800, 'set_value on one Variable', 'bnx / raw'),
  ('0.98x', *BETWEEN_800, 'nnx.state(model)', 'bnx / raw'),
  ('1.04x', *BETWEEN_800, 'nnx.update(model, state)', 'bnx / raw'),
  ('1.16x', *BETWEEN_800, 'an nnx.jit eval call on the model', 'bnx / raw'),
  ('1.01x', *BETWEEN_8000, 'nothing', 'bnx / raw'),
  ('1.00x', *BETWEEN_8000, 'set_value on one Variable', 'bnx / raw'),
  ('1.04x', *BETWEEN_8000, 'nnx.state(model)', 'bnx / raw'),
  ('1.01x', *BETWEEN_8000, 'nnx.update(model, state)', 'bnx / raw'),
  ('1.14x', *BETWEEN_8000, 'an nnx.jit eval call on the model', 'bnx / raw'),
  ('1.02x', *FIRST, '100', 'brainnx.jit (closure)'),
  ('1.08x', *FIRST, '500', 'brainnx.jit (closure)'),
  ('1.05x', *FIRST, '100', 'jax.jit over nnx.State (split once)'),
  ('1.26x', *FIRST, '500', 'jax.jit over nnx.State (split once)'),
  ('1.24x', *FIRST, '100', 'nnx.jit'),
  ('1.38x', *FIRST, '500', 'nnx.jit'),
  ('0.98x', *FIRST, '100', 'raw jax.jit, GC paused'),
  ('0.92x', *FIRST, '500', 'raw jax.jit, GC paused'),
  ('1.02x', *TAX, 'construct', 'ratio', 2),
  ('1.00x', *TAX, 'split/merge', 'ratio', 2),
  ('1.05x', *TAX, 'nnx.update', 'ratio', 2),
  ('1.02x', *TAX, 'nnx.jit step', 'ratio', 2),
  ('1.02x', *TAX, 'nnx.vmap step', 'ratio', 2),
  ('1.06x', *TAX, '1,000 writes', 'ratio', 2),
  ('46.0–46.9 ms', *TRANSFORMER, 'brainnx, remat, donated', 'step median (ms)'),
  ('47.7–49.6 ms', *TRANSFORMER, 'flax, remat, donated', 'step median (ms)'),
  ('45.4–46.4 ms', *TRANSFORMER, 'jax.jit, remat, donated', 'step median (ms)'),
  ('5.65 MB', *TRANSFORMER, 'brainnx, remat, donated', 'temp (MB)'),
  ('6.40 MB', *TRANSFORMER, 'flax, remat, donated', 'temp (MB)'),
  ('5.66 MB', *TRANSFORMER, 'jax.jit, remat, donated', 'temp (MB)'),
  ('1882–1942 ms', *TRANSFORMER, 'brainnx, remat, donated', 'compile (ms)'),
  ('2026–2050 ms', *TRANSFORMER, 'flax, remat, donated', 'compile (ms)'),
  ('122–127 ms', *TRANSFORMER, 'brainnx, remat, not donated', 'trace (ms)'),
  ('81–89 ms', *TRANSFORMER, 'flax, remat, not donated', 'trace (ms)'),
  ('71–79 ms', *TRANSFORMER, 'jax.jit, remat, not donated', 'trace (ms)'),
  ('374–389 ms', *TRANSFORMER, 'brainnx, remat, donated', 'trace (ms)'),
  # On an accelerator
  ('12.12 µs', *TPU_LOOP, 'brainnx (no bar)', 'µs per step'),
  ('12.05 µs', *TPU_LOOP, 'hand-written jax.jit(lax.scan)', 'µs per step'),
  ('18.25 µs', *TPU_LOOP, 'brainnx (the demo: with its bar)', 'µs per step'),
  ('17.59 µs', *TPU_LOOP, "hand-written, with a bar's 20 host calls", 'µs per step'),
  ('1.077x', *TPU_ENSEMBLE, '8 x (64-256-256-64), 256', 'brainnx default'),
  ('1.028x', *TPU_ENSEMBLE, '8 x (64-256-256-64), 256', 'brainnx donate_states=True'),
  ('2.174x', *TPU_ENSEMBLE, '8 x (64-256-256-64), 256', 'nnx.jit(nnx.vmap)'),
  ('1.385x', *TPU_ENSEMBLE, '8 x (64-256-256-64), 256', 'equinox filter_jit(filter_vmap)'),
  ('16.93 ms', *TPU_TRANSFORMER, 'brainnx', 'ms per step'),
  ('17.13 ms', *TPU_TRANSFORMER, 'flax (nnx.jit)', 'ms per step'),
  ('6.7%', *TPU_TRANSFORMER, 'brainnx', 'model FLOP utilisation'),
  ('6.6%', *TPU_TRANSFORMER, 'flax (nnx.jit)', 'model FLOP utilisation'),
  # Testing
  ('55 s', *DEMO, 'pytest tests/test_properties.py', 'CPU (s)'),
]

NOT_MEASURED = {
  '2×': 'a count of layers or the shape of a device mesh (2 × Linear, a 2 × 2 mesh)',
  '1%': "the paper's adversarial step, a setting: 1% of the range of x",
}
