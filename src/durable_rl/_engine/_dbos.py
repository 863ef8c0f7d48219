"""DBOS wiring: the run, each trial and each unit call are workflows; each attempt is a step.

- A unit call is a workflow enqueued on its tier's queue (sandbox, judge, trainer), so its
  concurrency is the queue's and any process listening on the queue may run it.
- Inside it: a cache lookup by identity, then attempts, each a DBOS step whose outcome is
  recorded; a failed attempt is retried, a timed-out one is cancelled and counts as failed.
- The judge call is recorded in the cache the moment it returns, under its own identity, so a
  retried judge task, a replayed driver and any later run find it instead of paying again.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from dbos import DBOS, DBOSConfig, Queue, SetWorkflowID, WorkflowHandleAsync
from pydantic import BaseModel

from .. import _harbor as harbor
from .. import _secret_hunt as hunt_env
from .. import _units as units
from .._config import RunConfig
from .._identity import canonical, canonical_json, identity
from .._llm import ChatResult, Endpoint
from .._llm_judge import LLMJudge
from .._loop import AnyTrajectory, StepRecord, TrialOutcome, UnitFailed, drive, run_trial
from .._models import JudgeAnswer, Reward, Rubric, StepResult, Trajectory, TrialSpec, Weights, World
from .._sandbox._workspace import sweep, trials_dir_for
from .._unit import policy_of
from ._sqlite import sqlite_engine
from ._store import Store, sqlite_path, state_dir

ENGINE_VERSION = "1"
JUDGE_MEMO_VERSION = "1"
# Dispatch and result polls of the engine's queues: short, so queue latency stays out of step times.
QUEUE_POLL_S = 0.02
RESULT_POLL_S = 0.02
EXIT_RUN_FAILED = 3

T = TypeVar("T")


@dataclass
class _Process:
    """What this driver process knows that is not part of any run's record."""

    store: Store
    url: str
    attempt: int
    out: Any
    queues: dict[str, Queue]


_proc: _Process | None = None


def _p() -> _Process:
    assert _proc is not None, "the engine was not started in this process"
    return _proc


async def _db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking store call off the event loop, where trials and judges keep running."""
    return await asyncio.to_thread(fn, *args, **kwargs)


@cache
def _config(run_id: str) -> RunConfig:
    row = _p().store.run(run_id)
    assert row is not None, f"run {run_id} has no record"
    return RunConfig.model_validate(row.config)


def _state_dir() -> Path:
    return state_dir(_p().url, Path.cwd())


def _sandbox(config: RunConfig) -> units.SandboxSettings:
    return units.SandboxSettings(trials_dir=trials_dir_for(_state_dir()), method=config.workspace)


# The units as the engine calls them: decode arguments, say what their identity is made of.
@dataclass(frozen=True)
class _Kind:
    fn: Callable[..., Any]
    output: type[BaseModel]
    identity_inputs: Callable[[dict[str, Any]], dict[str, Any]]
    call: Callable[[dict[str, Any], int, RunConfig, str, str], Awaitable[BaseModel]]
    timeout: Callable[[RunConfig, dict[str, Any]], float | None]
    on_reuse: Callable[[str, str, dict[str, Any], RunConfig], Awaitable[None]] | None = None


def _world_identity(world: dict[str, Any]) -> dict[str, Any]:
    return {"world_id": world["world_id"], "content_sha256": world["content_sha256"]}


def _task_identity(task: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in task.items() if k != "path"}  # where the folder lies is not what it is


def _declared_timeout(fn: Callable[..., Any]) -> Callable[[RunConfig, dict[str, Any]], float | None]:
    return lambda config, args: policy_of(fn).timeout_s


def _harbor_trial_timeout(config: RunConfig, args: dict[str, Any]) -> float:
    # the trial's own deadlines bound its phases; this one only catches a stuck runner
    task = harbor.HarborTask.model_validate(args["task"])
    return (task.config.agent.timeout_sec or 600.0) + task.config.verifier.timeout_sec + 60.0


class _RecordedJudge:
    """The run's judge, memoized for good: an answer is recorded the moment it returns."""

    def __init__(self, inner: units.Judge, run_id: str, key: str) -> None:
        self.inner, self.run_id, self.key = inner, run_id, key
        self.model = inner.model

    async def judge(self, traj: Trajectory, rubric: Rubric) -> JudgeAnswer:
        store = _p().store
        ident = _judge_memo_identity(traj, rubric, self.model)
        recorded = await _db(store.cache_get, ident)
        if recorded is not None:
            answer = JudgeAnswer.model_validate_json(recorded)
            await _db(store.event, self.run_id, "judge_reused", self.key, detail=_saved(answer))
            return answer
        # counted before the call: a call whose answer a crash loses was still billed
        await _db(store.event, self.run_id, "judge_call", self.key)
        answer = await self.inner.judge(traj, rubric)
        await _db(store.cache_put, ident, "judge", answer.model_dump_json(), self.run_id)
        return answer


