"""DBOS wiring: the run, each trial and each unit call are workflows; each attempt is a step.

- A unit call is a workflow enqueued on its tier's queue (sandbox, judge, trainer), so its
  concurrency is the queue's and any process listening on the queue may run it.
- Inside it: a cache lookup by identity, then attempts, each a DBOS step whose outcome is
  recorded; a failed attempt is retried, a timed-out one is cancelled and counts as failed.
- The judge call is recorded in the cache the moment it returns, under its own identity, so a
  retried judge task, a replayed driver and any later run find it instead of paying again.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from typing import Any

from dbos import DBOS, DBOSConfig, SetWorkflowID, WorkflowHandleAsync

from .._config import UnitName
from .._identity import canonical, canonical_json, identity
from .._loop import EndpointDown, StepFailed, StepRecord, TrialOutcome, UnitFailed, check_endpoints, drive, run_trial
from .._models import Reward, StepResult, Trajectory, TrialSpec, Weights, World
from .._sandbox._workspace import sweep, trials_dir_for
from .._unit import policy_of
from ._calls import (
    UNITS,
    Process,
    attempt_unit,
    current,
    db,
    identity_inputs,
    retries,
    run_config,
    start,
    state_folder,
)
from ._sqlite import sqlite_engine
from ._store import Store, sqlite_path

ENGINE_VERSION = "2"
# Dispatch and result polls of the engine's queues: short, so queue latency stays out of step times.
QUEUE_POLL_S = 0.02
RESULT_POLL_S = 0.02


@DBOS.workflow(name="durable_rl.unit")
async def unit_workflow(run_id: str, unit: UnitName, key: str, args_json: str) -> dict[str, Any]:
    """A unit call: reuse a recorded output of the same identity, else attempt it."""
    config = run_config(run_id)
    policy = policy_of(UNITS[unit])
    ident = identity(policy.name, policy.version, identity_inputs(config, unit, json.loads(args_json)))
    result: dict[str, Any] = {}
    for attempt in range(retries(config, unit) + 1):
        result = await DBOS.run_step_async(
            {"name": f"attempt-{attempt}"}, attempt_unit, run_id, unit, key, ident, args_json, attempt
        )
        if result["ok"]:
            break
    return result


@DBOS.workflow(name="durable_rl.trial")
async def trial_workflow(run_id: str, spec_json: str, weights_json: str, world_json: str) -> str:
    """One trial's pipeline as its own workflow, so its order of calls never depends on others."""
    outcome = await run_trial(
        DbosOps(run_id),
        TrialSpec.model_validate_json(spec_json),
        Weights.model_validate_json(weights_json),
        World.model_validate_json(world_json),
    )
    return outcome.model_dump_json()


async def _record_step(run_id: str, record_json: str, attempt: int) -> None:
    record = StepRecord.model_validate_json(record_json)
    r = record.result
    await db(
        current().store.record_step,
        {
            "run_id": run_id,
            "step": r.step,
            "n_trials": r.n_trials,
            "n_specs": record.n_specs,
            "mean_reward": r.mean_reward,
            "mean_turns": r.mean_turns,
            "weights_version": r.weights.version,
            "wall_s": record.wall_s,
            "max_turns": record.max_turns,
            "driver_attempt": attempt,
            "failed_trials": json.dumps(record.failed_trials, sort_keys=True),
            "error": record.error,
        },
        [
            {
                "run_id": run_id,
                "trial_id": o.trial_id,
                "step": r.step,
                "reward": o.reward.reward if o.reward else None,
                "rewards": json.dumps(o.reward.components if o.reward else {}),
                "error_type": o.error_type,
                "error_message": o.error_message,
                "info": json.dumps(o.info, sort_keys=True),
            }
            for o in record.trials
        ],
    )
    for trial_id, error in sorted(record.failed_trials.items()):
        print(f"  skipped {trial_id}: {error}", file=current().out, flush=True)
    if record.error is not None:
        print(f"step {r.step} failed: {record.error}", file=current().out, flush=True)
        return
    print(
        f"step {r.step}: trials {r.n_trials}/{record.n_specs} · mean reward {r.mean_reward} · "
        f"mean turns {r.mean_turns} · weights v{r.weights.version} · driver attempt {attempt}",
        file=current().out,
        flush=True,
    )


async def _record_start(run_id: str) -> float:
    return await db(current().store.record_start, run_id)


@DBOS.workflow(name="durable_rl.run")
async def run_workflow(run_id: str) -> int:
    """The driver: the loop, with every call durable; a replay re-enters it from the record."""
    await DBOS.run_step_async({"name": "started_at"}, _record_start, run_id)
    config = run_config(run_id)
    await drive(config, DbosOps(run_id))
    return config.n_steps


