"""Assembling a run: the HF folder the policy starts from, the prompts, the optimizer and its non-finite guard."""
