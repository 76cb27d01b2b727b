"""Prompt datasets (jsonl / parquet, verl layout), chat formatting, the resumable sampler, synthetic tasks."""
from megatron_grpo.data.io import load_records, write_records
from megatron_grpo.data.prompts import EncodedPrompt, EncodeStats, encode_prompts, render_chat
from megatron_grpo.data.records import PromptRecord, parse_record
from megatron_grpo.data.sampler import PromptSampler

__all__ = ["load_records", "write_records", "EncodedPrompt", "EncodeStats", "encode_prompts", "render_chat",
           "PromptRecord", "parse_record", "PromptSampler"]
