"""The main job: ``python -m brainnx.demo`` (not implemented yet)."""

if __name__ == '__main__':
  print('brainnx.demo: not yet (the ensemble-training demo lands with the grad/optax issue)')
