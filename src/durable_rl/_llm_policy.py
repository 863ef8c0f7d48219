"""An LLM policy: a tool-calling agent loop against an OpenAI-compatible endpoint, acting only
through the sandbox tools of its trial.

Its weights are a reference, not tensors: a model name, an adapter name and a version, carried
as the trial's input, so a new adapter version is a new input (pull-based weight sync). The
request names `{adapter}-v{version}` when an adapter is set (how vLLM and SGLang serve LoRA
adapters by name), else the model. Logprobs, and token ids where the server returns them as
`token_id:N`, are recorded per turn for a trainer to use.
"""

from __future__ import annotations

import json
from typing import Any

from ._llm import ChatResult, Endpoint, Observer, chat
from ._models import AgentTurn, PolicyRef, ToolCall, Trajectory, TrialSpec, Turn
from ._sandbox._tools import SandboxTools, ToolError

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "list_dir",
            "description": "List a folder of the working copy.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a text file of the working copy.",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write a text file of the working copy.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                "required": ["path", "content"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command in the working copy.",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    },
]
TOOL_OUTPUT_LIMIT = 8000


async def _call_tool(tools: SandboxTools, name: str, args: dict[str, Any]) -> tuple[str, bool]:
    try:
        if name == "list_dir":
            return "\n".join(await tools.list_dir(str(args.get("path", ".")))), False
        if name == "read_file":
            return await tools.read_file(str(args["path"])), False
        if name == "write_file":
            await tools.write_file(str(args["path"]), str(args.get("content", "")))
            return "written", False
        if name == "run":
            r = await tools.run(str(args["command"]))
            return f"exit {r.exit_code} ({r.ended_by})\n{r.stdout}{r.stderr}", r.exit_code != 0
        return f"unknown tool {name!r}", True
    except (ToolError, KeyError) as e:
        return f"refused: {e}", True


def _tokens(result: ChatResult) -> tuple[list[float] | None, list[int] | None]:
    if not result.logprobs:
        return None, None
    logprobs = [float(t["logprob"]) for t in result.logprobs]
    tokens = [str(t.get("token", "")) for t in result.logprobs]
    ids = [int(t.removeprefix("token_id:")) for t in tokens] if all(t.startswith("token_id:") for t in tokens) else None
    return logprobs, ids


async def agent_loop(
    endpoint: Endpoint,
    policy: PolicyRef,
    instruction: str,
    tools: SandboxTools,
    *,
    max_turns: int,
    observer: Observer | None = None,
) -> list[AgentTurn]:
    """Let the model act through the tools until it answers without a tool call or runs out of turns."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You act in a working folder through tools. Paths are relative to it."},
        {"role": "user", "content": instruction},
    ]
    served = endpoint.model_copy(update={"model": policy.served_name})
    turns: list[AgentTurn] = []
    for _ in range(max_turns):
        result = await chat(served, messages, observer=observer, tools=TOOLS, logprobs=True)
        message = result.message
        calls: list[ToolCall] = []
        messages.append({k: v for k, v in message.items() if k in ("role", "content", "tool_calls")})
        for call in message.get("tool_calls") or []:
            function = call.get("function", {})
            try:
                args = json.loads(function.get("arguments") or "{}")
                if not isinstance(args, dict):
                    raise ValueError("arguments are not an object")
            except ValueError as e:
                output, failed, args = f"refused: arguments are not JSON ({e})", True, {}
            else:
                output, failed = await _call_tool(tools, str(function.get("name")), args)
            output = output[:TOOL_OUTPUT_LIMIT]
            calls.append(ToolCall(name=str(function.get("name")), arguments=args, result=output, error=failed))
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": output})
        logprobs, token_ids = _tokens(result)
        turns.append(
            AgentTurn(
                content=message.get("content"),
                tool_calls=calls,
                logprobs=logprobs,
                token_ids=token_ids,
                prompt_tokens=result.usage.prompt_tokens,
                completion_tokens=result.usage.completion_tokens,
            )
        )
        if not calls:
            break
    return turns


SECRET_HUNT_PROMPT = (
    "The folder docs/ holds eight documents. One of them has a line 'secret_sha256: <digest>'. "
    "Find it, reading as few documents as you can, and write only the digest to answer.txt."
)


async def secret_hunt_with_llm(
    spec: TrialSpec,
    weights_version: int,
    policy: PolicyRef,
    tools: SandboxTools,
    endpoint: Endpoint,
    *,
    max_turns: int,
) -> Trajectory:
    """A secret-hunt trial played by the LLM policy: its reads become the trajectory's turns."""
    before = set(await tools.list_dir("."))
    turns = await agent_loop(endpoint, policy, SECRET_HUNT_PROMPT, tools, max_turns=max_turns)
    reads: list[Turn] = []
    for call in (c for t in turns for c in t.tool_calls):
        path = str(call.arguments.get("path", ""))
        name = path.removeprefix("./").removeprefix("docs/")
        if call.name == "read_file" and not call.error and name.startswith("doc_") and name.endswith(".txt"):
            reads.append(Turn(doc=int(name[4:-4]), found="secret_sha256:" in call.result))
    after = set(await tools.list_dir("."))
    written = sorted(after - before, key=lambda f: (f != "answer.txt", f))
    try:
        answer = (await tools.read_file("answer.txt")).strip() or None
    except ToolError:
        answer = None
    return Trajectory(
        trial_id=spec.trial_id,
        world_id=spec.world_id,
        weights_version=weights_version,
        turns=reads,
        answer=answer,
        files_written=written,
        agent_turns=turns,
    )
