"""Rerun every benchmark and rewrite the stamped tables under benchmarks/results/, in one command.

    pip install -e ".[bench]" && python benchmarks/run_all.py            # every script, 3 runs each
    python benchmarks/run_all.py --runs 1 --quick                           # a smoke run
    python benchmarks/run_all.py --only donation mapping

Each run of each script is a fresh process. Scripts that write their own stamped table
(donation, mapping, overhead, checkpoint_memory, frames; transformer writes one run's, rewritten with every run's here; scaling and sharded_ensemble write theirs unstamped so far) do so; for those that print tables, the printed tables of every
run are written to ``results/<script>.md`` under one stamp naming that script, run by run, so
a README range is the min-max of the per-run medians, tabulated at the end of the file. Then ``check_readme.py`` lists any README
figure that no stamped table holds.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _results import ranges, write  # noqa: E402

# script -> (arguments, arguments for --quick, writes its own table). Every script of this folder
# is here: tests/test_benchmark_scripts.py runs each with its quick arguments (into a temporary
# folder, BRAINNX_RESULTS_DIR) and fails on a script missing from this table.
SCRIPTS = {
  'donation': ([], ['--rounds', '2', '--width', '256'], True),
  'mapping': ([], ['--rounds', '2', '--calls', '5'], True),
  'overhead': ([], ['--rounds', '2', '--calls', '5', '--deep', '8'], True),
  'object_graph': ([], ['--rounds', '2', '--calls', '5'], True),
  'demo_resources': ([], ['--long-steps', '200'], True),
  'layers': ([], ['--depths', '4', '--width', '16', '--trials', '1', '--rounds', '2', '--calls', '3'], False),
  'checkpoint_memory': ([], ['--length', '50', '--repeats', '1'], True),
  'ensemble_train': ([], ['--rounds', '2', '--calls', '3', '--sizes', 'small'], False),
  'sharded_ensemble': ([], ['--quick'], True),
  'scaling': ([], ['--quick'], True),
  'transformer': (['--rounds', '5', '--steps-per-round', '3'], ['--quick'], False),
  'brainstate_loops': ([], ['--rounds', '1'], True),
  'figure1_seeds': ([], ['--seeds', '1'], True),
  'many_variables': ([], ['--quick'], True),
  'first_call': ([], ['--rounds', '1', '--trials', '1', '--depths', '5'], True),
  'frames': ([], [], True),
  'import_tax': ([], ['--rounds', '1', '--reps', '2'], True),
  'memory': ([], ['--closures', '20', '--calls', '200'], False),
  'program_cost': ([], ['--quick'], True),
  'accelerator': ([], ['--quick', '--only', 'forward'], True),
  'differential_long': ([], ['--programs', '4', '--processes', '1'], True),
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--runs', type=int, default=3, help='fresh-process runs per script (default 3)')
  parser.add_argument('--quick', action='store_true', help="each script's smoke settings")
  parser.add_argument('--only', nargs='+', choices=sorted(SCRIPTS), default=sorted(SCRIPTS))
  args = parser.parse_args(argv)
  for name in args.only:
    full, quick, writes = SCRIPTS[name]
    outputs = []
    for run in range(args.runs):
      command = [sys.executable, str(HERE / f'{name}.py'), *(quick if args.quick else full)]
      print(f'[{name}] run {run + 1}/{args.runs}: {" ".join(command[1:])}', flush=True)
      done = subprocess.run(command, capture_output=True, text=True)
      if done.returncode:
        print(done.stdout[-2000:], done.stderr[-4000:], sep='\n')
        return done.returncode
      outputs.append(done.stdout)
    if not writes:
      body = '\n\n'.join(f'### run {k + 1} of {len(outputs)}\n\n{out.strip()}' for k, out in enumerate(outputs))
      if len(outputs) > 1:
        body += '\n\n' + ranges(outputs)
      print('wrote', write(f'{name}.md', f'{name}.py', body))
  return subprocess.run([sys.executable, str(HERE / 'check_readme.py')]).returncode


if __name__ == '__main__':
  sys.exit(main())
