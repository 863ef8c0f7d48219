"""The units as plain async functions: no engine, no database."""

from __future__ import annotations

import asyncio
import hashlib
import random
from pathlib import Path

import pytest

from durable_rl import (
    RUBRICS,
    JudgeAnswer,
    Reward,
    Rubric,
    SimulatedJudge,
    Trajectory,
    TrialSpec,
    build_world,
    generate,
    identity,
    policy_of,
    train_step,
    verify_and_judge,
)
from durable_rl import _secret_hunt as hunt_env
from durable_rl._units import SandboxSettings

V1 = RUBRICS["v1"]


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


class CountingJudge:
    """A scripted judge that counts its calls."""

    model = "counting"

    def __init__(self, score: float = 0.5) -> None:
        self.calls = 0
        self.score = score

    async def judge(self, traj: Trajectory, rubric: Rubric) -> JudgeAnswer:
        self.calls += 1
        return JudgeAnswer(score=self.score, model=self.model)


def test_seed_is_the_spec_formula() -> None:
    expected = int(hashlib.sha256(b"world|w0").hexdigest()[:8], 16)
    assert hunt_env.seed("world", "w0") == expected


def test_world_files_follow_the_spec(tmp_path: Path) -> None:
    world = _run(build_world("w1", snapshots_dir=tmp_path / "snapshots"))
    r = random.Random(hunt_env.seed("world", "w1"))
    secret_doc = r.randrange(8)
    secret = f"w1-secret-{r.randrange(10**6):06d}"
    digest = hashlib.sha256(secret.encode()).hexdigest()
    docs = sorted((Path(world.root) / "docs").iterdir())
    assert [d.name for d in docs] == [f"doc_{i}.txt" for i in range(8)]
    for i, doc in enumerate(sorted(docs, key=lambda p: int(p.stem.split("_")[1]))):
        lines = [f"title: report {i} for w1", f"owner: team-{i % 3}", f"pages: {10 + i}"]
        if i == secret_doc:
            lines.append(f"secret_sha256: {digest}")
        assert doc.read_text() == "\n".join(lines) + "\n"
    all_text = "".join(d.read_text() for d in docs)
    assert secret not in all_text  # only the digest is ever written
    again = _run(build_world("w1", snapshots_dir=tmp_path / "snapshots"))
    assert again == world  # built once, then found


def test_generate_is_the_same_on_every_attempt_and_private(tmp_path: Path) -> None:
    world = _run(build_world("w0", snapshots_dir=tmp_path / "snapshots"))
    before = {p: p.read_bytes() for p in Path(world.root).rglob("*") if p.is_file()}
    weights = hunt_env.initial_weights(["w0"])
    spec = TrialSpec(trial_id="s0-p0-n0", step=0, world_id="w0", prompt="find the secret")
    sandbox = SandboxSettings(trials_dir=tmp_path / "trials")
    first = _run(generate(spec, weights, world, sandbox=sandbox, turn_latency=0))
    retried = _run(generate(spec, weights, world, sandbox=sandbox, attempt=1, flaky_trial_rate=1.0, turn_latency=0))
    assert first == retried
    after = {p: p.read_bytes() for p in Path(world.root).rglob("*") if p.is_file()}
    assert after == before  # the agent's answer.txt went to its own copy
    assert not (Path(world.root) / "answer.txt").exists()
    assert list((tmp_path / "trials").iterdir()) == []  # each trial's copy was removed


def test_flaky_failure_only_on_the_first_attempt(tmp_path: Path) -> None:
    world = _run(build_world("w0", snapshots_dir=tmp_path / "snapshots"))
    spec = TrialSpec(trial_id="s0-p0-n0", step=0, world_id="w0", prompt="find the secret")
    with pytest.raises(hunt_env.InjectedFailure):
        _run(generate(spec, hunt_env.initial_weights(["w0"]), world, flaky_trial_rate=1.0, turn_latency=0))


def test_the_spec_failure_counts_for_the_default_run() -> None:
    ids = [f"s{s}-p{p}-n{n}" for s in range(3) for p in range(3) for n in range(2)]
    sandbox = [t for t in ids if random.Random(hunt_env.seed("trial", t)).random() < 0.25]
    judge = [t for t in ids if hunt_env.judge_task_flakes(t, 0, 0.3)]
    assert (len(sandbox), len(judge)) == (6, 6)
    assert not any(hunt_env.judge_task_flakes(t, 1, 0.3) for t in ids)


def test_judge_task_failure_comes_after_the_judge_answered() -> None:
    traj = Trajectory(
        trial_id="s0-p0-n0", world_id="w0", weights_version=0, turns=[], answer=None, files_written=["answer.txt"]
    )
    judge = CountingJudge()
    with pytest.raises(hunt_env.InjectedFailure):
        _run(verify_and_judge(traj, V1, judge=judge, judge_flake_rate=1.0))
    assert judge.calls == 1
    reward = _run(verify_and_judge(traj, V1, judge=judge, attempt=1, judge_flake_rate=1.0))
    assert reward.reward == 0.5 and not reward.verified_correct and reward.found_doc is None


