"""One turn of a session, read top to bottom in ``run.py``; the parts it calls, in order:

    context.py   the branch the turn continues (read under the turn lock)
    hold.py      the turn lock and the generation slot, taken and released together
    prompt.py    the engine request: stored tokens + new messages, sampling fitted
    commit.py    the answer's record and the one fenced, idempotent write

The native ``POST /sessions/{id}/messages`` and the OpenAI-compatible
``POST /v1/responses`` both run their turns here.
"""
