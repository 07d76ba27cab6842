"""spec.compile on CPU with gloo, fp32, FSDP2 on 2 processes: the same job eager and compiled trains alike.

Both gangs run at once. Each block is compiled in place (Module.compile), so the compiled run's checkpoint
holds the same parameter names as the eager run's, and its weights agree with them.
"""

from __future__ import annotations

import re

import pytest
from support.dcp_files import read_dcp
from support.trainer_harness import Gang, rel_diff, tiny_spec

pytestmark = pytest.mark.e2e

STEPS = 4
TOLERANCE = 1e-6
"""Relative difference allowed between the eager and compiled runs' losses and parameter norms: Inductor fuses
and reorders fp32 arithmetic (measured here: 4e-8 on the losses), and nothing else differs."""
WEIGHTS_TOLERANCE = 1e-5
"""The same for the checkpointed weights taken as one vector (measured here: 3.6e-7): Adam divides each update
by the gradient's own running scale, which carries the rounding further than the loss."""
NORM_ENV = {"KUBETRAIN_DEBUG_PARAM_NORM": "1"}


def test_compiled_training_matches_eager(tmp_path):
    spec = tiny_spec(strategy="fsdp", maxSteps=STEPS, checkpoint={"everySteps": STEPS, "keep": 1})
    # Compiling takes a minute on 2 busy cores (seconds once Inductor's on-disk cache holds these graphs): a
    # rank that finishes first waits that long for its peer in a collective.
    env = {**NORM_ENV, "KUBETRAIN_DIST_TIMEOUT_SECONDS": "600"}
    gangs = {name: Gang(tmp_path / name, {**spec, "compile": name == "compiled"}, 2, env=env, timeout=900)
             for name in ("eager", "compiled")}
    eager, compiled = (g.wait() for g in gangs.values())
    assert eager.exit_codes == [0, 0], eager.log(0)[-3000:]
    assert compiled.exit_codes == [0, 0], compiled.log(0)[-3000:]
    assert sorted(compiled.losses) == list(range(1, STEPS + 1))
    diff = rel_diff(compiled.losses, eager.losses)
    print(f"compiled vs eager: max relative loss difference over {STEPS} steps {diff:.2e}")
    assert diff <= TOLERANCE
    assert rel_diff(compiled.per_step("param_norm"), eager.per_step("param_norm")) <= TOLERANCE
    # Dynamo compiled the blocks: one graph serves both (they are alike), as rank 0 reports after step 1.
    graphs = re.search(r"compile: the first step took [\d.]+ s, compilation included \((\d+) graph", compiled.log(0))
    assert graphs is not None and int(graphs.group(1)) >= 1, compiled.log(0)[-3000:]
    assert "compile:" not in eager.log(0)
    # The checkpoints name the same parameters and hold the same weights. Compared as one vector: the attention
    # keys' bias has no gradient in exact arithmetic (softmax ignores a shift shared by every key), so its
    # ~1e-6 values are rounding noise that Adam scales up, in either run.
    first, second = (read_dcp(run.ckpt_dir / f"step-{STEPS:08d}" / "dcp")["model"] for run in (eager, compiled))
    assert first.keys() == second.keys()
    apart = sum(float((second[k] - t).square().sum()) for k, t in first.items()) ** 0.5
    whole = sum(float(t.square().sum()) for t in first.values()) ** 0.5
    print(f"compiled vs eager: relative difference of the checkpointed weights {apart / whole:.2e}")
    assert apart <= WEIGHTS_TOLERANCE * whole