def _judge_memo_identity(traj: Trajectory | dict[str, Any], rubric: Rubric | dict[str, Any], model: str) -> str:
    return identity("judge", JUDGE_MEMO_VERSION, {"traj": traj, "rubric": rubric, "model": model})


def _saved(answer: JudgeAnswer) -> str:
    return json.dumps(
        {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.completion_tokens,
            "cost_usd": answer.cost_usd,
        }
    )


class _LedgerObserver:
    """Writes each judge request to the ledger: its intent before, its outcome after."""

    def __init__(self, run_id: str, key: str, model: str, price: tuple[float, float]) -> None:
        self.run_id, self.key, self.model, self.price = run_id, key, model, price
        self.rows: dict[int, int] = {}

    async def before_request(self, n: int) -> None:
        self.rows[n] = await _db(_p().store.ledger_sent, self.run_id, self.key, self.model, n)

    async def after_request(self, n: int, outcome: str, result: ChatResult | None) -> None:
        prompt = result.usage.prompt_tokens if result else 0
        completion = result.usage.completion_tokens if result else 0
        cost = (prompt * self.price[0] + completion * self.price[1]) / 1e6
        latency = result.latency_s if result else 0.0
        await _db(_p().store.ledger_done, self.rows.pop(n), outcome, prompt, completion, cost, latency)


def _policy_endpoint(config: RunConfig) -> Endpoint | None:
    if not config.uses_llm_policy:
        return None
    return Endpoint(model=config.policy_model, base_url=config.policy_base_url, api_key_env=config.policy_api_key_env)


def _judge_for(config: RunConfig, run_id: str, key: str) -> units.Judge:
    if config.judge == "simulated":
        return hunt_env.SimulatedJudge(config.judge_latency)
    price = config.prices.get(config.judge_model, (0.0, 0.0))
    endpoint = Endpoint(
        model=config.judge_model,
        base_url=config.judge_base_url,
        api_key_env=config.judge_api_key_env,
        request_timeout_s=config.judge_timeout,
        deadline_s=config.judge_deadline,
        concurrency=config.judge_concurrency,
        requests_per_minute=config.judge_rpm,
    )
    return LLMJudge(endpoint, price_per_mtok=price, observer=_LedgerObserver(run_id, key, config.judge_model, price))


async def _judge_task_reused(run_id: str, key: str, args: dict[str, Any], config: RunConfig) -> None:
    """A reused judge task saved its judge call: say how much, from the recorded answer."""
    recorded = await _db(
        _p().store.cache_get, _judge_memo_identity(args["traj"], args["rubric"], config.judge_model_name)
    )
    if recorded is not None:
        await _db(
            _p().store.event, run_id, "judge_reused", key, detail=_saved(JudgeAnswer.model_validate_json(recorded))
        )


async def _call_build_world(args: dict[str, Any], attempt: int, config: RunConfig, run_id: str, key: str) -> World:
    return await units.build_world(args["world_id"], snapshots_dir=_state_dir() / "snapshots")


async def _call_generate(args: dict[str, Any], attempt: int, config: RunConfig, run_id: str, key: str) -> Trajectory:
    spec = TrialSpec.model_validate(args["spec"])
    return await units.generate(
        spec,
        Weights.model_validate(args["weights"]),
        World.model_validate(args["world"]),
        sandbox=_sandbox(config),
        attempt=attempt,
        flaky_trial_rate=config.flaky_trial_rate,
        turn_latency=config.turn_latency,
        hang=spec.trial_id in config.hang_trials,
        llm=_policy_endpoint(config),
        llm_max_turns=config.policy_max_turns,
    )


async def _call_verify_and_judge(
    args: dict[str, Any], attempt: int, config: RunConfig, run_id: str, key: str
) -> Reward:
    judge = _RecordedJudge(_judge_for(config, run_id, key), run_id, key)
    return await units.verify_and_judge(
        Trajectory.model_validate(args["traj"]),
        Rubric.model_validate(args["rubric"]),
        judge=judge,
        attempt=attempt,
        judge_flake_rate=config.judge_flake_rate,
    )


