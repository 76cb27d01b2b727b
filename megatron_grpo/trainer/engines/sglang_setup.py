"""rollout.engine=sglang: the recipe's rollout.sglang section -> servers, client, weight transport.

Servers are either given (`rollout.sglang.urls`, e.g. started by the sbatch scripts) or launched
here on this node (`num_engines` x `tp_size` GPUs, ports port, port+1, ...). The key they answer to
comes from $rollout.sglang.api_key_env, or is made here, for this run only, when they start here. Weights and control
calls always go to every engine directly; a router, if any, only serves /generate.
"""
from __future__ import annotations

import logging
import os
import secrets
import sys
from pathlib import Path

import torch

from megatron_grpo.config.derived import engine_kv_tokens, engine_memory_released, rollouts_run_ahead
from megatron_grpo.config.schema import Config
from megatron_grpo.errors import ConfigError, MegatronGRPOError

log = logging.getLogger(__name__)


# DeepSeek's own config.json keys that SGLang 0.5.23's DeepseekV2/V3 model reads as attributes
# (models/deepseek_v2.py: config.moe_layer_freq in _is_layer_sparse, config.topk_method in the gate,
# config.scoring_func in the MoE's top-k) and transformers' DeepseekV3Config does not define, so a
# config.json written by transformers' save_pretrained lacks them and SGLang stops at load with an
# AttributeError. The values are the only ones models/hf_config.py accepts.
# SGLang's --dtype for the trainer's dtype: launched engines serve in it (its `auto` would serve an
# fp32 checkpoint, such as initial_model/, in float16).
SGLANG_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}

SGLANG_DEEPSEEK_KEYS = {"moe_layer_freq": 1, "topk_method": "noaux_tc", "scoring_func": "sigmoid"}


def check_sglang_model(model_dir: Path):
    """ConfigError when SGLang's model class for this checkpoint would serve other math than ours, or
    cannot load its config.json; else the model's ModelArchitecture."""
    import json

    from megatron_grpo.models.hf_config import ModelArchitecture

    model = ModelArchitecture.from_hf(model_dir)
    missing = {k: v for k, v in SGLANG_DEEPSEEK_KEYS.items() if k not in model.hf_config}
    if model.architecture == "deepseek_v3" and missing:
        config_file = Path(model_dir) / "config.json" if Path(model_dir).is_dir() else Path(model_dir)
        raise ConfigError(f"rollout.engine=sglang: {config_file} lacks {sorted(missing)}: DeepSeek's own config.json "
                          f"keys, which SGLang 0.5.23's DeepseekV3ForCausalLM reads and transformers' "
                          f"DeepseekV3Config does not write (a config saved by transformers drops them); add "
                          f"{json.dumps(missing)[1:-1]} to it, as DeepSeek's published config.json has them")
    if model.spec.sglang_every_layer_sparse and model.dense_layers:
        raise ConfigError(f"rollout.engine=sglang: {model_dir}: model_type {model.architecture!r} with dense layers "
                          f"{list(model.dense_layers)} (mlp_only_layers / decoder_sparse_step): SGLang 0.5.23's "
                          f"{model.spec.hf_class} builds every layer sparse and skips their weights; use "
                          f"rollout.engine=local")
    return model


def routed_experts_shape(cfg: Config, model) -> tuple[int, int] | None:
    """(num_hidden_layers, num_experts_per_tok) when the trainer replays the engines' routes (the
    layout of SGLang's return_routed_experts), else None."""
    if not cfg.actor.moe_routing_replay:
        return None
    if not model.moe_layers:
        raise ConfigError(f"actor.moe_routing_replay=true: model_type {model.architecture!r} has no experts")
    return model.num_layers, model.moe_top_k


