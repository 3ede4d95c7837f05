"""Chat records -> the conversation a chat template renders: messages, tools and which
assistant turns are learned, checked field by field.

A chat record follows OpenAI's chat and fine-tuning format:

    {"messages": [message, ...], "tools": [tool, ...]}        ("tools" optional)

    role        system, user, assistant or tool
    content     a string, or a list of text parts [{"type": "text", "text": ...}] (joined);
                null only on an assistant turn that has tool_calls
    tool_calls  (assistant) [{"id": ..., "type": "function", "function": {"name": ...,
                "arguments": ...}}]; arguments are a JSON object, or a string holding one, as
                OpenAI writes them (parsed: chat templates render a mapping)
    tool_call_id, name   kept on a tool turn, for the templates that render them
    weight      (assistant) 1, the default (also null): the turn is learned; 0: the turn is context only
    tools       the functions the model may call (JSON schemas), passed to the chat template

A completion record ({"prompt", "completion"}) in a chat run is the conversation of one user
turn and one assistant turn, so chat and completion records mixed in one run are rendered the
same way.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ember.errors import EmberError
from ember.jsonl import TOO_DEEP

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Conversation:
    messages: list[dict[str, Any]]      # as the chat template gets them (no weight)
    tools: list[dict[str, Any]] | None
    learned: list[bool]                 # per assistant turn, in order: is it learned (weight 1)


def conversation(record: Any, where: str) -> Conversation:
    """The conversation of a chat record (or of a completion record: one user and one
    assistant turn), checked; `where` names the record in errors."""
    if isinstance(record, dict) and "messages" not in record and "prompt" in record and "completion" in record:
        for name in ("prompt", "completion"):
            if not isinstance(record[name], str):
                raise EmberError(f"{where}: no string field '{name}'")
        return Conversation([{"role": "user", "content": record["prompt"]},
                             {"role": "assistant", "content": record["completion"]}], None, [True])
    msgs = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(msgs, list) or not msgs:
        raise EmberError(f"{where}: field 'messages' must be a non-empty list of {{role, content}}")
    messages, learned = [], []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise EmberError(f"{where}: messages[{i}] is not an object with 'role' and 'content'")
        role = m.get("role")
        if role not in ROLES:
            raise EmberError(f"{where}: messages[{i}].role = {role!r}; use one of {', '.join(ROLES)}")
        out: dict[str, Any] = {"role": role, "content": ""}
        if role == "assistant" and m.get("tool_calls") is not None:
            out["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}: messages[{i}].tool_calls")
        if m.get("content") is not None or "tool_calls" not in out:
            out["content"] = content_text(m.get("content"), f"{where}: messages[{i}].content")
        if role == "tool":
            out.update({k: m[k] for k in ("tool_call_id", "name") if isinstance(m.get(k), str)})
        if m.get("weight") is not None:  # (null: none, as Arrow gives the turns of a column that has one)
            if role != "assistant":
                raise EmberError(f"{where}: messages[{i}].weight on a {role} turn; a weight (0 or 1) says "
                                 f"whether an assistant turn is learned: remove it from this turn")
            if m["weight"] not in (0, 1):
                raise EmberError(f"{where}: messages[{i}].weight = {m['weight']!r}; use 1 (learned) or 0 "
                                 f"(context only)")
        if role == "assistant":
            learned.append(m.get("weight") in (None, 1))
        messages.append(out)
    if not learned:
        raise EmberError(f"{where}: no assistant message: nothing to learn from this conversation")
    return Conversation(messages, _tools(record.get("tools"), f"{where}: tools"), learned)


def content_text(content: Any, where: str) -> str:
    """A message's text: a string, or OpenAI's list of text parts joined (training's records and
    the inference engine's requests alike)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise EmberError(f"{where}[{j}] is a {kind!r} part; only text parts "
                                 f"({{\"type\": \"text\", \"text\": ...}}) are read")
            texts.append(part["text"])
        return "".join(texts)
    if content is None:
        raise EmberError(f"{where} is null; only an assistant turn with tool_calls may have no content")
    raise EmberError(f"{where} must be a string or a list of text parts")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls, their arguments parsed to a mapping."""
    if not isinstance(calls, list) or not calls:
        raise EmberError(f"{where} must be a non-empty list of {{\"type\": \"function\", \"function\": "
                         f"{{\"name\", \"arguments\"}}}}")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EmberError(f"{where}[{j}] has no function.name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise EmberError(f"{where}[{j}].function.arguments is not valid JSON ({e.msg})") from None
            except RecursionError:  # json's parser recurses once per nesting level
                raise EmberError(f"{where}[{j}].function.arguments is not valid JSON ({TOO_DEEP})") from None
        if not isinstance(args, dict):
            raise EmberError(f"{where}[{j}].function.arguments must be a JSON object")
        out.append({**{k: v for k, v in call.items() if k != "function"}, "type": call.get("type", "function"),
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def _tools(tools: Any, where: str) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and tool_name(t) for t in tools):
        raise EmberError(f"{where} must be a list of {{\"type\": \"function\", \"function\": {{\"name\", "
                         f"\"description\", \"parameters\"}}}}")
    return tools or None


def tool_name(tool: dict[str, Any]) -> str | None:
    """The function name of a tool schema (OpenAI's {"function": {"name"}} or a bare {"name"})."""
    fn = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    return fn.get("name") if isinstance(fn.get("name"), str) else None
