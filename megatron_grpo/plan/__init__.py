"""Memory planning: a recipe's per-rank device memory through a GRPO step, simulated with the real
model and step code on fake tensors (`megatron-grpo plan`; docs/memory-plan.md).

  tracker.py          live bytes by phase and category (a TorchDispatchMode)
  fake_rank.py        one rank of a large job in this process (fake process group, fake tensors)
  stage.py            one pipeline stage through the step's phases (attention: a fused kernel's
                      memory, ops/flash_attention_memory.py)
  train_step.py       one train step alone (the GPU kit compares it with the CUDA allocator)
  cluster.py          placement on the cluster, the model's config.json (hub_configs.json)
  engines.py          SGLang KV capacity and the weight-sync volume (arithmetic)
  recipe_plan.py      the whole recipe; report.py / summary.py: table, refusal line, JSON
  cli.py              the command
"""
