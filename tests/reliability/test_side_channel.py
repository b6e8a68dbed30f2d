"""Prefix-cache timing side channel, in the spirit of the published attacks.

InputSnatch (2024), "I Know What You Asked" (NDSS 2025) and CVE-2025-46570
(vLLM) time a request whose prompt may share a prefix with another user's: a
prefix-cache hit skips that prefill and answers measurably sooner. chatsvc keys
every block holding a private token with the tenant's secret salt, so another
tenant's guess can never hit; only blocks wholly inside a *shared* system
prompt are public, on purpose.

Each trial the victim (acme) holds a fresh private text of ~100 tokens, warm
in the cache; the attacker (globex) sends that text and a decoy of the same
token length, in random order, with ``max_tokens=1``, and times each answer.
Fresh texts each trial mean the attacker never hits its own earlier guesses.
Scoring "faster = hit", the attacker's ROC AUC (Mann-Whitney) must be at
chance. The positive control runs the same measurement on shared system
prompts: there the hit is real, both tenants see cached tokens, and the AUC is
high, which shows the measurement can see a hit when one exists.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

pytestmark = pytest.mark.slow

# Under the null the AUC over n x n pairs has a standard deviation of
# sqrt((2n + 1) / (12 n^2)): 0.033 at 150, so the bound below is 3 sigma (a run
# without any leak fails ~0.1% of the time), while a hit the size of the positive
# control's (AUC 0.94-1.0 measured) lands far above it.
PRIVATE_TRIALS = 150
PRIVATE_AUC_BOUND = 0.60
SHARED_TRIALS = 40
TEXT_WORDS = 64  # single-token words: 96 prompt tokens, 5 of 6 full blocks a hit would skip
BLOCK_SIZE = 16  # the reliability server's (tests/reliability/conftest.py)
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect class control care field development role effort rate heart drug show "
    "leader light voice wife police mind price report decision son view relationship town road"
).split()


def auc(positives: list[float], negatives: list[float]) -> float:
    """ROC AUC of scores (higher = "positive"): the Mann-Whitney U over n1*n2, ties half."""
    wins = 0.0
    for p in positives:
        for n in negatives:
            wins += 1.0 if p > n else 0.5 if p == n else 0.0
    return wins / (len(positives) * len(negatives))


def test_auc_is_the_mann_whitney_statistic():
    assert auc([3, 4], [1, 2]) == 1.0
    assert auc([1, 2], [3, 4]) == 0.0
    assert auc([1, 3], [2, 2]) == 0.5
    assert auc([2], [2]) == 0.5


def single_token_words(tokenizer) -> list[str]:
    words = [w for w in WORDS if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1]
    assert len(words) >= 100, "too few single-token words to build equal-length texts"
    return words


def random_text(rng: random.Random, words: list[str]) -> str:
    # Every word is one token with its leading space, so equal word counts give
    # prompts of exactly equal token length (the test checks prompt_tokens too).
    return "Note:" + "".join(" " + rng.choice(words) for _ in range(TEXT_WORDS))


def own_head_blocks(fmt, secret: str, decoy: str) -> int:
    """Full blocks of the prompt that precede anything private: the longest prefix
    the true prompt shares with a decoy the attacker wrote itself."""
    ours = fmt.render([{"role": "user", "content": secret}])
    theirs = fmt.render([{"role": "user", "content": decoy}])
    pairs = enumerate(zip(ours, theirs, strict=False))
    common = next((i for i, (a, b) in pairs if a != b), min(len(ours), len(theirs)))
    return common // BLOCK_SIZE


def ask(http: httpx.Client, model: str, messages: list[dict], **extension) -> tuple[float, dict]:
    """One max_tokens=1 completion: (client-side seconds, usage). The attacker's view.
    ``extension``: body fields beyond OpenAI's (``system_prompt_id``)."""
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0, **extension}
    started = time.perf_counter()
    response = http.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - started
    assert response.status_code == 200, response.text
    return elapsed, response.json()["usage"]


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def timed_pair(
    attacker, model, true_messages, decoy_messages, rng, **true_extension
) -> dict[str, tuple]:
    """The true guess and the decoy, sent in random order: {label: (seconds, usage)}."""
    order = [("true", true_messages, true_extension), ("decoy", decoy_messages, {})]
    rng.shuffle(order)
    return {label: ask(attacker, model, messages, **ext) for label, messages, ext in order}


