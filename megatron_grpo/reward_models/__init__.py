"""Rewards from models: reward models (an HF *ForSequenceClassification's score) and generative
judges (a chat model's answer, parsed), scored in-process with transformers or by SGLang servers
behind one backend interface (backend.py), and combined with the rule reward by
rewards/combined.py. build.py assembles them from reward.models / reward.combine."""
