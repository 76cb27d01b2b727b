"""ServerRotation (rollout/sglang/rotation.py), the one server choice of the rollout client and
the reward models' scorers: turns, the failure cooldown, and the tiers of a request's retries."""
from __future__ import annotations

from megatron_grpo.rollout.sglang.rotation import ServerRotation

A, B, C = "http://a:1", "http://b:1", "http://c:1"


def test_turns_cooldown_and_the_tiers_of_a_retry():
    rotation = ServerRotation([A + "/", B, C], dead_cooldown_s=60.0)
    assert rotation.urls == [A, B, C]
    assert [rotation.first_tier([])[0] for _ in range(4)] == [A, B, C, A]  # round robin
    rotation.mark_dead(B)
    assert rotation.is_dead(B) and B not in rotation.first_tier([])
    assert rotation.first_tier([A])[0] == C  # live and untried first
    assert set(rotation.first_tier([A, C])) == {A, C}  # then any live one
    rotation.mark_dead(A)
    rotation.mark_dead(C)
    assert rotation.first_tier([A, C]) == [B]  # all dead: one not tried yet
    assert len(rotation.first_tier([A, B, C])) == 3  # then any
    rotation.set_urls([B, C])  # found alive again (restarted): no cooldown left
    assert not rotation.is_dead(B) and not rotation.is_dead(C) and rotation.urls == [B, C]


def test_an_expired_cooldown_returns_the_server():
    rotation = ServerRotation([A, B], dead_cooldown_s=0.0)
    rotation.mark_dead(A)
    assert not rotation.is_dead(A) and A in rotation.first_tier([])
