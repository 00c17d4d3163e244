"""Ranks agree (issue #30) under Lightning: the lean presets' random bits are the same on every
rank when the ranks seed their generators differently (``seed_everything(BASE + global_rank)``
in ``configure_optimizers``, before the optimizer is built).

- DDP (``tests/_ranks_agree_ddp_worker.py``): ``bf16_sr`` and ``bf16_lean`` wrap the AdamW in a
  ``MasterWeightOptimizer``; each rank reads other rows; after 20 steps both ranks hold the same
  weights and optimizer state bit for bit. (The plain-loop test,
  ``master_weights/test_ranks_agree_plain.py``, shows the same comparison failing without the
  shared seed.)
- FSDP2 (``tests/_ranks_agree_fsdp2_worker.py``, ``ModelParallelStrategy``): the presets wrap the
  AdamW in ``Bf16MomentsAdam``. A sharded tensor has one copy, so the gathered weights agree
  across ranks by construction; what the seed and the shard offsets decide is whether the shards
  round as the whole tensor would. With the same batch on both ranks the run equals, bit for bit,
  one process stepping the unsharded FP32 model with ``Bf16MomentsAdam`` and rank 0's seed
  (weights and gathered moments); two controls, one without the seed broadcast and one keying
  every shard at offset 0, break that equality.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _ddp_launch import assert_bitwise_equal, run_ddp_worker
from _ranks_agree_fsdp2_worker import STEPS as FSDP2_STEPS
from _ranks_agree_fsdp2_worker import reference


def differing(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int((x != y).sum()) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ddp_worker("_ranks_agree_ddp_worker.py", tmp_path_factory.mktemp("ranks_agree_ddp"))


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> list[dict[str, Any]]:
    return run_ddp_worker("_ranks_agree_fsdp2_worker.py", tmp_path_factory.mktemp("ranks_agree_fsdp2"))


def single_process(run: dict[str, Any]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The unsharded reference of a worker's run, in this process (no process group), on one
    thread as the workers run: with two, the LayerNorm's weight gradient sums its rows in another
    order and the FP32 moments differ in their last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return reference(run["init"], run["bf16_moments"], run["sr"]["sr_seed"], run["emulating"])
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------- DDP
@pytest.mark.slow
@pytest.mark.xdist_group("ranks_agree_ddp")
@pytest.mark.parametrize("preset", ["bf16_sr", "bf16_lean"])
def test_lightning_ddp_ranks_seeded_differently_end_identical(ddp, preset):
    r0, r1 = ddp[0][preset], ddp[1][preset]
    assert r0["optimizer"] == "MasterWeightOptimizer" and r0["global_step"] == 20
    assert r0["state"]["master_kind"] == {"bf16_sr": "stochastic", "bf16_lean": "bf16_split"}[preset]
    # the premise: other seeds when the optimizer was built, other rows, the same start
    assert (r0["seed"], r1["seed"]) == (1234, 1235)
    assert not torch.equal(r0["first_batch"], r1["first_batch"])
    assert_bitwise_equal(r0["init"], r1["init"])
    # BF16 but for the LayerNorm (kept FP32, with FP32 moments)
    dtypes = [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 4
    assert [p.dtype for p in r0["params"]] == dtypes
    assert [s["exp_avg"].dtype for _, s in sorted(r0["state"]["state"].items())] == dtypes
    assert differing(r0["init"], r0["params"]) > 0.8 * sum(p.numel() for p in r0["params"])
    # rank 0's rounding seed on both; weights, moments, masters and counter bit for bit
    assert r0["state"]["sr_generator"] == r1["state"]["sr_generator"]
    assert r0["state"]["sr_generator"]["counter"] == 20
    assert_bitwise_equal(r0["params"], r1["params"], "params")
    assert_bitwise_equal(r0["state"], r1["state"], "state")


# ---------------------------------------------------------------------------------- FSDP2
@pytest.mark.slow
@pytest.mark.xdist_group("ranks_agree_fsdp2")
@pytest.mark.parametrize("preset", ["bf16_lean", "bf16_sr"])
def test_fsdp2_shards_round_as_one_process_rounds_the_whole_tensor(fsdp2, preset):
    """Bit for bit one process's ``Bf16MomentsAdam`` on the unsharded model with rank 0's seed.
    Exact because both ranks read the same batch: the reduce-scatter then averages two equal
    FP32 gradients, which is exact; with other batches per rank the average of two per-rank
    gradients is not bitwise the gradient of the joined batch (another summation order), so the
    comparison with one process would need a tolerance and could not see a rounding bit."""
    r0, r1 = fsdp2[0][preset], fsdp2[1][preset]
    assert r0["optimizer"] == "Bf16MomentsAdam" and r0["global_step"] == FSDP2_STEPS
    assert (r0["seed"], r1["seed"]) == (1234, 1235)  # seeded differently before the optimizer was built
    # the replicated state: rank 0's seed and the same counter on both
    assert r0["sr"] == r1["sr"] and r0["sr"]["sr_counter"] == FSDP2_STEPS
    # BF16 moments but for the LayerNorm's (FP32, as its unit is gathered in FP32)
    assert r0["bf16_moments"] == [True, True, False, False, True, True, True, True]
    assert [m.dtype for m in r0["moments"][::2]] == [torch.bfloat16] * 2 + [torch.float32] * 2 + [torch.bfloat16] * 4
    # sharded on dim 0, the last layer unevenly (3 rows: 2 and 1)
    assert r0["local_shapes"][-2:] == [(2, 32), (2,)] and r1["local_shapes"][-2:] == [(1, 32), (1,)]
    assert_bitwise_equal(r0["params"], r1["params"], "params")
    assert_bitwise_equal(r0["moments"], r1["moments"], "moments")
    assert all(s == FSDP2_STEPS for s in r0["steps"])
    assert differing(r0["init"], r0["params"]) > 0.8 * sum(p.numel() for p in r0["params"])

    weights, moments = single_process(r0)
    assert_bitwise_equal(weights, r0["params"], "weights vs one process")
    assert_bitwise_equal(moments, r0["moments"], "moments vs one process")


@pytest.mark.slow
@pytest.mark.xdist_group("ranks_agree_fsdp2")
@pytest.mark.parametrize("control", ["local_seed", "offset_zero"])
def test_fsdp2_without_the_shared_seed_or_the_offsets_the_shards_round_otherwise(fsdp2, control):
    """The controls show the comparison above can fail: with each rank's own seed
    (``local_seed``), or with every shard rounding with the bits of a tensor's first elements
    (``offset_zero``), rank 1's shards round with other bits than one process would."""
    r0, r1 = fsdp2[0][control], fsdp2[1][control]
    if control == "local_seed":
        assert r0["sr"]["sr_seed"] != r1["sr"]["sr_seed"]
        assert r0["sr"]["sr_seed"] == fsdp2[0]["bf16_lean"]["sr"]["sr_seed"]  # rank 0 drew what it broadcasts
    else:
        assert r0["sr"] == r1["sr"]
    weights, moments = single_process(r0)  # rank 0's seed
    total = sum(p.numel() for p in weights)
    # measured: 1031 and 1137 of 1507 weights, 1163 and 1388 of 3014 moment elements differ after 10 steps
    assert differing(weights, r0["params"]) > 0.3 * total
    assert differing(moments, r0["moments"]) > 0.2 * 2 * total