async def _call_train_step(args: dict[str, Any], attempt: int, config: RunConfig, run_id: str, key: str) -> StepResult:
    return await units.train_step(
        args["step"],
        Weights.model_validate(args["weights"]),
        [Reward.model_validate(r) for r in args["rewards"]],
        args["lr"],
    )


async def _call_task_world(args: dict[str, Any], attempt: int, config: RunConfig, run_id: str, key: str) -> World:
    task = harbor.HarborTask.model_validate(args["task"])
    return await harbor.build_task_world(task, snapshots_dir=_state_dir() / "snapshots")


async def _call_task_trial(
    args: dict[str, Any], attempt: int, config: RunConfig, run_id: str, key: str
) -> harbor.TaskTrajectory:
    return await harbor.run_task_trial(
        TrialSpec.model_validate(args["spec"]),
        Weights.model_validate(args["weights"]),
        World.model_validate(args["world"]),
        harbor.HarborTask.model_validate(args["task"]),
        args["agent"],
        trials_dir=trials_dir_for(_state_dir()),
        method=config.workspace,
        llm=_policy_endpoint(config),
        llm_max_turns=config.policy_max_turns,
    )


async def _call_task_score(args: dict[str, Any], attempt: int, config: RunConfig, run_id: str, key: str) -> Reward:
    return await harbor.score_task(harbor.TaskTrajectory.model_validate(args["traj"]))


_TRAIN = _Kind(units.train_step, StepResult, lambda a: a, _call_train_step, _declared_timeout(units.train_step))
_SECRET_HUNT: dict[str, _Kind] = {
    "build_world": _Kind(
        units.build_world,
        World,
        lambda a: {"world_id": a["world_id"]},
        _call_build_world,
        _declared_timeout(units.build_world),
    ),
    "generate": _Kind(
        units.generate,
        Trajectory,
        lambda a: {"spec": a["spec"], "weights": a["weights"], "world": _world_identity(a["world"])},
        _call_generate,
        lambda config, args: config.trial_timeout,
    ),
    "verify_and_judge": _Kind(
        units.verify_and_judge,
        Reward,
        lambda a: {"traj": a["traj"], "rubric": a["rubric"], "judge_model": a["judge_model"]},
        _call_verify_and_judge,
        _declared_timeout(units.verify_and_judge),
        on_reuse=_judge_task_reused,
    ),
    "train_step": _TRAIN,
}
_HARBOR: dict[str, _Kind] = {
    "build_world": _Kind(
        harbor.build_task_world,
        World,
        lambda a: {"task": _task_identity(a["task"])},
        _call_task_world,
        _declared_timeout(harbor.build_task_world),
    ),
    "generate": _Kind(
        harbor.run_task_trial,
        harbor.TaskTrajectory,
        lambda a: {
            "spec": a["spec"],
            "weights": a["weights"],
            "world": _world_identity(a["world"]),
            "task": _task_identity(a["task"]),
            "agent": a["agent"],
        },
        _call_task_trial,
        _harbor_trial_timeout,
    ),
    "verify_and_judge": _Kind(
        harbor.score_task, Reward, lambda a: {"traj": a["traj"]}, _call_task_score, _declared_timeout(harbor.score_task)
    ),
    "train_step": _TRAIN,
}


def _kinds(config: RunConfig) -> dict[str, _Kind]:
    return _HARBOR if config.tasks is not None else _SECRET_HUNT


def _still_valid(unit: str, output: str) -> bool:
    """A recorded output that points at files must still find them (a world folder removed by hand)."""
    if unit == "build_world":
        return Path(World.model_validate_json(output).root).is_dir()
    return True


