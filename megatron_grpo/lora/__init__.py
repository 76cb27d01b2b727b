"""LoRA: adapters beside the policy's linear layers (adapters.py, targets.py, attach.py) and PEFT adapter
folders in and out (peft_folder.py)."""