class DbosOps:
    """The loop's calls, made durable: each is a child workflow with a deterministic id."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.config = run_config(run_id)

    async def _enqueue(self, tier: str, wid: str, unit: UnitName, key: str, args: dict[str, Any]) -> Any:
        with SetWorkflowID(f"{self.run_id}/{wid}"):
            return (
                await current().queues[tier].enqueue_async(unit_workflow, self.run_id, unit, key, canonical_json(args))
            )

    async def _unit(self, tier: str, wid: str, unit: UnitName, key: str, args: dict[str, Any]) -> str:
        handle = await self._enqueue(tier, wid, unit, key, args)
        return _output(await handle.get_result(polling_interval_sec=RESULT_POLL_S))

    async def build_worlds(self, world_ids: list[str]) -> dict[str, World]:
        handles = [await self._enqueue("sandbox", f"world/{w}", "build_world", w, {"world_id": w}) for w in world_ids]
        worlds = {}
        for w, handle in zip(world_ids, handles, strict=True):  # awaited in order: a replay sees the same
            result = await handle.get_result(polling_interval_sec=RESULT_POLL_S)
            worlds[w] = World.model_validate_json(_output(result))
        return worlds

    async def generate(self, spec: TrialSpec, weights: Weights, world: World) -> Trajectory:
        args = canonical({"spec": spec, "weights": weights, "world": world})
        text = await self._unit("sandbox", f"{spec.trial_id}/generate", "generate", spec.trial_id, args)
        return Trajectory.model_validate_json(text)

    async def verify_and_judge(self, traj: Trajectory) -> Reward:
        args = canonical({"traj": traj})
        text = await self._unit("judge", f"{traj.trial_id}/judge", "verify_and_judge", traj.trial_id, args)
        return Reward.model_validate_json(text)

    async def fan_out(self, specs: list[TrialSpec], weights: Weights, worlds: dict[str, World]) -> list[TrialOutcome]:
        handles = []
        for spec in specs:  # started in spec order, so every replay assigns the same ids
            with SetWorkflowID(f"{self.run_id}/{spec.trial_id}"):
                handles.append(
                    await DBOS.start_workflow_async(
                        trial_workflow,
                        self.run_id,
                        spec.model_dump_json(),
                        weights.model_dump_json(),
                        worlds[spec.world_id].model_dump_json(),
                    )
                )
        # all trials run at once; collecting them in spec order adds no wait
        return [
            TrialOutcome.model_validate_json(await h.get_result(polling_interval_sec=RESULT_POLL_S)) for h in handles
        ]

    async def train_step(self, step: int, weights: Weights, rewards: list[Reward]) -> StepResult:
        args = canonical({"step": step, "weights": weights, "rewards": rewards})
        text = await self._unit("trainer", f"s{step}/train", "train_step", f"s{step}", args)
        return StepResult.model_validate_json(text)

    async def step_done(self, record: StepRecord) -> None:
        proc = current()
        await DBOS.run_step_async(
            {"name": f"record-step-{record.result.step}"},
            _record_step,
            self.run_id,
            record.model_dump_json(),
            proc.attempt,
        )
        if proc.attempt == 1 and record.result.step == self.config.faults.crash_driver_at_step:
            print(f"crashing the driver after step {record.result.step} (--crash-driver-at-step)", file=sys.stderr)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # as from kill -9: no cleanup, no flush


def _output(result: dict[str, Any]) -> str:
    if not result["ok"]:
        raise UnitFailed(result["error"])
    text: str = result["output"]
    return text


class _RunEndsAreOurs(logging.Filter):
    """Keep DBOS from printing a traceback for a run that ended as designed (a dead endpoint, a
    failed step): the driver says it in one line. Every other engine error still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, EndpointDown | StepFailed)


async def run_driver(run_id: str, url: str, store: Store, attempt: int, out: Any) -> None:
    """Launch DBOS in this process, resume or start the run's workflow, and wait for it."""
    config: DBOSConfig = {
        "name": "durable-rl",
        "system_database_url": url,
        "application_version": f"durable-rl-engine-{ENGINE_VERSION}",
        "executor_id": f"driver-{run_id}",  # a resumed driver recovers exactly this run's work
        "log_level": "WARNING",
    }
    if sqlite_path(url) is not None:
        config["system_database_engine"] = sqlite_engine(url)
    process = start(Process(store=store, url=url, attempt=attempt, out=out))
    problems = await check_endpoints(run_config(run_id).plugins())
    if problems:  # before any step: a dead endpoint fails the run now, not every trial one by one
        raise EndpointDown("; ".join(problems))
    swept = sweep(trials_dir_for(state_folder()))  # working copies a killed driver left, mounts included
    if swept:
        print(f"removed {swept} working copies left by a dead process", file=sys.stderr)
    logging.getLogger("dbos").addFilter(_RunEndsAreOurs())
    DBOS(config=config)
    DBOS.launch()
    try:
        config_of_run = run_config(run_id)
        process.queues = {
            "sandbox": await DBOS.register_queue_async(
                "durable-rl-sandbox", worker_concurrency=config_of_run.sandbox_slots, polling_interval_sec=QUEUE_POLL_S
            ),
            "judge": await DBOS.register_queue_async(
                "durable-rl-judge",
                worker_concurrency=config_of_run.judge_concurrency,
                polling_interval_sec=QUEUE_POLL_S,
            ),
            "trainer": await DBOS.register_queue_async(
                "durable-rl-trainer", worker_concurrency=1, polling_interval_sec=QUEUE_POLL_S
            ),
        }
        if await DBOS.get_workflow_status_async(run_id) is None:
            with SetWorkflowID(run_id):
                await (await DBOS.start_workflow_async(run_workflow, run_id)).get_result()
        else:  # a resumed run: DBOS's recovery at launch has already taken its workflow up again
            handle: WorkflowHandleAsync[int] = await DBOS.retrieve_workflow_async(run_id)
            await handle.get_result(polling_interval_sec=RESULT_POLL_S)
    finally:
        DBOS.destroy()
