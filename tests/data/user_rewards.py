"""User reward functions for tests/test_rewards.py, loaded by path ("tests/data/user_rewards.py:fn")."""
import os
import time


def length_match(prompt, response, ground_truth, extra):
    """Scores by the response; misbehaves on purpose when the response asks it to."""
    if response == "raise":
        raise ValueError("this response makes the reward function raise")
    if response == "hang":
        time.sleep(3600)
    if response == "die":
        os._exit(3)
    if response == "text":
        return "not a number"
    return {"score": float(response == ground_truth), "length": float(len(response))}


def batched_match(prompts, responses, ground_truths, extras):
    if "raise" in responses:
        raise RuntimeError("a chunk that contains 'raise' fails")
    return [float(r == g) + extra.get("bonus", 0.0) for r, g, extra in zip(responses, ground_truths, extras)]


def scaled(prompt, response, ground_truth, extra, *, factor=1.0):
    return factor * float(response == ground_truth)
