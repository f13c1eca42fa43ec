"""`accelerate launch`: the verdict on each of its flags and config-file keys, and the variable
each flag travels in to the script (accelerate.utils.launch). docs/strategies.md's accelerate table is this
table; `accelerate_launch` reads the variables. The verdicts:

- `launcher`: accelerate's launcher acts on it (how many processes, where, their environment);
  harness runs inside what it started.
- `honoured`: harness reads the variable accelerate sets and does what it asks.
- `said`: harness already does it its own way; a value asking otherwise is said in the log.
- `refused`: any value but the default is refused in one line.
"""

from __future__ import annotations

LAUNCHER, HONOURED, SAID, REFUSED = "launcher", "honoured", "said", "refused"

_STARTS = "accelerate's launcher uses it to start the processes"
_TPU = "TPU launches only (harness does not run on TPUs)"
_NVME = "(accelerate 1.15's launcher does not pass the flag: export it, or give a DeepSpeed file)"

# flag (its argparse dest; a trailing `*` covers every flag with that prefix) -> (verdict, what harness does)
FLAGS: dict[str, tuple[str, str]] = {
    "config_file": (LAUNCHER, "accelerate reads it into these flags"),
    "quiet": (LAUNCHER, "accelerate's own output"),
    "cpu": (HONOURED, "`ACCELERATE_USE_CPU`: the run config's `device=cpu`"),
    "multi_gpu": (LAUNCHER, "starts the ranks with torchrun; the strategy is DDP unless the run config or other flags say"),
    "tpu": (LAUNCHER, _TPU),
    "mixed_precision": (HONOURED, "the run config's `precision` (`fp8` refused)"),
    "num_processes": (LAUNCHER, _STARTS),
    "num_machines": (LAUNCHER, _STARTS),
    "num_cpu_threads_per_process": (LAUNCHER, "`OMP_NUM_THREADS` of each process"),
    "enable_cpu_affinity": (REFUSED, "harness does not pin ranks to cores"),
    "dynamo_backend": (
        HONOURED,
        "`inductor`: the run config's `memory.compile` (`model`, or `block` when regional); any other backend refused",
    ),
    "dynamo_mode": (REFUSED, "harness compiles in torch.compile's default mode; another mode is refused"),
    "dynamo_use_fullgraph": (REFUSED, "harness compiles without fullgraph; `true` is refused"),
    "dynamo_use_dynamic": (REFUSED, "harness compiles with torch.compile's default shape handling; `true` is refused"),
    "dynamo_use_regional_compilation": (HONOURED, "with `--dynamo_backend inductor`: `memory.compile=block` (each decoder block)"),
    "use_deepspeed": (HONOURED, "the strategy is DeepSpeed (a shipped `zero*` file shaped by the flags below, or the given file)"),
    "use_fsdp": (HONOURED, "the strategy is FSDP2 (`fsdp`, `fsdp_grad_op` or `fsdp_offload` by the flags below)"),
    "use_parallelism_config": (HONOURED, "the `parallelism_config_*` sizes are checked against the launch (below)"),
    "use_megatron_lm": (REFUSED, "harness does not run Megatron-LM"),
    "gpu_ids": (LAUNCHER, "`CUDA_VISIBLE_DEVICES` of each process"),
    "same_network": (LAUNCHER, _STARTS),
    "machine_rank": (LAUNCHER, _STARTS),
    "main_process_ip": (LAUNCHER, "`MASTER_ADDR`, read by harness's process group"),
    "main_process_port": (LAUNCHER, "`MASTER_PORT`, read by harness's process group"),
    "tee": (LAUNCHER, "torchrun's output handling"),
    "log_dir": (LAUNCHER, "torchrun's output handling"),
    "role": (LAUNCHER, _STARTS),
    "rdzv_backend": (LAUNCHER, _STARTS),
    "rdzv_conf": (LAUNCHER, _STARTS),
    "max_restarts": (LAUNCHER, "torchrun restarts the ranks; harness resumes from its last checkpoint with `checkpoint.resume=auto`"),
    "monitor_interval": (LAUNCHER, _STARTS),
    "module": (LAUNCHER, "how accelerate starts the script"),
    "no_python": (LAUNCHER, "how accelerate starts the script"),
    "tpu_*": (LAUNCHER, _TPU),
    "vm": (LAUNCHER, _TPU),
    "env": (LAUNCHER, _TPU),
    "main_training_function": (LAUNCHER, "TPU and notebook launches only; harness's entry point is `main()`"),
    "downcast_bf16": (LAUNCHER, _TPU),
    "deepspeed_config_file": (HONOURED, "the strategy file, resolved and checked as any DeepSpeed file"),
    "zero_stage": (HONOURED, "chooses the shipped file; with a file, must be its stage"),
    "offload_optimizer_device": (HONOURED, "the file's `offload_optimizer.device` where the file leaves it out; `nvme` needs a path"),
    "offload_param_device": (HONOURED, "the file's `offload_param.device` where the file leaves it out; `nvme` needs a path"),
    "offload_optimizer_nvme_path": (
        HONOURED,
        f"as `ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH` {_NVME}",
    ),
    "offload_param_nvme_path": (
        HONOURED,
        f"as `ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH` {_NVME}",
    ),
    "gradient_accumulation_steps": (HONOURED, "the run config's `grad_accum`"),
    "gradient_clipping": (HONOURED, "the run config's `optim.grad_clip`"),
    "zero3_init_flag": (HONOURED, "`true` is what harness does at stage 3 (zero.Init); `false` at stage 3 is refused"),
    "zero3_save_16bit_model": (HONOURED, "the file's `stage3_gather_16bit_weights_on_model_save`"),
    "deepspeed_hostfile": (LAUNCHER, "accelerate's multi-node DeepSpeed launch"),
    "deepspeed_exclusion_filter": (LAUNCHER, "accelerate's multi-node DeepSpeed launch"),
    "deepspeed_inclusion_filter": (LAUNCHER, "accelerate's multi-node DeepSpeed launch"),
    "deepspeed_multinode_launcher": (LAUNCHER, "accelerate's multi-node DeepSpeed launch"),
    "deepspeed_moe_layer_cls_names": (REFUSED, "harness builds no MoE leaf modules"),
    "fsdp_version": (SAID, "harness shards with FSDP2 (torch's `fully_shard`); `1` is said in the log"),
    "fsdp_offload_params": (HONOURED, "`true`: `fsdp_offload` (FSDP2's CPUOffloadPolicy)"),
    "fsdp_min_num_params": (HONOURED, "read only by `SIZE_BASED_WRAP`, which is refused"),
    "fsdp_sharding_strategy": (HONOURED, "`FULL_SHARD`: `fsdp`; `SHARD_GRAD_OP`: `fsdp_grad_op`; `NO_SHARD`: `ddp`; hybrid refused"),
    "fsdp_reshard_after_forward": (HONOURED, "`false`: `fsdp_grad_op` (parameters stay gathered until backward)"),
    "fsdp_auto_wrap_policy": (
        HONOURED,
        "`TRANSFORMER_BASED_WRAP` is what harness does (one FSDP2 unit per decoder block); `SIZE_BASED_WRAP` and `NO_WRAP` refused",
    ),
    "fsdp_transformer_layer_cls_to_wrap": (
        HONOURED,
        "must name the model's decoder block class; a class the model lacks is refused naming those it has",
    ),
    "fsdp_backward_prefetch": (HONOURED, "`BACKWARD_PRE` is FSDP2's own prefetch; `BACKWARD_POST` and `NO_PREFETCH` refused"),
    "fsdp_state_dict_type": (
        SAID,
        "checkpoints are sharded (DCP, resumable at any world size), `python -m harness.export` writes the whole model; "
        "`FULL_STATE_DICT` is said in the log",
    ),
    "fsdp_forward_prefetch": (
        SAID,
        "a speed hint: FSDP2 issues the next block's all-gather ahead of its forward on its own; `true` is said in the log",
    ),
    "fsdp_use_orig_params": (SAID, "FSDP2 always keeps the original parameters; `false` is said in the log"),
    "fsdp_cpu_ram_efficient_loading": (SAID, "harness always loads each rank's part only; `false` is said in the log"),
    "fsdp_sync_module_states": (SAID, "every rank fills its part from the same weights; `false` is said in the log"),
    "fsdp_activation_checkpointing": (HONOURED, "`true`: the run config's `memory.activation_checkpointing=full` (every decoder block)"),
    "fsdp_activation_checkpointing_offload": (REFUSED, "checkpointed block inputs stay on the device; `true` is refused"),
    "fsdp_ignored_modules": (REFUSED, "a key of the file's `fsdp_config` (no flag): harness shards every module"),
    "megatron_lm_*": (REFUSED, "harness does not run Megatron-LM (`--use_megatron_lm` is refused)"),
    "fp8_*": (REFUSED, "passed only with `--mixed_precision fp8`, which is refused"),
    "aws_access_key_id": (LAUNCHER, "SageMaker launches only"),
    "aws_secret_access_key": (LAUNCHER, "SageMaker launches only"),
    "debug": (REFUSED, "harness has no collective shape checks; `true` is refused"),
    "training_script": (LAUNCHER, "`harness/train.py`"),
    "training_script_args": (LAUNCHER, "harness's own arguments (`--config`, `key=value`)"),
    "mpirun_hostfile": (LAUNCHER, "accelerate's multi-CPU mpirun launch"),
    "parallelism_config_dp_shard_size": (HONOURED, "must be the world size with FSDP (harness shards over every rank)"),
    "parallelism_config_dp_replicate_size": (HONOURED, "`1`; larger (hybrid sharding, HSDP) is refused"),
    "parallelism_config_tp_size": (REFUSED, "harness trains data-parallel only; above `1` refused"),
    "parallelism_config_cp_size": (REFUSED, "context parallelism (ring attention) is not in harness; above `1` refused"),
    "parallelism_config_cp_backend": (REFUSED, "read only with `cp_size` above 1, which is refused"),
    "parallelism_config_cp_comm_strategy": (REFUSED, "read only with `cp_size` above 1, which is refused"),
    "parallelism_config_sp_size": (
        HONOURED,
        "the run config's `parallel.sequence` (harness's Ulysses sequence parallelism, torch engines)",
    ),
    "parallelism_config_sp_backend": (SAID, "`deepspeed` (accelerate's one choice) runs as harness's own Ulysses; said in the log"),
    "parallelism_config_sp_seq_length": (SAID, "harness splits every block of `data.seq_len`; said in the log"),
    "parallelism_config_sp_seq_length_is_variable": (SAID, "harness's blocks are all `data.seq_len` long; said in the log"),
    "parallelism_config_sp_attn_implementation": (HONOURED, "`sdpa` is what harness's Ulysses runs; another value is refused"),
}