# Three prefills a trial: in fp32 on one core (an AVX2 machine, one OpenMP thread per
# pytest worker) beside the other worker's suites, it may need more than the suite's
# per-test guard (its times: docs/reliability.md, section 7).
@pytest.mark.timeout(1800)
def test_attacker_timing_cannot_tell_a_private_hit_and_a_shared_prompt_is_shared(
    server, acme, globex, admin
):
    rng = random.Random(20250)
    words = single_token_words(server.services.engine.tokenizer)
    block = server.services.engine.cache_stats()["block_size"]
    assert block == BLOCK_SIZE
    model = server.services.engine.model_name
    fmt = server.services.engine.chat_format
    hit_scores, miss_scores, leaked = [], [], []
    for _ in range(PRIVATE_TRIALS):
        secret, decoy = random_text(rng, words), random_text(rng, words)
        _, victim_usage = ask(acme, model, [{"role": "user", "content": secret}])
        _, victim_again = ask(acme, model, [{"role": "user", "content": secret}])
        # The victim's own repeat hits: the cache is on and the text is warm.
        assert cached(victim_again) >= victim_usage["prompt_tokens"] - 2 * block
        pair = timed_pair(
            globex,
            model,
            [{"role": "user", "content": secret}],
            [{"role": "user", "content": decoy}],
            rng,
        )
        (t_true, u_true), (t_decoy, u_decoy) = pair["true"], pair["decoy"]
        assert u_true["prompt_tokens"] == u_decoy["prompt_tokens"]
        # The attacker may hit only blocks it computed itself: the template's head
        # that every one of its prompts starts with. (Comparing the true guess
        # with the decoy is not enough: when that block was evicted, whichever of
        # the pair goes first recomputes it and the second one hits it.)
        head = own_head_blocks(fmt, secret, decoy) * block
        if cached(u_true) > head:
            leaked.append((cached(u_true), head))
        hit_scores.append(-t_true)
        miss_scores.append(-t_decoy)
    private_auc = auc(hit_scores, miss_scores)

    shared_hit, shared_miss, both_cached = [], [], []
    for i in range(SHARED_TRIALS):
        text, decoy = random_text(rng, words), random_text(rng, words)
        # Shared prompts are the operator's; a request shares one only by naming it.
        created = admin.post("/admin/system-prompts", json={"name": f"shared-{i}", "text": text})
        assert created.status_code == 201, created.text
        shared_id = created.json()["id"]
        question = {"role": "user", "content": "Hi"}
        ask(acme, model, [question], system_prompt_id=shared_id)
        pair = timed_pair(
            globex,
            model,
            [dict(question)],
            [{"role": "system", "content": decoy}, dict(question)],
            rng,
            system_prompt_id=shared_id,
        )
        (t_true, u_true), (t_decoy, u_decoy) = pair["true"], pair["decoy"]
        # And the other way round: the victim's next use hits the same public blocks.
        _, victim_again = ask(acme, model, [question], system_prompt_id=shared_id)
        both_cached.append((cached(victim_again), cached(u_true), cached(u_decoy)))
        shared_hit.append(-t_true)
        shared_miss.append(-t_decoy)
    shared_auc = auc(shared_hit, shared_miss)

    print(
        f"private prefix: AUC {private_auc:.3f} over {PRIVATE_TRIALS} trials; "
        f"shared system prompt (positive control): AUC {shared_auc:.3f} over {SHARED_TRIALS}; "
        f"median attacker latency true/decoy: "
        f"{sorted(-s for s in hit_scores)[PRIVATE_TRIALS // 2] * 1000:.0f} / "
        f"{sorted(-s for s in miss_scores)[PRIVATE_TRIALS // 2] * 1000:.0f} ms; "
        f"shared cached tokens (victim again, attacker true, attacker decoy) e.g. "
        f"{both_cached[-1]}"
    )
    assert leaked == [], f"the attacker's cached tokens depend on the victim's text: {leaked}"
    # The shared prompt is shared: the attacker's first use of it hits A's blocks.
    for victim, attacker_true, attacker_decoy in both_cached:
        assert min(victim, attacker_true) >= TEXT_WORDS - block > attacker_decoy
    assert shared_auc >= 0.8, "the positive control saw no hit: the timing test is blind"
    assert private_auc <= PRIVATE_AUC_BOUND