async def _attempt(run_id: str, unit: str, key: str, ident: str, args_json: str, attempt: int) -> dict[str, Any]:
    """One attempt of a unit, the first one after a look for a recorded output of the same
    identity; its outcome (never an exception) is what DBOS records."""
    config = _config(run_id)
    store, kind, args = _p().store, _kinds(config)[unit], json.loads(args_json)
    if attempt == 0:
        recorded = await _db(store.cache_get, ident)
        if recorded is not None and _still_valid(unit, recorded):
            await _db(store.event, run_id, f"{unit}_reused", key)
            if kind.on_reuse is not None:
                await kind.on_reuse(run_id, key, args, config)
            return {"ok": True, "output": recorded}
    await _db(store.event, run_id, f"{unit}_attempt", key, attempt=attempt)
    t0 = time.monotonic()
    timeout = kind.timeout(config, args)
    try:
        output = await asyncio.wait_for(kind.call(args, attempt, config, run_id, key), timeout)
    except TimeoutError:
        error = f"TimeoutError: attempt {attempt} passed its {timeout:g} s deadline and was cancelled"
    except Exception as e:  # any failure of the unit's own code fails this attempt only
        error = f"{type(e).__name__}: {e}"
    else:
        text = output.model_dump_json()
        done = {"kind": f"{unit}_done", "key": key, "attempt": attempt, "seconds": time.monotonic() - t0}
        await _db(store.cache_put, ident, unit, text, run_id, done)
        return {"ok": True, "output": text}
    await _db(store.event, run_id, f"{unit}_failed", key, attempt=attempt, seconds=time.monotonic() - t0, detail=error)
    return {"ok": False, "error": error}


@DBOS.workflow(name="durable_rl.unit")
async def unit_workflow(run_id: str, unit: str, key: str, args_json: str) -> dict[str, Any]:
    """A unit call: reuse a recorded output of the same identity, else attempt it."""
    kind = _kinds(_config(run_id))[unit]
    policy = policy_of(kind.fn)
    ident = identity(policy.name, policy.version, kind.identity_inputs(json.loads(args_json)))
    result: dict[str, Any] = {}
    for attempt in range(policy.retries + 1):
        result = await DBOS.run_step_async(
            {"name": f"attempt-{attempt}"}, _attempt, run_id, unit, key, ident, args_json, attempt
        )
        if result["ok"]:
            break
    return result


@DBOS.workflow(name="durable_rl.trial")
async def trial_workflow(run_id: str, spec_json: str, weights_json: str, world_json: str, rubric_json: str) -> str:
    """One trial's pipeline as its own workflow, so its order of calls never depends on others."""
    outcome = await run_trial(
        DbosOps(run_id),
        TrialSpec.model_validate_json(spec_json),
        Weights.model_validate_json(weights_json),
        World.model_validate_json(world_json),
        Rubric.model_validate_json(rubric_json),
    )
    return outcome.model_dump_json()


async def _record_step(run_id: str, record_json: str, attempt: int) -> None:
    record = StepRecord.model_validate_json(record_json)
    r = record.result
    await _db(
        _p().store.record_step,
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
        },
        [
            {
                "run_id": run_id,
                "trial_id": o.trial_id,
                "step": r.step,
                "reward": o.reward.reward if o.reward else None,
                "rewards": json.dumps(o.reward.rewards if o.reward else {}),
                "error_type": o.error_type,
                "error_message": o.error_message,
                "info": json.dumps(o.info, sort_keys=True),
            }
            for o in record.trials
        ],
    )
    for trial_id, error in sorted(record.failed_trials.items()):
        print(f"  skipped {trial_id}: {error}", file=_p().out, flush=True)
    print(
        f"step {r.step}: trials {r.n_trials}/{record.n_specs} · mean reward {r.mean_reward} · "
        f"mean turns {r.mean_turns} · weights v{r.weights.version} · driver attempt {attempt}",
        file=_p().out,
        flush=True,
    )


async def _record_start(run_id: str) -> float:
    return await _db(_p().store.record_start, run_id)


@DBOS.workflow(name="durable_rl.run")
async def run_workflow(run_id: str) -> int:
    """The driver: the loop, with every call durable; a replay re-enters it from the record."""
    await DBOS.run_step_async({"name": "started_at"}, _record_start, run_id)
    config = _config(run_id)
    await drive(config, DbosOps(run_id))
    return config.n_steps