def launched_server_settings(cfg: Config, model_dir: Path, api_key: str | None, routed_experts: bool,
                             dtype: torch.dtype, command: tuple[str, ...]) -> list:
    """The ServerSettings of the engines this trainer launches (rollout.sglang, ports port, port+1, ...)."""
    from megatron_grpo.rollout.sglang.launcher import ServerSettings

    s = cfg.rollout.sglang
    return [ServerSettings(model_path=str(model_dir), tokenizer_path=cfg.model.tokenizer_path, tp_size=s.tp_size,
                           mem_fraction_static=s.mem_fraction,
                           host=s.host, port=s.port + i, api_key=api_key,
                           enable_memory_saver=engine_memory_released(cfg),
                           # colocated: engine i on GPUs i*tp.. (rollout/sglang/colocated.py)
                           base_gpu_id=i * s.tp_size if s.weight_sync == "tensor" else None,
                           enable_deterministic_inference=s.deterministic_inference,
                           enable_fp32_lm_head=cfg.model.fp32_lm_head,
                           enable_return_routed_experts=routed_experts,
                           device=s.device, cpu_threads=s.cpu_threads, dtype=SGLANG_DTYPES[dtype],
                           max_total_tokens=engine_kv_tokens(cfg),
                           extra_args=tuple(s.extra_args), command=command)
            for i in range(s.num_engines)]


def build_sglang_engine(cfg: Config, model_dir: Path, output_dir: Path, dtype: torch.dtype = torch.float32):
    model = check_sglang_model(model_dir)
    routes_shape = routed_experts_shape(cfg, model)
    from megatron_grpo.rollout.sglang.client import SGLangClient
    from megatron_grpo.rollout.sglang.engine import EngineOptions, SGLangEngine
    from megatron_grpo.rollout.sglang.http_json import RetryPolicy
    from megatron_grpo.rollout.sglang.launcher import RouterSettings, SGLangLauncher
    from megatron_grpo.rollout.sglang.pool import EnginePool, EngineSlot
    from megatron_grpo.rollout.sglang.weight_sync import (DiskTransport, DistributedTransport, EngineTarget,
                                                          TensorTransport)

    s = cfg.rollout.sglang
    api_key = None
    if s.api_key_env:
        api_key = os.environ.get(s.api_key_env)
        if not api_key:
            raise ConfigError(f"rollout.sglang.api_key_env={s.api_key_env}: that environment variable is not set")
    elif not s.urls:
        # servers started here answer only this run, even on loopback (every user of the node reaches it)
        api_key = secrets.token_urlsafe(32)
    launcher, router_url = None, None
    if s.urls:
        urls, router_url = list(s.urls), s.router_url
    else:
        command = tuple(s.launch_command) or (sys.executable, "-m", "sglang.launch_server")
        servers = launched_server_settings(cfg, model_dir, api_key, routes_shape is not None, dtype, command)
        router = None
        if s.router:
            router = RouterSettings(host=s.host, port=s.router_port, policy=s.router_policy, api_key=api_key,
                                    command=tuple(s.router_command) or (sys.executable, "-m",
                                                                        "sglang_router.launch_router"))
        launcher = SGLangLauncher(servers=servers, log_dir=output_dir / "sglang_logs", router=router)
        launcher.start()
        try:
            router_url = launcher.wait_healthy(timeout_s=s.startup_timeout_s)
        except BaseException:
            launcher.shutdown()
            raise
        urls = [server.url for server in servers]
    client = SGLangClient(urls, concurrency=s.max_concurrency, timeout_s=s.request_timeout_s,
                          retry=RetryPolicy(max_attempts=s.max_retries + 1), api_key=api_key)
    targets = [EngineTarget(url, s.tp_size) for url in urls]
    slots = [EngineSlot(t, restart=None if launcher is None else _restarter(launcher, i, s.startup_timeout_s))
             for i, t in enumerate(targets)]
    pool = EnginePool(slots, min_engines=s.min_engines, probe_timeout_s=s.health_check_timeout_s, api_key=api_key)
    bucket_bytes = cfg.rollout.weight_bucket_mb * 2**20
    try:
        if s.weight_sync == "distributed":
            master = os.environ.get("MASTER_ADDR", "127.0.0.1")
            transport = DistributedTransport(client, targets, master, 0,
                                             backend="nccl" if torch.cuda.is_available() else "gloo",
                                             bucket_bytes=bucket_bytes, timeout_s=s.weight_update_timeout_s)
            transport.connect()
        elif s.weight_sync == "disk":
            transport = DiskTransport(client, targets, s.disk_sync_dir or output_dir / "weight_sync",
                                      side_files_from=model_dir, timeout_s=s.weight_update_timeout_s)
        else:  # colocated: each trainer rank feeds the engine on its GPU (trainer/sync/stage_sync.py)
            transport = TensorTransport(client, targets, bucket_bytes=bucket_bytes, timeout_s=s.weight_update_timeout_s)
        # the router spreads what it is given over the engines: max_concurrency for each of them
        generate_client = SGLangClient([router_url], concurrency=s.max_concurrency, engines_per_url=len(urls),
                                       timeout_s=s.request_timeout_s, retry=RetryPolicy(max_attempts=s.max_retries + 1),
                                       api_key=api_key) if router_url else None
        engine = SGLangEngine(client, transport, generate_client=generate_client, pool=pool, options=EngineOptions(
            send_seeds=s.deterministic_inference, verify_interval=s.verify_interval,
            health_check_interval_s=s.health_check_interval_s, health_check_timeout_s=s.health_check_timeout_s,
            min_engines=s.min_engines, resubmit_aborted=rollouts_run_ahead(cfg),
            routed_experts_shape=routes_shape, model=model), launcher=launcher)
        health = engine.health()
        if not health:
            raise MegatronGRPOError(f"SGLang engines are not healthy at start: {health.detail}")
        _check_server_flags(client, urls, deterministic=s.deterministic_inference,
                            fp32_lm_head=cfg.model.fp32_lm_head, routed_experts=routes_shape is not None)
    except BaseException:
        client.close()
        if launcher is not None:
            launcher.shutdown()
        raise
    return engine


