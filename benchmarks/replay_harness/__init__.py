"""The parts of `benchmarks/replay_vs_grpo.py`, the command line that runs them:

- `presets`: the methods, by name (the config fields each sets);
- `runs`: one training run of a method on a seed of a testbed, measured as it trains, and the record of how it was made;
- `results_file`: `results.json`'s schema, and reading, validating, writing and merging it;
- `statistics`: every figure of the report, per seed (pure functions of the results);
- `report`: the markdown tables and notes; `plots`: the plots.

The testbeds are in `benchmarks/replay_testbeds`.
"""
