"""The rollout engine a recipe asks for: the local engine (in the trainer's process or its own) or SGLang servers."""
