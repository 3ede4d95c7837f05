"""train()'s explicit way out for a caller that measures stretches of the real loop (`ember
doctor`): `halt()`, asked after each step, leaves with exit 0 and saves nothing, neither a
checkpoint nor the final weights, and the same job trains on at the next call."""

from __future__ import annotations

import json

from ember.ckpt.store import committed_in
from ember.events import Events
from ember.recipe import load_recipe
from ember.train.job import prepare
from ember.train.loop import train
from tests.helpers import write_recipe


def test_halt_leaves_after_the_asked_step_saving_nothing_and_the_job_goes_on(tmp_path):
    recipe = load_recipe(write_recipe(tmp_path / "r", train={"max_steps": 8}, checkpoint={"every_steps": 1}))
    job = prepare(recipe, tmp_path / "run", False, Events(lambda e: None), ledger_path=False)
    asked = []

    def halt() -> bool:
        asked.append(job.state.step)
        return job.state.step >= 3

    assert train(job, halt=halt) == 0
    assert job.state.step == 3 and asked[-1] == 3
    # every_steps = 1 saves after each step: the halted step 3 was not saved, nor were final weights
    assert [step for step, _ in committed_in(job.run.ckpt_dir)] == [1, 2]
    assert not (tmp_path / "run" / "final").exists()
    assert train(job, halt=lambda: job.state.step >= 5) == 0  # the same job goes on from step 3
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4, 5]
    job.ledger.close()
