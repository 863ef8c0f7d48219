"""How the engine calls each unit: its arguments, its identity, its deadline, and one attempt.

Engine-agnostic: a workflow engine wraps `attempt` as a recorded step. The judge's answers are
memoized here, and each judge request written to the ledger before it is sent.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from .. import _harbor as harbor
from .. import _secret_hunt as hunt_env
from .. import _units as units
from .._config import RunConfig
from .._identity import identity
from .._llm import ChatResult, Endpoint
from .._llm_judge import LLMJudge
from .._models import JudgeAnswer, Reward, Rubric, StepResult, Trajectory, TrialSpec, Weights, World
from .._sandbox._workspace import trials_dir_for
from .._unit import policy_of
from ._store import Store, state_dir

JUDGE_MEMO_VERSION = "1"

T = TypeVar("T")


@dataclass
class Process:
    """What this driver process knows that is not part of any run's record."""

    store: Store
    url: str
    attempt: int
    out: Any
    queues: dict[str, Any] = field(default_factory=dict)


_proc: Process | None = None


def start(process: Process) -> Process:
    """Make `process` the one every call in this process records through."""
    global _proc
    _proc = process
    return process


def current() -> Process:
    assert _proc is not None, "the engine was not started in this process"
    return _proc


async def db(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a blocking store call off the event loop, where trials and judges keep running."""
    return await asyncio.to_thread(fn, *args, **kwargs)


@cache
def run_config(run_id: str) -> RunConfig:
    row = current().store.run(run_id)
    assert row is not None, f"run {run_id} has no record"
    return RunConfig.model_validate(row.config)


def state_folder() -> Path:
    return state_dir(current().url, Path.cwd())


def _sandbox(config: RunConfig) -> units.SandboxSettings:
    return units.SandboxSettings(trials_dir=trials_dir_for(state_folder()), method=config.workspace)


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
    return task.config.agent.wall_s + task.config.verifier.timeout_sec + 60.0


class _RecordedJudge:
    """The run's judge, memoized for good: an answer is recorded the moment it returns."""

    def __init__(self, inner: units.Judge, run_id: str, key: str) -> None:
        self.inner, self.run_id, self.key = inner, run_id, key
        self.model = inner.model

    async def judge(self, traj: Trajectory, rubric: Rubric) -> JudgeAnswer:
        store = current().store
        ident = _judge_memo_identity(traj, rubric, self.model)
        recorded = await db(store.cache_get, ident)
        if recorded is not None:
            answer = JudgeAnswer.model_validate_json(recorded)
            await db(store.event, self.run_id, "judge_reused", self.key, detail=_saved(answer))
            return answer
        # counted before the call: a call whose answer a crash loses was still billed
        await db(store.event, self.run_id, "judge_call", self.key)
        answer = await self.inner.judge(traj, rubric)
        await db(store.cache_put, ident, "judge", answer.model_dump_json(), self.run_id)
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
        self.rows[n] = await db(current().store.ledger_sent, self.run_id, self.key, self.model, n)

    async def after_request(self, n: int, outcome: str, result: ChatResult | None) -> None:
        prompt = result.usage.prompt_tokens if result else 0
        completion = result.usage.completion_tokens if result else 0
        cost = (prompt * self.price[0] + completion * self.price[1]) / 1e6
        latency = result.latency_s if result else 0.0
        await db(current().store.ledger_done, self.rows.pop(n), outcome, prompt, completion, cost, latency)


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
    recorded = await db(
        current().store.cache_get, _judge_memo_identity(args["traj"], args["rubric"], config.judge_model_name)
    )
    if recorded is not None:
        await db(
            current().store.event, run_id, "judge_reused", key, detail=_saved(JudgeAnswer.model_validate_json(recorded))
        )


async def _call_build_world(args: dict[str, Any], attempt: int, config: RunConfig, run_id: str, key: str) -> World:
    return await units.build_world(args["world_id"], snapshots_dir=state_folder() / "snapshots")


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
    return await harbor.build_task_world(task, snapshots_dir=state_folder() / "snapshots")


async def _call_task_trial(
    args: dict[str, Any], attempt: int, config: RunConfig, run_id: str, key: str
) -> harbor.TaskTrajectory:
    return await harbor.run_task_trial(
        TrialSpec.model_validate(args["spec"]),
        Weights.model_validate(args["weights"]),
        World.model_validate(args["world"]),
        harbor.HarborTask.model_validate(args["task"]),
        args["agent"],
        trials_dir=trials_dir_for(state_folder()),
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


def kinds(config: RunConfig) -> dict[str, _Kind]:
    return _HARBOR if config.tasks is not None else _SECRET_HUNT


def _still_valid(unit: str, output: str) -> bool:
    """A recorded output that points at files must still find them (a world folder removed by hand)."""
    if unit == "build_world":
        return Path(World.model_validate_json(output).root).is_dir()
    return True


async def attempt_unit(run_id: str, unit: str, key: str, ident: str, args_json: str, attempt: int) -> dict[str, Any]:
    """One attempt of a unit, the first one after a look for a recorded output of the same
    identity; its outcome (never an exception) is what DBOS records."""
    config = run_config(run_id)
    store, kind, args = current().store, kinds(config)[unit], json.loads(args_json)
    if attempt == 0:
        recorded = await db(store.cache_get, ident)
        if recorded is not None and _still_valid(unit, recorded):
            await db(store.event, run_id, f"{unit}_reused", key)
            if kind.on_reuse is not None:
                await kind.on_reuse(run_id, key, args, config)
            return {"ok": True, "output": recorded}
    await db(store.event, run_id, f"{unit}_attempt", key, attempt=attempt)
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
        await db(store.cache_put, ident, unit, text, run_id, done)
        return {"ok": True, "output": text}
    await db(store.event, run_id, f"{unit}_failed", key, attempt=attempt, seconds=time.monotonic() - t0, detail=error)
    return {"ok": False, "error": error}
