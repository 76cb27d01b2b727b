"""`megatron-grpo doctor`: what a recipe needs against what this node has, before a job spends its
allocation finding out (report.py: the table; tested.py: the tested versions; node.py: this node's
probes; needs.py: the recipe's checks; cli.py: the command)."""
