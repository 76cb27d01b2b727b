"""Environments for multi-turn, tool-calling rollouts (rollout.multi_turn): what the policy talks to
between its turns. See docs/architecture.md for what this package may import."""
