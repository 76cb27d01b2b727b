"""launch.distributed.on_rank0 / rank0_only on 2 gloo ranks: rank 0's result or failure reaches
every rank, so no rank is left waiting in the next collective."""
from megatron_grpo.testing.distributed import run_distributed


def _rank0_outcomes(rank, world_size):
    import torch.distributed as dist

    from megatron_grpo.errors import ConfigError, Rank0Failure
    from megatron_grpo.launch.collectives import on_rank0, rank0_only

    def fails_with(error):
        def fn():
            if dist.get_rank() != 0:
                raise AssertionError("ran on another rank")
            raise error
        return fn

    outcomes = {"shared": on_rank0(lambda: {"rank": dist.get_rank()}),
                "kept": rank0_only(lambda: object()) is not None}
    for name, error in (("project", ConfigError("data.train_files: no such file")),
                        ("bug", ZeroDivisionError("division by zero"))):
        try:
            on_rank0(fails_with(error))
        except (ConfigError, ZeroDivisionError, Rank0Failure) as exc:
            outcomes[name] = f"{type(exc).__name__}: {exc}"
    dist.barrier()  # every rank got here: nobody is still waiting on rank 0
    return outcomes


def test_rank0_results_and_failures_reach_every_rank():
    rank0, rank1 = run_distributed(_rank0_outcomes, 2, timeout=120)
    assert rank0["shared"] == rank1["shared"] == {"rank": 0}
    assert (rank0["kept"], rank1["kept"]) == (True, False)
    assert rank0["project"] == rank1["project"] == "ConfigError: data.train_files: no such file"
    assert rank0["bug"] == "ZeroDivisionError: division by zero"
    assert rank1["bug"] == "Rank0Failure: rank 0 failed: ZeroDivisionError: division by zero"
