"""Agent and chat frameworks, unchanged, holding multi-turn conversations with the service.

Runs inside the frameworks' own environment (``bench/compat/envs.sh frameworks``),
never the project's: it imports the frameworks and the standard library only. Each
framework keeps its conversation its own way (LangChain: a message list; the OpenAI
Agents SDK: ``to_input_list()`` on chat completions, ``previous_response_id`` on the
Responses API; Pydantic AI: ``message_history``). Per turn it prints, as one JSON line,
the prompt tokens the service was asked for and those its prefix cache served, read
from the service's ``/metrics`` (a local-mode service: no key) around the turn.

    <env>/bin/python bench/compat/framework_chats.py --url http://127.0.0.1:8000 --model M
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import urllib.request
from collections.abc import Callable

QUESTIONS = (
    "Name three things a bicycle needs to work.",
    "Which of them wears out first?",
    "How do I know when to replace it?",
)
SYSTEM = "You are a helpful assistant. Answer in two sentences."
_QUERIES = re.compile(r"^chatsvc_prefix_cache_queries_tokens_total\{[^}]*\} (\S+)$", re.M)
_HITS = re.compile(r"^chatsvc_prefix_cache_hits_tokens_total\{[^}]*\} (\S+)$", re.M)


def cache_counts(url: str) -> tuple[float, float]:
    """(prompt tokens looked up, tokens served from the cache) so far."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as answer:
        text = answer.read().decode()
    return sum(map(float, _QUERIES.findall(text))), sum(map(float, _HITS.findall(text)))


def conversation(name: str, url: str, turn: Callable[[str], str]) -> None:
    for number, question in enumerate(QUESTIONS, 1):
        queried, hit = cache_counts(url)
        answer = turn(question)
        queried_after, hit_after = cache_counts(url)
        record = {
            "framework": name,
            "turn": number,
            "prompt_tokens": int(queried_after - queried),
            "cached_tokens": int(hit_after - hit),
            "answer": answer[:80],
        }
        print(json.dumps(record), flush=True)


def langchain(base: str, model: str, system: str, max_tokens: int, responses: bool):
    from langchain_core.messages import HumanMessage, SystemMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        base_url=base, api_key="unused", model=model, max_tokens=max_tokens,
        temperature=0, use_responses_api=responses,
    )  # fmt: skip
    history: list = [SystemMessage(system)]

    def turn(question: str) -> str:
        history.append(HumanMessage(question))
        reply = llm.invoke(history)
        history.append(reply)  # the framework's own message, replayed next turn
        return reply.text if isinstance(reply.text, str) else reply.text()

    return turn


def openai_agents(base: str, model: str, system: str, max_tokens: int, responses: bool):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    state: dict = {"items": [], "previous": None}

    async def ask(question: str) -> str:
        client = AsyncOpenAI(base_url=base, api_key="unused")  # one per event loop
        kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
        agent = Agent(
            name="assistant", instructions=system,
            model=kind(model=model, openai_client=client),
            model_settings=ModelSettings(max_tokens=max_tokens, temperature=0),
        )  # fmt: skip
        if responses:  # the server keeps the conversation: send the new message only
            result = await Runner.run(agent, question, previous_response_id=state["previous"])
            state["previous"] = result.last_response_id
        else:
            items = state["items"] + [{"role": "user", "content": question}]
            result = await Runner.run(agent, items)
            state["items"] = result.to_input_list()
        await client.close()
        return str(result.final_output)

    return lambda question: asyncio.run(ask(question))


def pydantic_ai(base: str, model: str, system: str, max_tokens: int, responses: bool):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    chat_model = OpenAIChatModel(model, provider=OpenAIProvider(base_url=base, api_key="unused"))
    agent = Agent(
        chat_model, instructions=system,
        model_settings={"max_tokens": max_tokens, "temperature": 0},
    )  # fmt: skip
    history: list = []

    def turn(question: str) -> str:
        result = agent.run_sync(question, message_history=history)
        history[:] = result.all_messages()
        return result.output

    return turn


FRAMEWORKS = {
    "langchain (chat completions)": (langchain, False),
    "langchain (responses)": (langchain, True),
    "openai-agents (chat completions)": (openai_agents, False),
    "openai-agents (responses)": (openai_agents, True),
    "pydantic-ai (chat completions)": (pydantic_ai, False),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--max-tokens", type=int, default=200)
    args = parser.parse_args()
    base = args.url + "/v1"
    for name, (make, responses) in FRAMEWORKS.items():
        # A system prompt of its own: no framework's turn is served by another's blocks.
        system = f"{SYSTEM} This conversation runs on {name}."
        conversation(name, args.url, make(base, args.model, system, args.max_tokens, responses))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
