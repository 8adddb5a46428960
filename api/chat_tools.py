"""A chat request's messages and tools as the chat template gets them, on a node and on the
router alike (so both produce the same token ids).

Tools reach the model through the template's `tools` when the template uses them; a
template without tool support (SmolLM2's) gets them described in a system message, with
the Hermes `<tool_call>` convention. Earlier assistant `tool_calls` are rendered as
`<tool_call>` text for such templates. `tool_choice: none` shows no tools.
"""

from __future__ import annotations

import json
import re

from pdserve.api.protocol import ChatCompletionRequest

TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def template_tools(
    req: ChatCompletionRequest, chat_template: str | None
) -> tuple[list[dict], dict]:
    """(messages, extra template kwargs): tools for the template, or a system message."""
    messages = [_render_calls(m.to_template_dict()) for m in req.messages]
    if not req.tools or req.tool_choice == "none":
        return messages, {}
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if "tools" in (chat_template or ""):
        return messages, {"tools": tools}
    text = (
        "You can call these functions. To call one, reply with "
        '<tool_call>{"name": <function name>, "arguments": <arguments object>}</tool_call>.\n'
        + "\n".join(json.dumps(t["function"]) for t in tools)
    )
    if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
    else:
        messages.insert(0, {"role": "system", "content": text})
    return messages, {}


def _render_calls(msg: dict) -> dict:
    """An assistant turn's earlier tool calls, as text for templates that drop them."""
    calls = msg.pop("tool_calls", None)
    if calls:
        rendered = "".join(
            "<tool_call>"
            + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
            + "</tool_call>"
            for c in calls
        )
        msg["content"] = (msg.get("content") or "") + rendered
    return msg


def strip_tool_calls(text: str) -> str:
    """A reply without its <tool_call> blocks (its content next to the calls)."""
    return TOOL_CALL.sub("", text).strip()
