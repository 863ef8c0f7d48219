"""An LLM judge: a rubric of named, weighted criteria becomes a chat-completion request; the
answer must be a JSON object of per-criterion scores, or it is asked again, then refused.

Two hooks make a judge: `build_prompt` and `parse_answer`; subclass to change either.
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import Field

from ._llm import ChatResult, Endpoint, Observer, chat
from ._models import JudgeAnswer, Rubric, Trajectory, _Frozen


class JudgeAnswerInvalid(RuntimeError):
    """The judge's answers did not follow the schema, after every re-ask."""


class Criterion(_Frozen):
    """One thing the judge scores, from 0 to 1."""

    name: str
    weight: float
    description: str


DEFAULT_TEMPLATE = """You are grading one attempt of an agent at a task.

Criteria (score each from 0.0 to 1.0):
{criteria}

The attempt, as JSON:
{trajectory}

Reply with only a JSON object, no prose: {{"scores": {{{schema}}}}}"""


class JudgeRubric(_Frozen):
    """Named criteria with weights, and the prompt that asks for them."""

    name: str
    criteria: list[Criterion]
    template: str = Field(DEFAULT_TEMPLATE, description="Prompt with {criteria}, {trajectory} and {schema}.")


def secret_hunt_rubric(rubric: Rubric) -> JudgeRubric:
    """The secret-hunt criteria, weighted as `rubric` weighs them."""
    return JudgeRubric(
        name=rubric.name,
        criteria=[
            Criterion(
                name="correctness",
                weight=rubric.correctness_weight,
                description="the answer is the secret's sha256 digest found in a document",
            ),
            Criterion(
                name="efficiency",
                weight=rubric.efficiency_weight,
                description="few documents read before the answer (1.0 for one, 0.0 for nine)",
            ),
            Criterion(
                name="tidiness", weight=rubric.tidiness_weight, description="the agent left only answer.txt behind"
            ),
        ],
    )


class LLMJudge:
    """Judges through an OpenAI-compatible endpoint; `model` is part of every answer's identity."""

    def __init__(
        self,
        endpoint: Endpoint,
        *,
        price_per_mtok: tuple[float, float] = (0.0, 0.0),
        max_reasks: int = 2,
        observer: Observer | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.model = endpoint.model
        self.price_per_mtok = price_per_mtok
        self.max_reasks = max_reasks
        self.observer = observer

    def build_prompt(self, traj: Trajectory, rubric: JudgeRubric) -> list[dict[str, Any]]:
        """The request's messages (hook)."""
        criteria = "\n".join(f"- {c.name}: {c.description}" for c in rubric.criteria)
        schema = ", ".join(f'"{c.name}": <0..1>' for c in rubric.criteria)
        attempt = traj.model_dump(mode="json")
        text = rubric.template.format(criteria=criteria, trajectory=json.dumps(attempt, sort_keys=True), schema=schema)
        return [{"role": "user", "content": text}]

    def parse_answer(self, content: str, rubric: JudgeRubric) -> dict[str, float]:
        """Per-criterion scores from the answer, or ValueError saying what is wrong (hook)."""
        try:
            data = json.loads(content)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e.msg})") from None
        scores = data.get("scores") if isinstance(data, dict) else None
        if not isinstance(scores, dict):
            raise ValueError('no "scores" object')
        names = {c.name for c in rubric.criteria}
        if set(scores) != names:
            raise ValueError(f"scores must name exactly {sorted(names)}, got {sorted(scores)}")
        out = {}
        for name, value in scores.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 <= value <= 1.0:
                raise ValueError(f"score {name!r} must be a number from 0 to 1, got {value!r}")
            out[name] = float(value)
        return out

    async def judge(self, traj: Trajectory, rubric: Rubric) -> JudgeAnswer:
        """Ask, re-ask on a malformed answer, and combine the criteria by their weights."""
        judge_rubric = secret_hunt_rubric(rubric)
        messages = self.build_prompt(traj, judge_rubric)
        t0 = time.monotonic()
        results: list[ChatResult] = []
        counter = _CountingObserver(self.observer)
        problem = ""
        for _ in range(self.max_reasks + 1):
            result = await chat(self.endpoint, messages, observer=counter, response_format={"type": "json_object"})
            results.append(result)
            content = result.message.get("content") or ""
            try:
                scores = self.parse_answer(content, judge_rubric)
            except ValueError as e:
                problem = str(e)
                messages = [
                    *messages,
                    {"role": "assistant", "content": content},
                    {
                        "role": "user",
                        "content": f"That answer was invalid: {problem}. Reply with only the JSON object.",
                    },
                ]
                continue
            prompt = sum(r.usage.prompt_tokens for r in results)
            completion = sum(r.usage.completion_tokens for r in results)
            return JudgeAnswer(
                score=round(sum(c.weight * scores[c.name] for c in judge_rubric.criteria), 3),
                model=self.model,
                scores=scores,
                raw=result.raw,
                requests=counter.n,
                prompt_tokens=prompt,
                completion_tokens=completion,
                latency_s=round(time.monotonic() - t0, 4),
                cost_usd=round((prompt * self.price_per_mtok[0] + completion * self.price_per_mtok[1]) / 1e6, 8),
            )
        raise JudgeAnswerInvalid(f"{self.model} answered {len(results)} times without valid scores: {problem}")


class _CountingObserver:
    def __init__(self, inner: Observer | None) -> None:
        self.inner, self.n = inner, 0

    async def before_request(self, n: int) -> None:
        self.n += 1
        if self.inner is not None:
            await self.inner.before_request(self.n)

    async def after_request(self, n: int, outcome: str, result: ChatResult | None) -> None:
        if self.inner is not None:
            await self.inner.after_request(self.n, outcome, result)
