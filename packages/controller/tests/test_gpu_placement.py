"""A colocated server's GPUs from recorded inventories (`cluster.gpu_placement`), and the
trainer's estimated peak memory (`run.memory_estimate`) against numbers worked out by hand from
its docstring's formulas."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tephra.controller.cluster.gpu_placement import rank_gpus, server_gpus
from tephra.controller.run.memory_estimate import EngineShape, ModelSize, trainer_memory
from tephra.core.errors import ConfigError
from tephra.rollout.fixtures import tiny_model  # noqa: F401 (a fixture)

INVENTORIES = json.loads((Path(__file__).parent / "data" / "gpu_inventories.json").read_text())
H100 = 85_045_231_616
H200 = 150_110_011_392


def inventory(name: str):
    return rank_gpus(INVENTORIES[name])


def test_each_server_gets_the_gpus_of_its_ranks_in_rank_order():
    plans = server_gpus(inventory("two_nodes_of_8_h100"), 2, "vllm")
    assert [p.owner for p in plans] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert [p.visible_devices for p in plans[:4]] == ["0,1", "2,3", "4,5", "6,7"]
    assert plans[4].visible_devices == "0,1" and plans[4].ranks == (8, 9)  # node b
    assert {p.total_bytes for p in plans} == {H100}
    eight = server_gpus(inventory("two_nodes_of_8_h100"), 8, "vllm")
    assert [(p.owner, p.visible_devices) for p in eight] == [
        (0, "0,1,2,3,4,5,6,7"),
        (8, "0,1,2,3,4,5,6,7"),
    ]
    # a one-GPU server keeps its rank's own GPU
    assert server_gpus(inventory("two_nodes_of_6_h200"), 1, "sglang")[7].visible_devices == "1"


def test_the_smallest_gpu_of_a_server_bounds_its_memory():
    (plan,) = server_gpus(inventory("mixed_memory_node"), 2, "vllm")
    assert (plan.visible_devices, plan.total_bytes) == ("4,5", H100)


def test_a_server_over_two_nodes_is_refused_naming_the_fix():
    # 6 GPUs per node: ranks 4..7 of a 4-GPU server straddle nodes c and d
    with pytest.raises(
        ConfigError,
        match=r"rollout\.vllm\.tensor_parallel_size=4 colocated: ranks \[4, 5, 6, 7\] of one "
        r"server landed on 2 nodes .*GPU count is a multiple of 4 with resources\.placement=PACK",
    ):
        server_gpus(inventory("two_nodes_of_6_h200"), 4, "vllm")
    assert len(server_gpus(inventory("two_nodes_of_6_h200"), 3, "vllm")) == 4  # 6 = 2 x 3


def test_one_gpu_servers_of_ranks_sharing_a_gpu_know_how_many_share_it():
    plans = server_gpus(inventory("four_ranks_on_two_gpus"), 1, "vllm")
    assert [(p.visible_devices, p.sharing) for p in plans] == [
        ("0", 2),
        ("0", 2),
        ("1", 2),
        ("1", 2),
    ]
    assert {p.sharing for p in server_gpus(inventory("two_nodes_of_8_h100"), 2, "vllm")} == {1}
    # GPU "0" of two different nodes is two GPUs
    assert {p.sharing for p in server_gpus(inventory("two_nodes_of_6_h200"), 1, "vllm")} == {1}


def test_ranks_sharing_a_gpu_are_refused():
    with pytest.raises(
        ConfigError,
        match=r"tensor_parallel_size=2 colocated: ranks \[0, 1\] share GPUs \['0', '0'\] "
        r"\(fractional resources\.gpus_per_rank\).*set resources\.gpus_per_rank=1",
    ):
        server_gpus(inventory("four_ranks_on_two_gpus"), 2, "sglang")


# ---- the trainer's peak: a 1.5B model (28 layers, hidden 1536, MLP 8960, vocabulary 151936),
# bf16 compute, fp32 master weights, FSDP over 8 ranks, 4096 tokens per micro-batch ----------
SIZE = ModelSize(params=1_500_000_000, layers=28, hidden=1536, intermediate=8960, vocab=151936)
ACTOR = EngineShape(
    compute_dtype="bfloat16",
    master_dtype="float32",
    shard=8,
    tensor=1,
    context=1,
    tokens_per_microbatch=4096,
)
WEIGHTS = 750_000_000 + 214_285_714  # 1.5e9 x 4 / 8, + 2 layers gathered: 3e9 // 28 x 2
GRADS = 750_000_000  # 1.5e9 x 4 / 8
ADAM = 1_500_000_000  # 2 x 1.5e9 x 4 / 8
ACTIVATIONS = 7_574_913_024  # 4096 x 28 x (4 x 1536 + 3 x 8960) x 2
LOGITS = 6_223_298_560  # 4096 x 151936 x (2 + 8)


def test_the_actors_peak_is_its_shard_of_state_and_one_micro_batch():
    memory = trainer_memory(SIZE, ACTOR)
    assert (memory.weights, memory.gradients, memory.optimizer) == (WEIGHTS, GRADS, ADAM)
    assert (memory.activations, memory.logits) == (ACTIVATIONS, LOGITS)
    assert memory.peak == 17_012_497_298
    assert memory.describe(SIZE, 8) == (
        "estimated from 1.5B params sharded 1/8: weights 0.90 + grads 0.70 + adam 1.40 + "
        "activations 7.05 + logits 5.80 GiB"
    )


def test_checkpointing_lora_offload_reference_and_critic_change_their_parts():
    checkpointed = trainer_memory(SIZE, replace(ACTOR, gradient_checkpointing=True))
    # each layer's input, 4096 x 28 x 1536 x 2, plus one layer recomputed, 4096 x 33024 x 2
    assert checkpointed.activations == 352_321_536 + 270_532_608
    lora = trainer_memory(SIZE, replace(ACTOR, lora=True))
    assert (lora.gradients, lora.optimizer) == (0, 0) and lora.weights == WEIGHTS
    offloaded = trainer_memory(SIZE, replace(ACTOR, offload_optimizer=True, offload_params=True))
    assert (offloaded.optimizer, offloaded.weights) == (0, 214_285_714)
    both = trainer_memory(SIZE, ACTOR, reference=True, critic=ACTOR)
    assert both.reference == 750_000_000
    # the critic's state; its activations (no vocabulary logits) stay under the actor's
    assert both.critic == WEIGHTS + GRADS + ADAM
    # a fused head (engine=fsdp) never holds all 4096 x 151936 logits: the 256 MiB of
    # log-probs it keeps, two 64 MiB blocks, the head weight and its gradient in fp32
    fused = trainer_memory(SIZE, replace(ACTOR, fused_head=True))
    assert fused.logits == 268_435_456 + 134_217_728 + 2 * 151936 * 1536 * 4
    assert fused.activations == ACTIVATIONS
    split = trainer_memory(SIZE, replace(ACTOR, tensor=2, context=2, shard=16))
    assert split.activations == 2048 * 28 * 33024 * 2 // 2
    assert split.gradients == 375_000_000


def test_model_size_counts_every_parameter_of_the_loaded_model(tiny_model):  # noqa: F811
    size = ModelSize.of_model(tiny_model.path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model.path, dtype=torch.float32)
    assert size.params == sum(p.numel() for p in model.parameters())
    config = model.config
    assert (size.layers, size.hidden, size.vocab) == (
        config.num_hidden_layers,
        config.hidden_size,
        config.vocab_size,
    )
