"""data.format chat end to end: the built-in model with the byte tokenizer on examples/data-chat/chat.jsonl under
FSDP2 on 2 gloo processes, the last 5% of the conversations held out for evaluation; killed on rank 1 after step 4
and resumed from its step-3 checkpoint, it trains and evaluates exactly as the uninterrupted gang does (fp32)."""

from __future__ import annotations

import pytest
from support.paths import REPO_ROOT
from support.trainer_harness import Gang, Run, rel_diff, resumed_losses, tiny_spec

pytestmark = pytest.mark.e2e

CHAT = REPO_ROOT / "examples" / "data-chat" / "chat.jsonl"
# Synchronous saves: the step-3 checkpoint is committed before step 4, where rank 1 dies. 8 samples a step over
# 38 trained ones: the order crosses an epoch at step 5, after the resume.
SPEC = tiny_spec(strategy="fsdp", maxSteps=8, evalEverySteps=4, evalBatches=2, model={"seqLen": 128},
                 data={"path": str(CHAT), "format": "chat"}, checkpoint={"everySteps": 3, "keep": 3, "asyncSave": False})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Run]:
    root = tmp_path_factory.mktemp("chat")
    gangs = {"chat": Gang(root / "chat", SPEC), "chat_fail": Gang(root / "fail", SPEC, env={"KUBETRAIN_FAIL_AT": "1:4"})}
    done = {name: g.wait() for name, g in gangs.items()}
    done["chat_resumed"] = Gang(root / "fail", SPEC, generation=1).wait()
    return done


def test_chat_data_trains_and_evaluates(runs: dict[str, Run]) -> None:
    run = runs["chat"]
    assert run.exit_codes == [0, 0], run.log()
    losses = run.losses
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1]
    assert losses[1] == pytest.approx(5.55, abs=0.2)  # ln 256: a random model's loss on the counted bytes
    assert "40 chat sample(s) of 40 line(s); 11 cut at seqLen+1 = 129 tokens, 0 left out" in run.log(0)
    assert sorted(run.per_step("eval_loss")) == [4, 8]


def test_chat_data_resumes_exactly_after_a_kill(runs: dict[str, Run]) -> None:
    assert resumed_losses(runs, "chat", every=3, steps=8) <= 1e-5
    resumed = {s: v for s, v in runs["chat_resumed"].per_step("eval_loss").items() if s > 3}
    assert rel_diff(resumed, runs["chat"].per_step("eval_loss")) <= 1e-5