# Keys of a config file's sections that accelerate reads with no flag of their own
SECTION_ONLY_KEYS = ("fsdp_ignored_modules",)

# accelerate's config file: its top-level keys (ClusterConfig and BaseConfig) -> the flags they set
CONFIG_KEYS: dict[str, str] = {
    "compute_environment": "`LOCAL_MACHINE`; SageMaker launches are accelerate's own",
    "distributed_type": "`--multi_gpu`, `--use_deepspeed`, `--use_fsdp`, `--use_megatron_lm`, `--tpu` (`NO`, `MULTI_CPU`: DDP)",
    "use_cpu": "`--cpu`",
    "debug": "`--debug`",
    "mixed_precision": "`--mixed_precision`",
    "num_processes": "`--num_processes`",
    "machine_rank": "`--machine_rank`",
    "num_machines": "`--num_machines`",
    "gpu_ids": "`--gpu_ids`",
    "main_process_ip": "`--main_process_ip`",
    "main_process_port": "`--main_process_port`",
    "rdzv_backend": "`--rdzv_backend`",
    "same_network": "`--same_network`",
    "main_training_function": "`--main_training_function`",
    "enable_cpu_affinity": "`--enable_cpu_affinity`",
    "downcast_bf16": "`--downcast_bf16`",
    "deepspeed_config": "the `--deepspeed_*`/`--zero*`/`--offload_*`/`--gradient_*` flags of the same names",
    "fsdp_config": "the `--fsdp_*` flags of the same names",
    "parallelism_config": "the `--parallelism_config_*` flags of the same names",
    "dynamo_config": "the `--dynamo_*` flags of the same names",
    "fp8_config": "the `--fp8_*` flags",
    "megatron_lm_config": "the `--megatron_lm_*` flags",
    "mpirun_config": "`--mpirun_hostfile`",
    "tpu_name": _TPU,
    "tpu_zone": _TPU,
    "tpu_use_cluster": _TPU,
    "tpu_use_sudo": _TPU,
    "command_file": _TPU,
    "commands": _TPU,
    "tpu_vm": _TPU,
    "tpu_env": _TPU,
}


