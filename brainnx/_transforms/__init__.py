"""The public transforms, one family a module, each a thin layer over ``brainnx._engine``."""
