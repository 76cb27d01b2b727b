"""A CPU SGLang server for tests: SGLang 0.5.23's own HTTP app, tokenizer manager, detokenizer,
request classes, sampler functions and scheduler-side weight-update code, with a small CPU
stand-in for the parts that need a GPU (the scheduler loop and the model runner).

`python -m tests.sglang_harness.server --model-path DIR --port P [any sglang.launch_server flag]`
runs SGLang's real `launch_server(...)`, handing it `run_cpu_scheduler` as the scheduler process
(SGLang's own extension point, `run_scheduler_process_func`). Everything the trainer talks to over
HTTP is SGLang's code; see scheduler.py for exactly what the stand-in does and does not do.

It needs the layered venv made by scripts/setup_sglang_venv.sh (sglang installed --no-deps beside
this project's torch); tests find it through fixtures.sglang_python()."""