def _restarter(launcher, index: int, timeout_s: float):
    return lambda: launcher.restart(index, timeout_s=timeout_s)


def _check_server_flags(client, urls: list[str], *, deterministic: bool, fp32_lm_head: bool,
                        routed_experts: bool = False) -> None:
    """Each server's /server_info against the recipe: a server without --enable-deterministic-inference
    ignores the seeds the trainer sends (a warning); an LM head in another precision than the
    trainer's (model.fp32_lm_head) is a mismatch on every token (an error); with routing replay, a
    server without --enable-return-routed-experts ignores return_routed_experts (an error)."""
    from megatron_grpo.rollout.sglang.errors import SGLangError

    for url in urls:
        try:
            info = client.call(url, "/server_info", method="GET", timeout_s=60.0)
        except SGLangError as exc:
            log.warning("cannot read %s/server_info (%s): rollout reproducibility and the LM head's precision "
                        "are unchecked", url, exc)
            continue
        if deterministic and not info.get("enable_deterministic_inference"):
            log.warning("%s runs without --enable-deterministic-inference: it ignores sampling_seed, so rollouts "
                        "are not reproducible (start it with that flag, or set "
                        "rollout.sglang.deterministic_inference=false to stop sending seeds)", url)
        if routed_experts and not info.get("enable_return_routed_experts"):
            raise MegatronGRPOError(
                f"{url} runs without --enable-return-routed-experts but actor.moe_routing_replay=true: SGLang "
                f"ignores return_routed_experts without it, so no routes would come back (restart the server with "
                f"the flag, or set actor.moe_routing_replay=false)")
        engine_fp32 = bool(info.get("enable_fp32_lm_head"))
        if engine_fp32 != fp32_lm_head:
            raise MegatronGRPOError(
                f"{url} runs {'with' if engine_fp32 else 'without'} --enable-fp32-lm-head but model.fp32_lm_head="
                f"{str(fp32_lm_head).lower()}: the engine's and the trainer's LM heads must compute in the same "
                f"precision (restart the server {'without' if engine_fp32 else 'with'} the flag, or set "
                f"model.fp32_lm_head={str(engine_fp32).lower()})")