def test_verifier_accepts_only_the_worlds_digest() -> None:
    turns = [{"doc": 3, "found": True}]
    right = Trajectory(
        trial_id="t",
        world_id="w2",
        weights_version=0,
        turns=turns,
        answer=hunt_env.world_digest("w2"),
        files_written=["answer.txt"],
    )
    wrong = right.model_copy(update={"answer": hunt_env.world_digest("w1")})
    assert _run(verify_and_judge(right, V1, judge=CountingJudge(0.0))).verified_correct
    assert not _run(verify_and_judge(wrong, V1, judge=CountingJudge(0.0))).verified_correct


def test_simulated_judge_is_the_spec_formula() -> None:
    traj = Trajectory(
        trial_id="s1-p0-n1",
        world_id="w0",
        weights_version=1,
        turns=[{"doc": 0, "found": False}] * 3,
        answer=None,
        files_written=["answer.txt", "scratch.tmp"],
    )
    rj = random.Random(hunt_env.seed("judge", "s1-p0-n1", "v2-efficiency"))
    expected = round(0.0 + 1.0 * (1.0 - 2 / 8) + 0.5 * 0.0 + rj.uniform(-0.05, 0.05), 3)
    answer = _run(SimulatedJudge(latency=0).judge(traj, RUBRICS["v2-efficiency"]))
    assert answer.score == expected


def _reward(tid: str, world: str, reward: float, found: int | None) -> Reward:
    return Reward(
        trial_id=tid,
        world_id=world,
        verified_correct=found is not None,
        n_turns=2,
        judge_score=reward - 1,
        reward=reward,
        found_doc=found,
    )


def test_train_step_is_pure_and_order_independent() -> None:
    weights = hunt_env.initial_weights(["w0", "w1"])
    rewards = [
        _reward("a", "w0", 2.1, 3),
        _reward("b", "w0", 1.3, 3),
        _reward("c", "w1", 0.4, None),
        _reward("d", "w1", 2.0, 5),
    ]
    first = _run(train_step(0, weights, rewards, 2.0))
    again = _run(train_step(0, weights, list(reversed(rewards)), 2.0))
    assert first == again
    assert weights.doc_prior["w0"] == [1.0] * 8  # the input is untouched
    assert first.weights.version == 1
    assert first.weights.doc_prior["w0"][3] == 1.0 + 2.0 * 2.1 + 2.0 * 1.3
    assert first.weights.doc_prior["w1"][5] == 1.0 + 2.0 * 2.0
    assert (first.mean_reward, first.mean_turns, first.n_trials) == (1.45, 2.0, 4)
    empty = _run(train_step(3, first.weights, [], 2.0))
    assert (empty.mean_reward, empty.mean_turns, empty.n_trials, empty.weights.version) == (0.0, 0.0, 0, 2)


def test_units_declare_the_issue_retries_and_timeouts() -> None:
    declared = {f.__name__: policy_of(f) for f in (build_world, generate, verify_and_judge, train_step)}
    assert (declared["generate"].retries, declared["generate"].timeout_s) == (1, 300.0)
    assert declared["verify_and_judge"].retries == 2
    assert (declared["train_step"].retries, declared["train_step"].timeout_s) == (1, 600.0)
    assert {p.tier for p in declared.values()} == {"sandbox", "judge", "trainer"}


def test_identity_is_canonical() -> None:
    a = identity("u", "1", {"x": {"b": 1, "a": [1.5, 2]}, "y": "z"})
    b = identity("u", "1", {"y": "z", "x": {"a": [1.5, 2], "b": 1}})
    assert a == b
    assert identity("u", "2", {"y": "z", "x": {"a": [1.5, 2], "b": 1}}) != a
    assert identity("v", "1", {"y": "z", "x": {"a": [1.5, 2], "b": 1}}) != a


def test_the_default_run_without_an_engine_has_the_spec_figures(tmp_path: Path) -> None:
    """The units alone, chained by hand in the spec's order, give the figures the CLI prints."""
    from conftest import CLEAN_V1

    async def run() -> list[tuple[float, float, int, int]]:
        wids = ["w0", "w1", "w2"]
        sandbox = SandboxSettings(trials_dir=tmp_path / "trials")
        worlds = {w: await build_world(w, snapshots_dir=tmp_path / "snapshots") for w in wids}
        weights, out = hunt_env.initial_weights(wids), []
        for step in range(3):
            rewards = []
            for spec in hunt_env.trial_specs(step, wids, 3, 2):
                traj = await generate(spec, weights, worlds[spec.world_id], sandbox=sandbox, turn_latency=0)
                rewards.append(await verify_and_judge(traj, V1, judge=SimulatedJudge(0)))
            result = await train_step(step, weights, rewards, 2.0)
            weights = result.weights
            out.append((result.mean_reward, result.mean_turns, result.n_trials, weights.version))
        return out

    assert _run(run()) == CLEAN_V1