def flag_of(dest: str) -> tuple[str, str]:
    """The verdict on one of accelerate's flags (its argparse dest), by exact name or prefix row."""
    if dest in FLAGS:
        return FLAGS[dest]
    for name, row in FLAGS.items():
        if name.endswith("*") and dest.startswith(name[:-1]):
            return row
    raise KeyError(dest)


# Every variable accelerate's launcher sets for the script (accelerate.utils.launch) -> the flag it
# carries (a trailing `*`: every variable with that prefix). The flag's verdict is the variable's.
VARIABLES: dict[str, str] = {
    "ACCELERATE_CONFIG_DS_FIELDS": "config_file",  # which DeepSpeed fields came from the file: accelerate's own bookkeeping
    "ACCELERATE_CPU_AFFINITY": "enable_cpu_affinity",
    "ACCELERATE_DEBUG_MODE": "debug",
    "ACCELERATE_DEEPSPEED_CONFIG_FILE": "deepspeed_config_file",
    "ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES": "deepspeed_moe_layer_cls_names",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE": "offload_optimizer_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE": "offload_param_device",
    "ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_NVME_PATH": "offload_optimizer_nvme_path",
    "ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_NVME_PATH": "offload_param_nvme_path",
    "ACCELERATE_DEEPSPEED_ZERO3_INIT": "zero3_init_flag",
    "ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL": "zero3_save_16bit_model",
    "ACCELERATE_DEEPSPEED_ZERO_STAGE": "zero_stage",
    "ACCELERATE_DYNAMO_BACKEND": "dynamo_backend",
    "ACCELERATE_DYNAMO_MODE": "dynamo_mode",
    "ACCELERATE_DYNAMO_USE_DYNAMIC": "dynamo_use_dynamic",
    "ACCELERATE_DYNAMO_USE_FULLGRAPH": "dynamo_use_fullgraph",
    "ACCELERATE_DYNAMO_USE_REGIONAL_COMPILATION": "dynamo_use_regional_compilation",
    "ACCELERATE_FP8_*": "fp8_*",
    "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "gradient_accumulation_steps",
    "ACCELERATE_GRADIENT_CLIPPING": "gradient_clipping",
    "ACCELERATE_MIXED_PRECISION": "mixed_precision",
    "ACCELERATE_USE_CPU": "cpu",
    "ACCELERATE_USE_DEEPSPEED": "use_deepspeed",
    "ACCELERATE_USE_FSDP": "use_fsdp",
    "ACCELERATE_USE_MEGATRON_LM": "use_megatron_lm",
    "ACCELERATE_USE_PARALLELISM_CONFIG": "use_parallelism_config",
    "MEGATRON_LM_*": "megatron_lm_*",
    "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": "parallelism_config_dp_replicate_size",
    "PARALLELISM_CONFIG_DP_SHARD_SIZE": "parallelism_config_dp_shard_size",
    "PARALLELISM_CONFIG_TP_SIZE": "parallelism_config_tp_size",
    "PARALLELISM_CONFIG_CP_SIZE": "parallelism_config_cp_size",
    "PARALLELISM_CONFIG_CP_BACKEND": "parallelism_config_cp_backend",
    "PARALLELISM_CONFIG_CP_COMM_STRATEGY": "parallelism_config_cp_comm_strategy",
    "PARALLELISM_CONFIG_SP_SIZE": "parallelism_config_sp_size",
    "PARALLELISM_CONFIG_SP_BACKEND": "parallelism_config_sp_backend",
    "PARALLELISM_CONFIG_SP_SEQ_LENGTH": "parallelism_config_sp_seq_length",
    "PARALLELISM_CONFIG_SP_SEQ_LENGTH_IS_VARIABLE": "parallelism_config_sp_seq_length_is_variable",
    "PARALLELISM_CONFIG_SP_ATTN_IMPLEMENTATION": "parallelism_config_sp_attn_implementation",
    **{
        f"FSDP_{name.upper()}": f"fsdp_{name}"
        for name in (
            "version",
            "offload_params",
            "min_num_params",
            "sharding_strategy",
            "reshard_after_forward",
            "auto_wrap_policy",
            "backward_prefetch",
            "state_dict_type",
            "forward_prefetch",
            "use_orig_params",
            "cpu_ram_efficient_loading",
            "sync_module_states",
            "activation_checkpointing",
            "activation_checkpointing_offload",
            "ignored_modules",
        )
    },
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "fsdp_transformer_layer_cls_to_wrap",
    **dict.fromkeys(("MASTER_ADDR", "MASTER_PORT"), "main_process_ip"),
    **dict.fromkeys(("OMP_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME"), "num_cpu_threads_per_process"),
    **dict.fromkeys(
        ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "HABANA_VISIBLE_MODULES", "MLU_VISIBLE_DEVICES", "MUSA_VISIBLE_DEVICES")
        + ("NEURON_RT_VISIBLE_CORES", "SDAA_VISIBLE_DEVICES", "ZE_AFFINITY_MASK"),
        "gpu_ids",
    ),
    **dict.fromkeys(("XLA_DOWNCAST_BF16", "XLA_USE_BF16"), "downcast_bf16"),
    "PYTHONPATH": "training_script",
}
