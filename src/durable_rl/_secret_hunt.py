"""The secret-hunt environment, policy, judge and trainer, exactly as spec/secret-hunt.md says.

Every figure the demo prints follows from the random streams below; latencies never change one.
"""

from __future__ import annotations

import asyncio
import hashlib
import random

from ._models import JudgeAnswer, PolicyRef, Reward, Rubric, Trajectory, TrialSpec, Turn, Weights
from ._sandbox._tools import SandboxTools

N_DOCS = 8
PROMPT = "find the secret"
SIMULATED_JUDGE_MODEL = "simulated-judge"


class InjectedFailure(RuntimeError):
    """A failure the run's fault-injection settings asked for."""


def seed(*parts: str) -> int:
    """The spec's seed: the first 32 bits of sha256 over the parts joined by '|'."""
    return int(hashlib.sha256("|".join(parts).encode("utf-8")).hexdigest()[:8], 16)


def _world_secret(world_id: str) -> tuple[int, str]:
    r = random.Random(seed("world", world_id))
    secret_doc = r.randrange(N_DOCS)
    return secret_doc, f"{world_id}-secret-{r.randrange(10**6):06d}"


def world_digest(world_id: str) -> str:
    """sha256 of the world's secret: the only form of it that is written or compared."""
    return hashlib.sha256(_world_secret(world_id)[1].encode("utf-8")).hexdigest()


def world_files(world_id: str) -> dict[str, str]:
    """The world's documents: relative path to text."""
    secret_doc, _ = _world_secret(world_id)
    files = {}
    for i in range(N_DOCS):
        lines = [f"title: report {i} for {world_id}", f"owner: team-{i % 3}", f"pages: {10 + i}"]
        if i == secret_doc:
            lines.append(f"secret_sha256: {world_digest(world_id)}")
        files[f"docs/doc_{i}.txt"] = "\n".join(lines) + "\n"
    return files


def trial_specs(step: int, world_ids: list[str], prompts_per_step: int, n_samples: int) -> list[TrialSpec]:
    """The trials of one step, in the spec's order."""
    return [
        TrialSpec(
            trial_id=f"s{step}-p{p}-n{s}",
            step=step,
            world_id=world_ids[p % len(world_ids)],
            prompt=PROMPT,
        )
        for p in range(prompts_per_step)
        for s in range(n_samples)
    ]


def initial_weights(world_ids: list[str], policy: PolicyRef | None = None) -> Weights:
    """Version 0: a uniform prior over documents in every world (and an LLM policy's first version)."""
    return Weights(version=0, doc_prior={w: [1.0] * N_DOCS for w in world_ids}, policy=policy)


async def hunt(
    spec: TrialSpec,
    weights: Weights,
    tools: SandboxTools,
    *,
    attempt: int,
    flaky_trial_rate: float,
    turn_latency: float,
    hang: bool = False,
) -> Trajectory:
    """The bandit agent, through its sandbox tools: read documents in prior order until found."""
    rng = random.Random(seed("trial", spec.trial_id))
    u = rng.random()  # drawn on every attempt, so a retry follows the unfailed trajectory
    if attempt == 0 and u < flaky_trial_rate:
        raise InjectedFailure(f"injected sandbox failure for {spec.trial_id} (attempt 0)")

    prior = list(weights.doc_prior.get(spec.world_id) or [1.0] * N_DOCS)
    order: list[int] = []
    remaining = list(range(N_DOCS))
    while remaining:
        pick = rng.choices(remaining, weights=[prior[i] for i in remaining], k=1)[0]
        order.append(pick)
        remaining.remove(pick)

    turns: list[Turn] = []
    answer: str | None = None
    for doc in order[: spec.max_turns]:
        text = await tools.read_file(f"docs/doc_{doc}.txt")
        found = "secret_sha256:" in text
        turns.append(Turn(doc=doc, found=found))
        if hang:  # a tool call that never returns: only the trial's timeout ends it
            await asyncio.Event().wait()
        await asyncio.sleep(turn_latency)  # one tool call
        if found:
            answer = text.split("secret_sha256:")[1].strip()
            break

    written = ["answer.txt"]
    await tools.write_file("answer.txt", answer or "")
    if rng.random() < 0.3:  # an untidy agent leaves a scratch file behind
        await tools.write_file("scratch.tmp", "notes")
        written.append("scratch.tmp")
    return Trajectory(
        trial_id=spec.trial_id,
        world_id=spec.world_id,
        weights_version=weights.version,
        turns=turns,
        answer=answer,
        files_written=written,
    )


def sandbox_flakes(trial_id: str, attempt: int, flaky_trial_rate: float) -> bool:
    """The spec's injected sandbox failure: the trial stream's first draw, on the first attempt."""
    return attempt == 0 and random.Random(seed("trial", trial_id)).random() < flaky_trial_rate


def verify(traj: Trajectory) -> bool:
    """The deterministic verifier: did the agent report its world's digest?"""
    return traj.answer == world_digest(traj.world_id)


class SimulatedJudge:
    """Stands in for a vendor LLM judge: a seeded score after `latency` seconds."""

    model = SIMULATED_JUDGE_MODEL

    def __init__(self, latency: float = 0.5) -> None:
        self.latency = latency

    async def judge(self, traj: Trajectory, rubric: Rubric) -> JudgeAnswer:
        await asyncio.sleep(self.latency)  # the network round trip
        rj = random.Random(seed("judge", traj.trial_id, rubric.name))
        correct = 1.0 if verify(traj) else 0.0
        efficiency = max(0.0, 1.0 - (len(traj.turns) - 1) / N_DOCS)
        tidy = 1.0 if traj.files_written == ["answer.txt"] else 0.0
        score = (
            rubric.correctness_weight * correct
            + rubric.efficiency_weight * efficiency
            + rubric.tidiness_weight * tidy
            + rj.uniform(-0.05, 0.05)
        )
        return JudgeAnswer(score=round(score, 3), model=self.model)


def judge_task_flakes(trial_id: str, attempt: int, judge_flake_rate: float) -> bool:
    """Whether the run's fault injection fails this judge task after the judge answered."""
    return attempt == 0 and random.Random(seed("flake", trial_id)).random() < judge_flake_rate


def to_reward(traj: Trajectory, verified: bool, answer: JudgeAnswer) -> Reward:
    """Combine the verifier's verdict and the judge's score into the trainer's reward."""
    return Reward(
        trial_id=traj.trial_id,
        world_id=traj.world_id,
        verified_correct=verified,
        n_turns=len(traj.turns),
        judge_score=answer.score,
        reward=round((1.0 if verified else 0.0) + answer.score, 3),
        found_doc=next((t.doc for t in traj.turns if t.found), None),
    )


def bandit_update(weights: Weights, rewards: list[Reward], lr: float) -> Weights:
    """Move each world's prior toward the documents where rewarded trials found the secret."""
    prior = {w: list(p) for w, p in weights.doc_prior.items()}
    for r in sorted(rewards, key=lambda r: r.trial_id):  # float sums in one canonical order
        if r.found_doc is not None and r.reward > 0:
            prior.setdefault(r.world_id, [1.0] * N_DOCS)[r.found_doc] += lr * r.reward
    policy = weights.policy.model_copy(update={"version": weights.version + 1}) if weights.policy else None
    return Weights(version=weights.version + 1, doc_prior=prior, policy=policy)