class DbosOps:
    """The loop's calls, made durable: each is a child workflow with a deterministic id."""

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.config = _config(run_id)
        tasks = harbor.tasks_at(self.config.tasks) if self.config.tasks is not None else ()
        self.tasks = {t.name: t for t in tasks}

    async def _enqueue(self, tier: str, wid: str, unit: str, key: str, args: dict[str, Any]) -> Any:
        with SetWorkflowID(f"{self.run_id}/{wid}"):
            return await _p().queues[tier].enqueue_async(unit_workflow, self.run_id, unit, key, canonical_json(args))

    async def _unit(self, tier: str, wid: str, unit: str, key: str, args: dict[str, Any]) -> str:
        handle = await self._enqueue(tier, wid, unit, key, args)
        return _output(await handle.get_result(polling_interval_sec=RESULT_POLL_S))

    async def build_worlds(self, world_ids: list[str]) -> dict[str, World]:
        handles = []
        for w in world_ids:
            args = canonical({"task": self.tasks[w]}) if self.tasks else {"world_id": w}
            handles.append(await self._enqueue("sandbox", f"world/{w}", "build_world", w, args))
        worlds = {}
        for w, handle in zip(world_ids, handles, strict=True):  # awaited in order: a replay sees the same
            result = await handle.get_result(polling_interval_sec=RESULT_POLL_S)
            worlds[w] = World.model_validate_json(_output(result))
        return worlds

    async def generate(self, spec: TrialSpec, weights: Weights, world: World) -> AnyTrajectory:
        args: dict[str, Any] = {"spec": spec, "weights": weights, "world": world}
        if self.tasks:
            args |= {"task": self.tasks[spec.world_id], "agent": self.config.agent}
        text = await self._unit("sandbox", f"{spec.trial_id}/generate", "generate", spec.trial_id, canonical(args))
        return _kinds(self.config)["generate"].output.model_validate_json(text)  # type: ignore[return-value]

    async def verify_and_judge(self, traj: AnyTrajectory, rubric: Rubric) -> Reward:
        args: dict[str, Any] = (
            {"traj": traj}
            if self.tasks
            else {"traj": traj, "rubric": rubric, "judge_model": self.config.judge_model_name}
        )
        text = await self._unit("judge", f"{traj.trial_id}/judge", "verify_and_judge", traj.trial_id, canonical(args))
        return Reward.model_validate_json(text)

    async def fan_out(
        self, specs: list[TrialSpec], weights: Weights, worlds: dict[str, World], rubric: Rubric
    ) -> list[TrialOutcome]:
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
                        rubric.model_dump_json(),
                    )
                )
        # all trials run at once; collecting them in spec order adds no wait
        return [
            TrialOutcome.model_validate_json(await h.get_result(polling_interval_sec=RESULT_POLL_S)) for h in handles
        ]

    async def train_step(self, step: int, weights: Weights, rewards: list[Reward], lr: float) -> StepResult:
        args = {"step": step, "weights": weights, "rewards": rewards, "lr": lr}
        text = await self._unit("trainer", f"s{step}/train", "train_step", f"s{step}", canonical(args))
        return StepResult.model_validate_json(text)

    async def step_done(self, record: StepRecord) -> None:
        proc = _p()
        await DBOS.run_step_async(
            {"name": f"record-step-{record.result.step}"},
            _record_step,
            self.run_id,
            record.model_dump_json(),
            proc.attempt,
        )
        if proc.attempt == 1 and record.result.step == _config(self.run_id).crash_driver_at_step:
            print(f"crashing the driver after step {record.result.step} (--crash-driver-at-step)", file=sys.stderr)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # as from kill -9: no cleanup, no flush


def _output(result: dict[str, Any]) -> str:
    if not result["ok"]:
        raise UnitFailed(result["error"])
    text: str = result["output"]
    return text


async def run_driver(run_id: str, url: str, store: Store, attempt: int, out: Any) -> None:
    """Launch DBOS in this process, resume or start the run's workflow, and wait for it."""
    global _proc
    config: DBOSConfig = {
        "name": "durable-rl",
        "system_database_url": url,
        "application_version": f"durable-rl-engine-{ENGINE_VERSION}",
        "executor_id": f"driver-{run_id}",  # a resumed driver recovers exactly this run's work
        "log_level": "WARNING",
    }
    if sqlite_path(url) is not None:
        config["system_database_engine"] = sqlite_engine(url)
    _proc = _Process(store=store, url=url, attempt=attempt, out=out, queues={})
    swept = sweep(trials_dir_for(_state_dir()))  # working copies a killed driver left, mounts included
    if swept:
        print(f"removed {swept} working copies left by a dead process", file=sys.stderr)
    DBOS(config=config)
    DBOS.launch()
    try:
        run_config = _config(run_id)
        _proc.queues = {
            "sandbox": await DBOS.register_queue_async(
                "durable-rl-sandbox", worker_concurrency=run_config.sandbox_slots, polling_interval_sec=QUEUE_POLL_S
            ),
            "judge": await DBOS.register_queue_async(
                "durable-rl-judge", worker_concurrency=run_config.judge_concurrency, polling_interval_sec=QUEUE_POLL_S
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
