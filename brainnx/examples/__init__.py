"""Worked examples that tests and benchmarks import (``brainnx.examples.transformer``)."""
